"""The engine's arguments: one frozen dataclass, validated once, shared by `jaxtier.LLM` and every
script's flags (same names). Imports no JAX, so scripts reject bad values while parsing flags,
before any model loads.

This module is the one place an engine argument's default, range and help text are written. What
the arguments leave open ("auto", the pool sizes, the offload) is decided from the model and the
machine by `jaxtier.engine.sizing`, whose module docstring gives the rules.
"""

import dataclasses

from jaxtier.attention.names import ENGINE_ATTENTION_IMPLS
from jaxtier.common.checks import (MAX_BLOCK_SIZE, MAX_PREFETCH_DEPTH, check_bool,
                                   check_block_size, check_choice, check_int, check_offload,
                                   check_positive, check_step_limits, check_watermark,
                                   int_or_auto, is_number)
from jaxtier.common import choices
from jaxtier.common.choices import (DTYPE_BYTES, EXPERT_OFFLOAD_MODES, QUANTIZATION_GROUP_SIZES,
                                    QUANTIZATIONS, check_quantization)
from jaxtier.common.grammar_limits import GrammarLimits
from jaxtier.common.kv_bytes import ELEMENT_BYTES
from jaxtier.scheduler.policies import VICTIM_POLICIES
from jaxtier.scheduler.scheduler_config import PREEMPTION_MODES

# Each argument's fixed values: its owner's set, with "auto" where the machine decides.
DTYPES = ("auto",) + tuple(DTYPE_BYTES)
KV_CACHE_DTYPES = ("auto",) + tuple(ELEMENT_BYTES)
LAYER_EXECUTIONS = ("auto", "scan", "unrolled")
ATTENTION_IMPLS = ENGINE_ATTENTION_IMPLS
KERNELS = ("auto", "portable")
WEIGHT_FORMATS = ("auto", "float")
BLOCK_ACTIVATIONS = ("auto",) + choices.BLOCK_ACTIVATIONS
CPU_DEFAULT_KV_GB = 0.256
CPU_DEFAULT_REQUEST_TOKENS = 2048
CPU_DEFAULT_HOST_FRACTION = 0.25
HOST_PIN_FRACTION = 0.5
GB = 1e9


