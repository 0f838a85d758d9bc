"""jaxtier: JAX inference for LLMs that keeps working when device memory runs out."""

from jaxtier.llm import LLM, CompletionOutput, RequestOutput
from jaxtier.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
