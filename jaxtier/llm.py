"""The offline API, in the shape vLLM users know: `LLM(model).generate(prompts,
SamplingParams(...))`."""

import dataclasses
import os
import time
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from tqdm.auto import tqdm

from jaxtier import checkpoint, offload
from jaxtier.checkpoint import placed
from jaxtier.checkpoint.params import ArraySource, check_params, flat_params
from jaxtier.common.checks import check_prompt_ids
from jaxtier.engine import build, disk_tier, doctor, link, pinned_cap, sizing, startup
from jaxtier.engine.args import EngineArgs
from jaxtier.engine.engine import Engine
from jaxtier.engine.padded import Completion, StepUpdate, generate_batch
from jaxtier.kernels.cpu import matmul
from jaxtier.model import quant, sharding
from jaxtier.offload.experts import ExpertOffloadedLayers
from jaxtier.sampling.logprobs import LogprobDict
from jaxtier.sampling.samplers import SamplingParams
from jaxtier.scheduler import Request
from jaxtier.model.transformer import Transformer
from jaxtier.text.tokenizer import Message, Tokenizer, resolve_chat_template

Prompt = str | Sequence[int]


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
  """One completion. `logprobs` (when `SamplingParams.logprobs` is set): one dict per generated
  token, token id -> `Logprob`, holding the generated token and the top `logprobs` tokens; and
  the same tokens' log-probabilities as float32 arrays [tokens] for a training step, in both of
  vLLM's `logprobs_mode`s: `token_logprobs` under the raw model, `processed_logprobs` under the
  distribution each token was drawn from (after penalties, biases, temperature, top-k / top-p /
  min-p; 0 for greedy tokens). `rollout_arrays` pads them for a batch."""
  index: int
  text: str
  token_ids: tuple[int, ...]  # generated tokens only
  finish_reason: str  # "stop", "length", or "abort" (then `error` says why, where known)
  logprobs: list[LogprobDict] | None = None
  token_logprobs: np.ndarray | None = None  # [tokens] float32
  processed_logprobs: np.ndarray | None = None  # [tokens] float32
  error: str | None = None  # why the request ended early: its grammar failed to compile or run


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """One prompt's result; `text`, `token_ids`, `finish_reason` are those of its first completion.

  `prompt_logprobs` (when `SamplingParams.prompt_logprobs` is set): one entry per prompt token,
  None for the first, else a dict token id -> `Logprob` holding the prompt token and the top
  `prompt_logprobs` tokens given the tokens before it.

  `num_cached_tokens`: prompt tokens served from the prefix cache instead of computed (as in vLLM).
  `weights_version`: the `LLM.weights_version` of the weights that generated it (0: the weights
  it was built with; each `update_weights` adds one).
  """
  request_id: str
  prompt: str | None
  prompt_token_ids: tuple[int, ...]
  outputs: tuple[CompletionOutput, ...]
  prompt_logprobs: list[LogprobDict | None] | None = None
  num_cached_tokens: int = 0
  weights_version: int = 0

  @property
  def text(self) -> str:
    return self.outputs[0].text

  @property
  def token_ids(self) -> tuple[int, ...]:
    return self.outputs[0].token_ids

  @property
  def finish_reason(self) -> str:
    return self.outputs[0].finish_reason


def _float32(values) -> np.ndarray | None:
  return None if values is None else np.asarray(values, np.float32)