def _arg(default, help_text: str, choices: tuple[str, ...] | None = None):
  """A field of `EngineArgs`: its default, its help (the flag's help text) and fixed choices."""
  metadata = {"help": help_text}
  if choices is not None:
    metadata["choices"] = tuple(choices)
  return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
  """Every engine argument of `jaxtier.LLM` (and flag of the scripts), validated on creation.

  Each field is documented once, by its `help` (`dataclasses.field` metadata, read by
  `field_help`), with its fixed values, if any, as `choices`: `jaxtier.engine.flags` generates the
  scripts' flags (same names, defaults and help) from these fields, and the Attributes section of
  this docstring is built from them below.
  """
  model: str = _arg(
      "smollm2-135m-instruct",
      "a registry name, a Hugging Face directory, a .gguf file or a jaxtier Orbax directory")
  dtype: str = _arg(
      "auto", "parameter and activation dtype; auto: float32 on CPU (where bfloat16 arithmetic "
      "is emulated and no faster), bfloat16 on GPU and TPU (half the bytes over memory and the "
      "host link)", DTYPES)
  max_model_len: int | None = _arg(
      None, "context window (prompt plus generated tokens); default: the model's")
  max_num_seqs: int = _arg(
      64, "most requests running (holding device KV) at once. Default 64: on CPU a decode step "
      "of 64 rows reads the weights once for 64 tokens, and past that each row's attention over "
      "its own KV, not the weights, is most of the step")
  max_num_batched_tokens: int | None = _arg(
      None, "token budget of one step (decodes plus prefill chunks; longer prompts are prefilled "
      "in chunks); default: max(2048, max_num_seqs)")
  block_size: int = _arg(16, f"tokens per KV block, 1 to {MAX_BLOCK_SIZE}")
  num_device_blocks: int | None = _arg(
      None, "the device KV pool in blocks (or kv_cache_memory_gb, not both); default: see "
      "kv_cache_memory_gb")
  kv_cache_memory_gb: float | None = _arg(
      None, "the device KV pool in GB (or num_device_blocks, not both); default: the device "
      "memory left after weights and an activation reserve, times gpu_memory_utilization, or on "
      "CPU, where the backend reports no memory, room for max_num_seqs requests of "
      f"min(max_model_len, {CPU_DEFAULT_REQUEST_TOKENS}) tokens, at most "
      f"{CPU_DEFAULT_KV_GB * 1000:g} MB and at least one max_model_len sequence")
  num_host_blocks: int | None = _arg(
      None, "the pinned-host KV pool (for swapped-out blocks) in blocks (or swap_space_gb, not "
      "both); default: as many as the device pool, so every running request can be swapped out "
      f"once, but at most {HOST_PIN_FRACTION:g} of the host's memory less the offloaded weights "
      f"(on CPU with the default device pool: {CPU_DEFAULT_HOST_FRACTION:g} of "
      "it, as both pools are the same RAM); a pool larger than the host's memory is an error")
  swap_space_gb: float | None = _arg(
      None, "the pinned-host KV pool in GB (or num_host_blocks, not both); default: see "
      "num_host_blocks")
  gpu_memory_utilization: float = _arg(
      0.9, "the share of device memory the default device KV pool sizing may fill, in (0, 1]")
  kv_cache_dtype: str = _arg(
      "auto", "KV cache dtype; auto: the model dtype (dtype, resolved); int8 keeps a float32 "
      "scale per token",
      KV_CACHE_DTYPES)
  preemption_mode: str = _arg(
      "swap", "what happens to a preempted request's KV: swap (moved to the host pool) or "
      "recompute (dropped and prefilled again)", PREEMPTION_MODES)
  watermark: float = _arg(
      0.01, "share of device KV blocks kept free for running requests to grow into, in [0, 1)")
  victim_policy: str = _arg(
      "longest_waiting", "which running request is preempted first (see "
      "jaxtier.scheduler.policies)", tuple(VICTIM_POLICIES))
  enable_prefix_caching: bool = _arg(
      True, "reuse the KV of full prompt blocks that earlier requests computed (a shared system "
      "prompt, earlier turns of a chat); on by default, as in vLLM")
  host_prefix_caching: bool = _arg(
      True, "keep the prefix blocks the device cache evicts in the host pool and load them back "
      "on a hit (needs a host pool; swapped-out requests take its blocks first)")
  kv_disk_path: str | None = _arg(
      None, "a directory for a disk tier under the host tier: full prompt blocks are written "
      "through to files that outlive the process (one namespace per weights, model, "
      "quantization and KV layout) and read back on a prefix hit; off when unset; needs the "
      "host tier")
  kv_disk_gb: float = _arg(
      16.0, "the disk tier's budget in GB for this engine's namespace: the least recently used "
      "blocks are removed past it")
  async_scheduling: bool = _arg(
      True, "plan and dispatch the next decode step before this one's tokens are read (vLLM's "
      "async scheduling), so the host's work overlaps the device's; the same tokens")
  seed: int = _arg(0, "seeds the per-request seeds of requests that do not set one")
  layer_execution: str = _arg(
      "auto", "how resident layers run: scan (one lax.scan over stacked layers), unrolled "
      "(separate per-layer buffers, faster on CPU), or auto: unrolled on CPU, scan elsewhere",
      LAYER_EXECUTIONS)
  offload_tail_layers: int | str = _arg(
      0, "last layers kept in pinned host memory and streamed to the device every step: an int "
      ">= 0 or 'auto' (the offload planner)")
  prefetch_depth: int | str = _arg(
      "auto", f"layers the offloaded tail is fetched ahead: 1 to {MAX_PREFETCH_DEPTH} or 'auto'")
  offload_expert_layers: int = _arg(
      0, "mixture-of-experts models: the routed experts of the last N MoE layers (-1: all) kept "
      "in pinned host memory, counted from the end independently of offload_tail_layers (the "
      "tail's layers move whole); attention, norms and router stay on the device")
  expert_offload_mode: str = _arg(
      "auto", "how offloaded experts run: stream (each layer's experts copied to the device, "
      "prefetched as the tail is), host (the routed experts computed on the host where they "
      "live, as llama.cpp's --cpu-moe; one device only), or auto: per call, by the cost model "
      "of jaxtier.offload.expert_cost from the link and host rates (on CPU: on the host where "
      "a call's tokens route to at most all experts once)", EXPERT_OFFLOAD_MODES)
  device_memory_gb: float | None = _arg(
      None, "device memory in GB for offload_tail_layers='auto' (the planner) and the default KV "
      "pool sizing; default: what the device reports (nothing on CPU)")
  host_memory_gb: float | None = _arg(
      None, "the host's memory in GB, which bounds the pinned memory (host KV pool and "
      "offloaded weights); default: what the OS reports")
  tensor_parallel_size: int = _arg(
      1, "devices the model, both KV pools and the offloaded tail are sharded over (a tp mesh of "
      "this process's first devices, split by heads: must divide the model's KV heads; see "
      "jaxtier.model.sharding)")
  trace_path: str | None = _arg(
      None, "append a per-step JSONL trace of the engine to this file (read by "
      "scripts/doctor.py); default: no trace")
  attention_impl: str = _arg(
      "auto", "paged attention (see jaxtier.attention): cpu (C++ kernels for decode and prefill "
      "rows reading the paged pool in place, built on first use; see "
      "jaxtier.kernels.cpu.library), pallas (the Pallas GPU kernel, decode and prefill rows), "
      "pallas_tpu (JAX's Pallas TPU kernel, decode steps of float pools whose head_dim is a "
      "multiple of 128 and block_size of 16), xla (the platform's XLA path: a loop over chunks on CPU, "
      "xla_gathered on an accelerator), xla_gathered (one gather and a masked softmax), "
      "pallas_interpret / pallas_tpu_interpret (the GPU / TPU kernel run on CPU by Pallas' "
      "interpreter, to check it), or auto: cpu for a pool on one CPU device when a C++ compiler "
      "is found, pallas on one GPU, pallas_tpu on one TPU, else xla. Layers and calls a kernel "
      "does not serve (a sliding window or soft cap, prefill on TPU) take an XLA path",
      ATTENTION_IMPLS)
  kernels: str = _arg(
      "auto", "which implementations may run. auto: the best for the platform (on CPU the C++ "
      "kernels: attention, packed and block-quantized matmuls, argmax). portable: only the code "
      "a GPU or TPU runs (scanned layers, XLA attention, float weights, XLA argmax), so a CPU "
      "checks the accelerator path's outputs; attention_impl and layer_execution refine the "
      "choice within it", KERNELS)
  weight_format: str = _arg(
      "auto", "auto: where a GGUF file stores weights in blocks and the CPU kernels multiply the "
      "layers (unrolled, one device), those weights stay in blocks, per layer and fused kernel "
      "in the smallest format that holds all its weights exactly (Q4_1 for Q4_1, Q4_0 and Q4_K; "
      "Q8_0 for Q8_0 and Q5_0; else 8-bit values with a scale and minimum per 16 weights), the "
      "LM head likewise; other types (F16, the IQ types) are dequantized. Products with float32 "
      "activations are bit for bit those of the dequantized weights (see block_activations). "
      "Scanned and offloaded layers (the portable path's too) hold the same blocks as int8 or "
      "4-bit values with their scales (jaxtier.model.quant), dequantized inside the matmul. "
      "float: every weight dequantized to dtype on load", WEIGHT_FORMATS)
  quantization: str | None = _arg(
      None, "store a float checkpoint's decoder projections compact, quantized on load layer "
      "by layer (as vLLM's --quantization): int8 (on the portable path one scale per output "
      "channel; on the CPU kernels GGUF's Q8_0 blocks) or int4 (4-bit values with a scale and "
      "minimum per quantization_group_size input rows; on the CPU kernels GGUF's Q4_1) or fp8 "
      "(float8_e4m3fn values with a scale per output channel, dequantized inside the matmul; "
      "the portable path: kernels='portable' on a CPU). The "
      "embedding and LM head are held in bfloat16 (in int8 blocks on the CPU kernels). Offloaded "
      "layers are held and moved compact too. Default: the checkpoint's own format (a GGUF "
      "file's blocks are kept, see weight_format)", QUANTIZATIONS)
  quantization_group_size: int = _arg(
      32, "input rows per scale of quantization='int4': 32, 64 or 128 (the CPU kernels take 32)")
  block_activations: str = _arg(
      "auto", "how the blocks weight_format=auto keeps multiply. int16: each matmul quantizes "
      "its input per block of 32 values to int16 and sums every block's products exactly in "
      "integers, as llama.cpp multiplies its blocks with int8 inputs (faster; logits move by "
      "up to ~3e-3 on the default model; a row's result still does not depend on its batch). "
      "float32: bit for bit the dequantized model. auto: int16 where the kernels multiply int16 "
      "in vector instructions (x86 with AVX2 or AVX-512), else float32", BLOCK_ACTIVATIONS)
  grammar_max_bytes: int = _arg(
      GrammarLimits.grammar_max_bytes,
      "structured outputs: most bytes in one request's constraint (a schema's JSON text, a "
      "regex or grammar, a choice's strings together); larger ones are refused (a 400 in the "
      "server). 1 MB holds a choice of ~100,000 words, past the lexer llguidance builds within "
      "its default fuel")
  grammar_max_items: int = _arg(
      GrammarLimits.grammar_max_items,
      "structured outputs: most strings in a choice, or values in one enum of a schema (a "
      "choice of 50,000 words compiles in ~0.5 s on one core)")
  grammar_max_depth: int = _arg(
      GrammarLimits.grammar_max_depth,
      "structured outputs: deepest nesting of a JSON schema's objects and arrays (the parser "
      "llguidance reads schemas with stops at 128)")
  grammar_max_lexer_states: int = _arg(
      GrammarLimits.grammar_max_lexer_states,
      "structured outputs: llguidance's max_lexer_states, the size of a grammar's lexer "
      "automaton (1-2 kB a state, so at most ~100 MB a grammar)")
  grammar_compile_timeout_s: float = _arg(
      GrammarLimits.grammar_compile_timeout_s,
      "structured outputs: seconds a grammar may take to compile in a worker thread (the "
      "request waits outside the batch meanwhile); past it the request ends with an error")
  chat_template: str | None = _arg(
      None, "the chat template chat requests render with, instead of the model's: a path to a "
      ".jinja file, or the template itself (a value holding a brace or a newline), as vLLM's "
      "--chat-template; default: the model's (see jaxtier.text.tokenizer.read_chat_template)")

  def __post_init__(self):
    if not isinstance(self.model, str) or not self.model:
      raise ValueError(f"model={self.model!r}: expected a registry name or a path")
    check_choice("dtype", self.dtype, DTYPES)
    check_int("max_model_len", self.max_model_len, 2, optional=True)
    check_step_limits(self.max_num_seqs, self.max_num_batched_tokens, optional=True)
    check_block_size(self.block_size)
    check_int("num_device_blocks", self.num_device_blocks, 2, optional=True)
    check_positive("kv_cache_memory_gb", self.kv_cache_memory_gb)
    check_int("num_host_blocks", self.num_host_blocks, 0, optional=True)
    check_positive("swap_space_gb", self.swap_space_gb, zero=True)
    for a, b in (("num_device_blocks", "kv_cache_memory_gb"), ("num_host_blocks", "swap_space_gb")):
      if getattr(self, a) is not None and getattr(self, b) is not None:
        raise ValueError(f"{a}={getattr(self, a)!r} and {b}={getattr(self, b)!r}: expected at "
                         "most one of the two")
    if not is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
      raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: expected a "
                       "number in (0, 1]")
    check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
    check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
    check_watermark(self.watermark)
    check_choice("victim_policy", self.victim_policy, tuple(VICTIM_POLICIES))
    for name in ("enable_prefix_caching", "host_prefix_caching", "async_scheduling"):
      check_bool(name, getattr(self, name))
    if self.kv_disk_path is not None:
      if not (isinstance(self.kv_disk_path, str) and self.kv_disk_path):
        raise ValueError(f"kv_disk_path={self.kv_disk_path!r}: expected a directory path or None")
      if not (self.enable_prefix_caching and self.host_prefix_caching):
        raise ValueError(f"kv_disk_path={self.kv_disk_path!r} sits under the prefix cache's host "
                         "tier: expected enable_prefix_caching=True and host_prefix_caching=True")
      if self.num_host_blocks == 0 or self.swap_space_gb == 0:
        raise ValueError(f"kv_disk_path={self.kv_disk_path!r} reads blocks into the host tier: "
                         "expected a host pool (num_host_blocks or swap_space_gb > 0)")
    check_positive("kv_disk_gb", self.kv_disk_gb)
    check_int("seed", self.seed, 0, 2**32 - 1)
    check_choice("layer_execution", self.layer_execution, LAYER_EXECUTIONS)
    check_offload(self.offload_tail_layers, self.prefetch_depth)
    check_int("offload_expert_layers", self.offload_expert_layers, -1)
    check_choice("expert_offload_mode", self.expert_offload_mode, EXPERT_OFFLOAD_MODES)
    check_positive("device_memory_gb", self.device_memory_gb)
    check_positive("host_memory_gb", self.host_memory_gb)
    check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 4096)
    if self.trace_path is not None and not (isinstance(self.trace_path, str) and self.trace_path):
      raise ValueError(f"trace_path={self.trace_path!r}: expected a file path or None")
    check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
    check_choice("kernels", self.kernels, KERNELS)
    if self.kernels == "portable" and self.attention_impl == "cpu":
      raise ValueError("attention_impl='cpu' is a CPU kernel; kernels='portable' runs only what "
                       "an accelerator runs (use attention_impl='auto' or 'xla')")
    if self.kernels == "portable" and self.layer_execution == "unrolled":
      raise ValueError("layer_execution='unrolled' packs layers for the CPU kernels; "
                       "kernels='portable' runs scanned layers, as an accelerator does (use "
                       "layer_execution='auto' or 'scan')")
    if self.attention_impl == "cpu" and self.tensor_parallel_size > 1:
      raise ValueError(f"attention_impl='cpu' runs on one device, not tensor_parallel_size="
                       f"{self.tensor_parallel_size} (use 'auto' or 'xla')")
    if self.attention_impl == "cpu":
      # pylint: disable-next=import-outside-toplevel
      from jaxtier.kernels.cpu import library as cpu_kernels
      if not cpu_kernels.available():
        raise ValueError(f"attention_impl='cpu' is unavailable: "
                         f"{cpu_kernels.unavailable_reason()}")
    check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
    check_choice("block_activations", self.block_activations, BLOCK_ACTIVATIONS)
    check_quantization(self.quantization, self.quantization_group_size)
    if self.quantization is not None and self.weight_format == "float":
      raise ValueError(f"quantization={self.quantization!r} with weight_format='float': "
                       "expected one of the two (weight_format='float' dequantizes every weight)")
    if self.quantization is not None and self.tensor_parallel_size > 1:
      raise ValueError(f"quantization={self.quantization!r} runs on one device, not "
                       f"tensor_parallel_size={self.tensor_parallel_size}")
    for name in ("grammar_max_bytes", "grammar_max_items", "grammar_max_depth",
                 "grammar_max_lexer_states"):
      check_int(name, getattr(self, name), 1)
    check_positive("grammar_compile_timeout_s", self.grammar_compile_timeout_s)
    if self.chat_template is not None:
      from jaxtier.text import tokenizer  # pylint: disable=import-outside-toplevel
      tokenizer.resolve_chat_template(self.chat_template)

  @property
  def grammar_limits(self) -> GrammarLimits:
    """The structured-output limits these arguments set."""
    return GrammarLimits(**{f.name: getattr(self, f.name)
                            for f in dataclasses.fields(GrammarLimits)})

  @property
  def token_budget(self) -> int:
    """Tokens one step may compute (max_num_batched_tokens with its default filled in)."""
    return self.max_num_batched_tokens or max(2048, self.max_num_seqs)


ARG_NAMES = tuple(f.name for f in dataclasses.fields(EngineArgs))


def field_help(name: str) -> str:
  """The help text of engine argument `name`: its documentation and its flag's help."""
  return _FIELDS[name].metadata["help"]


def field_choices(name: str) -> tuple[str, ...] | None:
  """The fixed values engine argument `name` may take (its flag is an enum), or None."""
  return _FIELDS[name].metadata.get("choices")


_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
if EngineArgs.__doc__:  # None under python -OO
  EngineArgs.__doc__ += "\n  Attributes:\n" + "".join(
      f"    {f.name}: {f.metadata['help']}.\n" for f in dataclasses.fields(EngineArgs))
