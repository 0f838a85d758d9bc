"""Sampling: vLLM's `SamplingParams`, the logit transforms and samplers that run on the device,
log-probabilities, and the grammar matchers of structured outputs.

- `samplers`: `SamplingParams`, `LogitRules`, the per-call arrays and the jitted samplers; its
  names are this package's too.
- `logprobs`: `Logprob` and the top-k `log_softmax` of raw logits.
- `structured`: `StructuredOutputsParams` (vLLM's shape) and llguidance's per-request
  `GrammarMatcher` (token bitmasks).

Names load on first access, so `jaxtier.sampling.logprobs` alone imports no sampler.
"""

from jaxtier.common.lazy import lazy_names as _lazy_names

_SAMPLERS = ("BIAS_LIMIT", "PENALTY_LIMIT", "SamplingParamError", "SamplingParams",
             "bad_words_token_ids", "LogitRules", "SamplingArrays", "MIN_HISTORY", "MIN_IDS",
             "LogitsArrays", "grammar_allowed", "transform_logits", "argmax_reference", "argmax",
             "sample", "sample_transformed", "processed_logprobs")

__all__ = sorted(_SAMPLERS)
__getattr__, __dir__ = _lazy_names(
    __name__, dict.fromkeys(_SAMPLERS, "jaxtier.sampling.samplers"), globals())