def rollout_arrays(outputs: Sequence[RequestOutput], pad_id: int = 0) -> dict[str, np.ndarray]:
  """Outputs (`LLM.generate` / `chat` results, each prompt repeated once per sample for GRPO's
  groups) as padded numpy arrays for a training step, one row per output, each row its prompt
  then its completion, right-padded to the longest:

  - "tokens" [n, L] int32 (`pad_id` after the end), "positions" [n, L] int32;
  - "prompt_lengths", "completion_lengths" [n] int32;
  - "completion_mask" [n, L] float32: 1 where a row holds a generated token;
  - "token_logprobs", "processed_logprobs" [n, L] float32: each generated token's
    log-probability (raw and processed, `CompletionOutput`), 0 elsewhere; they need
    `SamplingParams.logprobs` set (0 is enough), else ValueError;
  - "group" [n] int32: the index of the row's prompt among the distinct prompts, in order of
    first appearance (rows of one prompt share it).

  Position p's token is predicted by the logits at p - 1: a training step's log-probabilities of
  `tokens[:, 1:]` under `completion_mask[:, 1:]` line up with these arrays' `[:, 1:]`.
  """
  if not outputs:
    raise ValueError("outputs is empty: expected at least one RequestOutput")
  rows = [(o.prompt_token_ids, o.outputs[0]) for o in outputs]
  missing = [i for i, (_, c) in enumerate(rows) if c.token_logprobs is None]
  if missing:
    raise ValueError(f"outputs {missing[:5]} carry no log-probabilities: generate with "
                     "SamplingParams(logprobs=0) (or more)")
  width = max(len(p) + len(c.token_ids) for p, c in rows)
  n = len(rows)
  out = {"tokens": np.full((n, width), pad_id, np.int32),
         "positions": np.tile(np.arange(width, dtype=np.int32), (n, 1)),
         "prompt_lengths": np.zeros(n, np.int32), "completion_lengths": np.zeros(n, np.int32),
         "completion_mask": np.zeros((n, width), np.float32),
         "token_logprobs": np.zeros((n, width), np.float32),
         "processed_logprobs": np.zeros((n, width), np.float32),
         "group": np.zeros(n, np.int32)}
  groups: dict[tuple[int, ...], int] = {}
  for i, (prompt, c) in enumerate(rows):
    p, g = len(prompt), len(c.token_ids)
    out["tokens"][i, :p + g] = list(prompt) + list(c.token_ids)
    out["prompt_lengths"][i], out["completion_lengths"][i] = p, g
    out["completion_mask"][i, p:p + g] = 1
    out["token_logprobs"][i, p:p + g] = c.token_logprobs
    out["processed_logprobs"][i, p:p + g] = c.processed_logprobs
    out["group"][i] = groups.setdefault(tuple(prompt), len(groups))
  return out


def _bytes_by_format(tree) -> dict[str, int]:
  """{format: bytes} over the array leaves of `tree`: packed block formats by
  `matmul.weight_format`, the parts of compact projections (`jaxtier.model.quant`) by dtype,
  their values "int8", "uint4", "u4x2" (4-bit, two to a byte) or "float8_e4m3fn", other arrays
  by their dtype's name."""
  out: dict[str, int] = {}
  for path, a in jax.tree_util.tree_leaves_with_path(tree):
    fmt = matmul.weight_format(a)
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if keys and keys[-1] in quant.PARTS:
      key = "u4x2" if keys[-1] == "values" and a.dtype == np.uint8 else str(a.dtype)
    else:
      key = str(a.dtype) if fmt == "float32" else fmt
    out[key] = out.get(key, 0) + quant.array_bytes(a)
  return out


def _host_bytes(state) -> int:
  """Bytes of `state`'s arrays outside device memory (the offloaded weights)."""
  return sum(v for k, v in offload.bytes_by_memory_kind(state).items() if k != offload.DEVICE)


def _host_expert_bytes(model) -> int:
  """Bytes of the routed experts `model` keeps in host memory outside its offloaded tail (its
  `ExpertOffloadedLayers` groups')."""
  groups = getattr(model, "groups", ())
  return sum(quant.array_bytes(a) for g in groups if isinstance(g, ExpertOffloadedLayers)
             for a in jax.tree.leaves(nnx.state(g)) if a.sharding.memory_kind != offload.DEVICE)


def dry_run(model: str, platform: str | None = None, **engine_args) -> dict:
  """The plan `LLM(model, **engine_args)` would run, without loading a weight: the resolved
  dtypes and layer execution, both KV pools, the offloaded layers and prefetch depth, and the
  bytes on the device and in pinned host memory, in `LLM.memory_report()`'s keys, with what a plan
  for another machine assumed (`jaxtier.engine.build.Plan.memory_plan`). Reads the checkpoint's
  metadata only (a directory holding only a config.json plans too) and builds no mesh, so it
  plans tensor parallelism, or with `device_memory_gb` / `host_memory_gb` another machine, from
  any process; with `platform` ("cpu", "gpu", "tpu", "cuda", "rocm"), for that platform's
  defaults: a CPU plans a GPU's bfloat16 model. Raises ValueError as `LLM` would."""
  return build.plan(model, EngineArgs(model=model, **engine_args), platform).memory_plan()


class LLM:
  """A model ready to generate, on the engine (continuous batching over a paged KV cache).

  Args:
    model: a registry name (see `models/`), a Hugging Face directory, a .gguf file or a jaxtier
      Orbax directory.
    **engine_args: the engine arguments, `jaxtier.engine.args.EngineArgs` (same names as the
      scripts' flags): dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
      num_device_blocks / kv_cache_memory_gb, num_host_blocks / swap_space_gb, kv_cache_dtype
      ("auto", "float32", "bfloat16", "int8"), preemption_mode, watermark, victim_policy,
      enable_prefix_caching, host_prefix_caching, async_scheduling, seed,
      layer_execution, offload_tail_layers, prefetch_depth, offload_expert_layers,
      expert_offload_mode, device_memory_gb,
      tensor_parallel_size, trace_path, attention_impl, kernels, weight_format, quantization
      ("int8", "int4", "fp8"), quantization_group_size, block_activations, grammar_max_bytes,
      grammar_max_items, grammar_max_depth, grammar_max_lexer_states, grammar_compile_timeout_s,
      chat_template. Bad values raise ValueError before any weight loads.

  Loading is placement-first (`jaxtier.checkpoint.placed`): each tensor goes straight to its
  device shard or, for the offloaded tail, to pinned host memory.

  With offloaded layers on CPU, call
  `jaxtier.kernels.cpu.heap.retain_freed_memory(single_arena=True)` first: the d + 1 fetched layers
  are step temporaries, which glibc maps afresh (page-faulting) every step once they pass 32 MB.
  """

  def __init__(self, model: "str | Transformer", tokenizer: Tokenizer | None = None,
               **engine_args):
    # parse -> plan -> load -> build
    started = time.perf_counter()
    startup.default_compilation_cache()  # programs kept on disk: a second start compiles none
    in_memory = not isinstance(model, str)
    name = f"{getattr(getattr(model, 'config', None), 'architecture', 'model')} (in memory)"
    self.args = args = EngineArgs(model=name if in_memory else model, **engine_args)
    # XLA reads its pinned-memory cap when JAX starts: raise it first where these arguments may
    # pin more (`jaxtier.engine.pinned_cap`)
    pinned_cap.raise_before_start(args, pinned_cap.host_memory(args))
    self.mesh = sharding.make_mesh(args.tensor_parallel_size)  # before any file is read
    machine = sizing.detect_machine(args)
    # GGUF blocks are kept with weight_format="auto" on one device; otherwise a registry model
    # loads from its float32 Orbax copy.
    opened = (build.open_model(model, tokenizer, args, machine) if in_memory
              else build.open_checkpoint(model, args, machine))
    opened_at = time.perf_counter()
    self._weights_path = None if in_memory else opened.path  # the disk tier's namespace
    try:
      self.plan = build.plan_checkpoint(args.model, opened, args, machine, mesh=self.mesh)
    except BaseException:
      opened.close()
      raise
    planned_at = time.perf_counter()
    self.machine, self.config, self.sizing = machine, self.plan.config, self.plan.sizing
    self.layout, self.engine_config = self.plan.layout, self.plan.engine_config
    self.loaded = checkpoint.load_opened(opened, self.sizing.dtype, self.layout)
    # start-up phases: the checkpoint opened and its weights loaded; the plan sized
    self.startup = {"load_seconds": opened_at - started + time.perf_counter() - planned_at,
                    "size_seconds": planned_at - opened_at}
    self.model_name = args.model
    self.tokenizer = tokenizer or self.loaded.tokenizer
    if args.chat_template is not None:
      self.tokenizer = dataclasses.replace(
          self.tokenizer, chat_template=resolve_chat_template(args.chat_template))
    self.graphdef, self.state = nnx.split(self.loaded.model)
    if args.block_activations == "int16" and not any(
        matmul.weight_format(leaf).endswith("_i16") for leaf in jax.tree.leaves(self.state)):
      logging.warning("block_activations='int16' has no effect: no GGUF blocks are kept (they are "
                      "kept for a GGUF file of quantized layers, with weight_format='auto', "
                      "unrolled layers on one device and the CPU kernels built)")
    self._engine: Engine | None = None
    self._rng = np.random.default_rng(args.seed)
    self._next_id = 0
    self.weights_version = 0  # how many times `update_weights` replaced the weights

  @property
  def offload(self) -> sizing.Offload:
    """The offloaded tail layers and prefetch depth, and the planner's plan (if it ran)."""
    return self.sizing.offload

  @property
  def max_model_len(self) -> int:
    return self.sizing.max_model_len

  @property
  def max_num_seqs(self) -> int:
    return self.sizing.max_num_seqs

  @property
  def kv_cache_dtype(self) -> str:
    return self.sizing.kv_cache_dtype

  @property
  def cache_dtype(self):
    """The reference driver's (`run_batch`) contiguous KV cache dtype: the model dtype."""
    return checkpoint.resolve_dtype(self.sizing.dtype)

  @property
  def block_bytes(self) -> int:
    return self.sizing.block_bytes

  @property
  def layer_execution(self) -> str:
    return self.sizing.layer_execution

  @property
  def block_activations(self) -> str:
    """How kept GGUF blocks multiply ("float32" where no blocks are kept: no effect there)."""
    return self.sizing.block_activations

  @property
  def engine(self) -> Engine:
    """The engine. Its KV pools are allocated on first use, so a process that only runs the
    padded reference driver (`run_batch`) holds no pools beside it."""
    if self._engine is None:
      start = time.perf_counter()
      self._engine = Engine(nnx.merge(self.graphdef, self.state), self.tokenizer,
                            self.engine_config, tail=self._link_tail(),
                            grammar_limits=self.args.grammar_limits,
                            disk_identity=self._disk_identity())
      self._engine.startup.update(self.startup, engine_seconds=time.perf_counter() - start)
    return self._engine

  def _disk_identity(self) -> dict | None:
    """What names the disk tier's namespace besides the KV layout: the checkpoint files'
    checksum (cached beside the tier's files; an in-memory model: its arrays' digest, the
    engine's default) and every setting that changes the KV's numbers (`disk_tier`)."""
    path = self.args.kv_disk_path
    if path is None or self._weights_path is None:
      return None
    os.makedirs(path, exist_ok=True)
    a = self.args
    return {"weights": disk_tier.file_digest(self._weights_path,
                                             os.path.join(path, "checksums.json")),
            "model": self.model_name, "settings": dataclasses.asdict(self.plan.settings),
            "quantization": a.quantization, "quantization_group_size": a.quantization_group_size,
            "weight_format": a.weight_format}

  def _link_tail(self) -> link.Tail:
    """The offloaded tail as the engine's link budget sees it: the weight bytes it streams each
    step (host-resident weights less the routed experts the host computes) and the planner's
    predicted compute seconds of a step, where the planner ran."""
    if not self.offload.offload_tail_layers:
      return link.NO_TAIL
    plan = self.offload.plan
    return link.Tail(max(_host_bytes(self.state) - _host_expert_bytes(self.loaded.model), 0),
                     plan.compute_step_s if plan is not None else None)

  @property
  def model(self) -> nnx.Module:
    """The NNX model (`jaxtier.model.Transformer` or `GroupedTransformer`), for use in your own
    JAX code: `model(tokens_bt, pos_bt, cache)` -> (logits, cache) with a cache of
    `jaxtier.kvcache`.

    Each access merges `graphdef` and `state` into a new module whose parameters are the very
    arrays the engine runs (no copy, no extra memory). Treat them as read-only: `nnx.update` on
    the module would swap its own references only, and the engine keeps running the arrays it
    was built with; build a new `LLM` to serve changed weights.
    """
    return nnx.merge(self.graphdef, self.state)

  @property
  def tensor_parallel_size(self) -> int:
    return sharding.tp_size(self.mesh)

  def memory_report(self) -> dict[str, int]:
    """Where the weights and the KV cache live, and what crosses the host link every step.

    Weight bytes are counted from the placement of the model state; KV bytes are the engine's
    device pool and pinned-host tier (blocks x `kv_block_bytes`; the device pool is allocated on
    the engine's first use, the host tier's blocks as they are swapped out, up to its size).
    Totals are over all devices; `*_per_device` are one device's share under tensor parallelism.
    Every step streams all host-resident weights once (`weight_transfer_bytes_per_step`; a
    call whose offloaded experts the host computes moves only their activations instead);
    `kv_swap_bytes_per_step` is the mean over the steps run so far (`kv_swap_bytes_max_step` the
    largest). `kv_disk_path` and `kv_disk_budget_bytes`: the disk tier under the host tier (None
    and 0 when off). `checkpoint_quantization`: the scheme of a checkpoint stored quantized
    (GPTQ, AWQ, compressed-tensors; None otherwise). `weight_bytes_by_format`: the weights' bytes
    by how they are held, the dtype's name
    or, for weights kept in GGUF blocks, the block format (`matmul.weight_format`: "q4_1",
    "q8_0", "q8_16", "q4_1_i16", "q8_0_i16").
    """
    by_kind = offload.bytes_by_memory_kind(self.state)
    per_device, tp = offload.bytes_per_device(self.state), self.tensor_parallel_size
    host = sum(v for k, v in by_kind.items() if k != offload.DEVICE)
    experts = _host_expert_bytes(self.loaded.model)
    n, depth = self.offload.offload_tail_layers, self.offload.prefetch_depth
    layer_bytes = (host - experts) // n if n else 0
    c = self.engine_config
    stats = self._engine.stats() if self._engine is not None else {}
    return {"device_weight_bytes": by_kind.get(offload.DEVICE, 0), "host_weight_bytes": host,
            "device_kv_bytes": c.num_device_blocks * self.block_bytes,
            "host_kv_bytes": c.num_host_blocks * self.block_bytes,
            "kv_block_bytes": self.block_bytes,
            "device_kv_blocks": c.num_device_blocks, "host_kv_blocks": c.num_host_blocks,
            "weight_transfer_bytes_per_step": host,
            "kv_swap_bytes_per_step": int(stats.get("kv_swap_bytes_per_step", 0)),
            "kv_swap_bytes_max_step": stats.get("kv_swap_bytes_max_step", 0),
            "prefetch_buffer_bytes": (depth + 1) * layer_bytes if n else 0,
            "offload_tail_layers": n, "prefetch_depth": depth,
            "offload_expert_layers": self.sizing.experts.layers, "host_expert_bytes": experts,
            "expert_offload": self.sizing.experts.report,
            "tensor_parallel_size": tp,
            "device_weight_bytes_per_device": per_device.get(offload.DEVICE, 0),
            "host_weight_bytes_per_device": sum(v for k, v in per_device.items()
                                                if k != offload.DEVICE),
            "device_kv_bytes_per_device": c.num_device_blocks * self.block_bytes // tp,
            **sizing.pinned_figures(host + c.num_host_blocks * self.block_bytes,
                                    self.sizing.pinned_cap),
            **build.disk_figures(self.args),
            "checkpoint_quantization": self.plan.checkpoint_quantization,
            "weight_bytes_by_format": _bytes_by_format(self.state)}

  def stats(self) -> dict:
    """The engine's figures (swaps, preemptions, pools, requests, compiles; see `Engine.stats`)
    plus the offload: layers, depth, bytes streamed per step and the planner's step times."""
    stats = self.engine.stats()
    plan = self.offload.plan
    stats.update(
        offload_tail_layers=self.offload.offload_tail_layers,
        prefetch_depth=self.offload.prefetch_depth,
        offload_expert_layers=self.sizing.experts.layers,
        expert_stream_from_tokens=self.sizing.experts.stream_from_tokens,
        expert_offload=self.sizing.experts.report,
        weight_transfer_bytes_per_step=_host_bytes(self.state),
        offload_predicted_step_seconds=plan.predicted_step_s if plan is not None else None,
        offload_compute_step_seconds=plan.compute_step_s if plan is not None else None)
    return stats

  def reset_prefix_cache(self) -> None:
    """Forgets every cached prefix block that no running request uses, on both tiers."""
    self.engine.reset_prefix_cache()

  def update_weights(self, params, abort_running: bool = False) -> int:
    """Replaces the model's weights with `params` and returns the new `weights_version`.

    `params`: what an NNX trainer holds, `nnx.state(model, nnx.Param)` of a `Transformer` of this
    config, or a flat dict in `jaxtier.checkpoint.params`' names (paths or "/"-joined), in the
    engine's dtype. They are placed as the engine's weights are (`placed.build` with its layout:
    arrays already where the engine keeps them are used as they are, others moved: resharded,
    the offloaded tail to pinned host memory; quantized again where the engine quantizes), and
    the engine runs them from its next step with no program compiled again. Live requests first
    finish on the old weights (their outputs report the old version), or with `abort_running`
    end with "abort". Every cached prefix is forgotten, on both tiers. Missing, unknown or
    mis-shaped parameters, or another dtype, raise ValueError naming the parameter, and nothing
    changes.
    """
    dtype = checkpoint.resolve_dtype(self.sizing.dtype)
    flat = flat_params(params)
    check_params(self.config, flat, dtype, "update_weights")
    source = build.quantized_source(ArraySource(flat, "update_weights"), self.config, self.args,
                                    self.plan.settings)
    model = placed.build(self.config, source, dtype, self.layout)
    graphdef, state = nnx.split(model)
    if self._engine is not None:
      self._engine.update_weights(state, abort_running)
    self.graphdef, self.state = graphdef, state
    self.loaded = dataclasses.replace(self.loaded, model=model)
    self.weights_version += 1
    return self.weights_version

  def doctor(self) -> str:
    """The symptom -> remedy rows that this run's figures show (see `jaxtier.engine.doctor`)."""
    stats = self.stats()
    return doctor.report(doctor.diagnose(stats), stats)

  def prompt_token_ids(self, prompt: Prompt, index: int = 0) -> list[int]:
    """Token ids of one prompt (a string or token ids), checked against vocabulary and context.

    Raises ValueError or TypeError naming the prompt by `index`.
    """
    if isinstance(prompt, str):
      if prompt:
        self._check_text_fits(prompt, index)
      ids = self.tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) for t in prompt):
      ids = prompt
    else:
      raise TypeError(f"prompt {index} must be a string or a list of token ids, got "
                      f"{type(prompt).__name__}")
    return list(check_prompt_ids(ids, self.config.vocab_size, self.max_model_len,
                                 f"prompt {index}"))

  def _params_list(self, params, n: int) -> list[SamplingParams]:
    if params is None:
      return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
      return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
      raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} of them")
    return params

  def chat_token_ids(self, conversation: Sequence[Message], index: int = 0,
                     tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the chat template (with `tools` as its `tools`
    variable when given), checked like a prompt."""
    text = self.tokenizer.apply_chat_template(conversation, tools=tools)
    self._check_text_fits(text, index)
    return self.prompt_token_ids(self.tokenizer.encode(text, add_special_tokens=False), index)

  def _check_text_fits(self, text: str, index: int) -> None:
    """The too-long error of `prompt_token_ids`, raised before tokenizing when a lower bound on
    the text's tokens (`Tokenizer.min_token_count`, one pass over it) already fills the window."""
    at_least = self.tokenizer.min_token_count(text)
    if at_least >= self.max_model_len:
      raise ValueError(f"prompt {index} has at least {at_least} tokens; the context window "
                       f"max_model_len is {self.max_model_len} and at least one token must be "
                       "generated")

  def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
    """A `Request` with a fresh id, as the server submits them to the engine (and `run_batch`
    takes them); a request without a seed gets one from the engine's seed."""
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
    request_id, self._next_id = self._next_id, self._next_id + 1
    return Request.of(request_id, prompt_ids, params, seed)

  def run_batch(self, requests: Sequence[Request],
                on_step: Callable[[list[StepUpdate]], None] | None = None,
                aborted: Callable[[int], bool] | None = None) -> list[Completion]:
    """Generates for up to `max_num_seqs` requests as one padded batch on a contiguous cache
    (`generate.generate_batch`, the reference driver the engine is tested against)."""
    if not 1 <= len(requests) <= self.max_num_seqs:
      raise ValueError(f"run_batch takes 1 to max_num_seqs={self.max_num_seqs} requests, got "
                       f"{len(requests)}")
    return generate_batch(self.graphdef, self.state, self.tokenizer, requests, self.max_model_len,
                          self.cache_dtype, on_step=on_step, aborted=aborted)

  def _input_ids(self, key: Hashable, prompt: Any) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a prompt or a conversation; ValueError names `key`."""
    try:
      if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        text = self.tokenizer.apply_chat_template(prompt)
        return text, self.prompt_token_ids(self.tokenizer.encode(text, add_special_tokens=False))
      return (prompt if isinstance(prompt, str) else None), self.prompt_token_ids(prompt)
    except (ValueError, TypeError) as e:
      raise ValueError(f"request {key!r}: {e}") from None

  def _drive(self, items: Iterator[tuple[Hashable, str | None, list[int], SamplingParams]],
             bar: tqdm | None = None) -> Iterator[tuple[Hashable, RequestOutput]]:
    """Feeds items into the engine while it has room (up to 2 x max_num_seqs queued or running),
    steps it, and yields each request's output as it ends. If anything fails, the requests this
    call added are aborted (their blocks freed) before the error propagates."""
    engine, mine = self.engine, {}
    exhausted, generated, start = False, 0, time.perf_counter()
    try:
      while True:
        added = False
        while not exhausted and engine.num_unfinished < 2 * self.max_num_seqs:
          item = next(items, None)
          if item is None:
            exhausted = True
            break
          key, text, ids, params = item
          request_id, self._next_id = self._next_id, self._next_id + 1
          seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
          engine.add_request(request_id, ids, params, seed)
          mine[request_id] = (key, text, tuple(ids), self.weights_version)
          added = True
        if not mine:
          return
        if added:  # the programs these requests will run, built beside the steps
          engine.compile_ahead()
        for update in engine.step():
          generated += len(update.new_token_ids)
          if update.completion is None or update.request_id not in mine:
            continue
          key, text, ids, version = mine.pop(update.request_id)
          c = update.completion
          if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s",
                                refresh=False)
          yield key, RequestOutput(
              str(key), text, ids,
              (CompletionOutput(0, c.text, c.token_ids, c.finish_reason,
                                None if c.logprobs is None else list(c.logprobs),
                                _float32(c.token_logprobs), _float32(c.processed_logprobs),
                                c.error),),
              None if c.prompt_logprobs is None else list(c.prompt_logprobs), c.num_cached_tokens,
              version)
    finally:
      for request_id in mine:
        engine.abort(request_id)

  def _run(self, prompts: list[Any], ids: list[list[int]], params: list[SamplingParams],
           use_tqdm: bool) -> list[RequestOutput]:
    results: dict[int, RequestOutput] = {}
    items = ((i, p if isinstance(p, str) else None, ids[i], params[i])
             for i, p in enumerate(prompts))
    with tqdm(total=len(prompts), disable=not use_tqdm, desc="generate", unit="req") as bar:
      for i, output in self._drive(items, bar):
        results[i] = output
    return [results[i] for i in range(len(prompts))]

  def generate(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = False) -> list[RequestOutput]:
    """Completes each prompt (a string or a list of token ids); returns outputs in prompt order."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and isinstance(prompts[0], (int, np.integer))):
      prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
      raise ValueError("prompts is empty: pass at least one prompt")
    ids = [self.prompt_token_ids(p, i) for i, p in enumerate(prompts)]
    return self._run(prompts, ids, self._params_list(sampling_params, len(prompts)), use_tqdm)

  def chat(self, conversations: Sequence[Message] | Sequence[Sequence[Message]],
           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
           use_tqdm: bool = False) -> list[RequestOutput]:
    """Applies the chat template to each conversation and generates the assistant's reply."""
    if conversations and isinstance(conversations[0], dict):
      conversations = [conversations]
    conversations = list(conversations)
    if not conversations:
      raise ValueError("conversations is empty: pass at least one conversation")
    texts = [self.tokenizer.apply_chat_template(c) for c in conversations]
    prompts = [self.prompt_token_ids(self.tokenizer.encode(t, add_special_tokens=False), i)
               for i, t in enumerate(texts)]
    return self._run(texts, prompts, self._params_list(sampling_params, len(texts)), use_tqdm)

  def generate_stream(self, items: Iterable[tuple[Hashable, Any, SamplingParams]],
                      use_tqdm: bool = False) -> Iterator[tuple[Hashable, RequestOutput]]:
    """Generates for `(key, prompt_or_conversation, params)` items pulled from `items` as room
    frees up, and yields `(key, output)` as each request finishes (not in input order).

    A prompt is a string or token ids; a conversation is a list of `{"role", "content"}` messages
    (rendered with the chat template). A bad item raises ValueError naming its key.
    """
    def prepared():
      for key, prompt, params in items:
        text, ids = self._input_ids(key, prompt)
        yield key, text, ids, params

    total = len(items) if hasattr(items, "__len__") else None
    with tqdm(total=total, disable=not use_tqdm, desc="generate", unit="req") as bar:
      yield from self._drive(prepared(), bar)
