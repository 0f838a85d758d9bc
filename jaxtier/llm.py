"""The offline API, in the shape vLLM users know: `LLM(model).generate(prompts, SamplingParams(...))`."""

import dataclasses
import time
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from tqdm.auto import tqdm

from jaxtier import checkpoint, matmul, offload, sharding
from jaxtier.checkpoint import placed
from jaxtier.buckets import pow2_bucket
from jaxtier.tools import doctor
from jaxtier.engine.engine import Engine, EngineConfig
from jaxtier.engine_args import (GB, LAYER_EXECUTIONS, EngineArgs, check_offload,
                                 cpu_default_pool_blocks)
from jaxtier.generate import Completion, StepUpdate, generate_batch
from jaxtier.kv_bytes import kv_block_bytes
from jaxtier.logprobs import LogprobDict
from jaxtier.offload import auto as offload_auto
from jaxtier.sampling import SamplingParams
from jaxtier.scheduler import Request
from jaxtier.scheduler.allocator import blocks_for
from jaxtier.tokenizer import Message, resolve_chat_template

Prompt = str | Sequence[int]


def resolve_layer_execution(value: str) -> str:
  """"scan" or "unrolled" for an engine argument that may be "auto"."""
  if value not in LAYER_EXECUTIONS:
    raise ValueError(f"layer_execution={value!r} is not supported; expected one of {LAYER_EXECUTIONS}")
  if value == "auto":
    return "unrolled" if jax.default_backend() == "cpu" else "scan"
  return value


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
  """One completion. `logprobs` (when `SamplingParams.logprobs` is set): one dict per generated
  token, token id -> `Logprob`, holding the generated token and the top `logprobs` tokens."""
  index: int
  text: str
  token_ids: tuple[int, ...]  # generated tokens only
  finish_reason: str  # "stop" or "length"
  logprobs: list[LogprobDict] | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """One prompt's result; `text`, `token_ids`, `finish_reason` are those of its first completion.

  `prompt_logprobs` (when `SamplingParams.prompt_logprobs` is set): one entry per prompt token,
  None for the first, else a dict token id -> `Logprob` holding the prompt token and the top
  `prompt_logprobs` tokens given the tokens before it.

  `num_cached_tokens`: prompt tokens served from the prefix cache instead of computed (as in vLLM).
  """
  request_id: str
  prompt: str | None
  prompt_token_ids: tuple[int, ...]
  outputs: tuple[CompletionOutput, ...]
  prompt_logprobs: list[LogprobDict | None] | None = None
  num_cached_tokens: int = 0

  @property
  def text(self) -> str:
    return self.outputs[0].text

  @property
  def token_ids(self) -> tuple[int, ...]:
    return self.outputs[0].token_ids

  @property
  def finish_reason(self) -> str:
    return self.outputs[0].finish_reason


def _bytes_by_format(tree) -> dict[str, int]:
  """{format: bytes} over the array leaves of `tree`: block formats by `matmul.weight_format`,
  other arrays by their dtype's name."""
  out: dict[str, int] = {}
  for a in jax.tree.leaves(tree):
    fmt = matmul.weight_format(a)
    key = str(a.dtype) if fmt == "float32" else fmt
    out[key] = out.get(key, 0) + a.size * a.dtype.itemsize
  return out


class LLM:
  """A model ready to generate, on the engine (continuous batching over a paged KV cache).

  Args:
    model: a registry name (see `models/`), a Hugging Face directory, a .gguf file or a jaxtier
      Orbax directory.
    **engine_args: the engine arguments, `jaxtier.engine_args.EngineArgs` (same names as the
      scripts' flags): dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
      num_device_blocks / kv_cache_memory_gb, num_host_blocks / swap_space_gb, kv_cache_dtype
      ("auto", "float32", "bfloat16", "int8"), preemption_mode, watermark, victim_policy,
      enable_prefix_caching, host_prefix_caching, async_scheduling, seed,
      layer_execution, offload_tail_layers, prefetch_depth, device_memory_gb,
      tensor_parallel_size, trace_path, attention_impl, weight_format, block_activations,
      chat_template. Bad values raise ValueError before any weight loads.

  Loading is placement-first (`jaxtier.checkpoint.placed`): each tensor goes straight to its
  device shard or, for the offloaded tail, to pinned host memory.

  With offloaded layers on CPU, call
  `jaxtier.cpu_allocator.retain_freed_memory(single_arena=True)` first: the d + 1 fetched layers
  are step temporaries, which glibc maps afresh (page-faulting) every step once they pass 32 MB.
  """

  def __init__(self, model: str, **engine_args):
    self.args = EngineArgs(model=model, **engine_args)
    args = self.args
    self.mesh = sharding.make_mesh(args.tensor_parallel_size)
    # GGUF blocks are kept only by packed unrolled layers and head (one device, CPU kernels);
    # otherwise a registry model loads from its float32 Orbax copy.
    keep_quantized = (args.weight_format == "auto" and args.tensor_parallel_size == 1
                      and resolve_layer_execution(args.layer_execution) == "unrolled")
    opened = checkpoint.open_checkpoint(model, keep_quantized=keep_quantized)
    try:
      self.config = opened.config
      self._check_model(self.config)
      self.max_model_len = args.max_model_len or self.config.max_position_embeddings
      self.max_num_seqs = args.max_num_seqs
      self.kv_cache_dtype = args.resolved_kv_cache_dtype()
      self.cache_dtype = checkpoint.resolve_dtype(args.dtype)  # the reference driver's KV dtype
      self.block_bytes = kv_block_bytes(self.config.num_layers, self.config.num_kv_heads,
                                        self.config.head_dim, self.kv_cache_dtype, args.block_size)
      self.layer_execution = resolve_layer_execution(args.layer_execution)
      # how kept blocks multiply ("auto" resolved where blocks may be kept; float32 elsewhere,
      # where it has no effect)
      self.block_activations = (args.resolved_block_activations() if keep_quantized
                                else "float32")
      self.offload = self._resolve_offload(opened.source if keep_quantized else None)
      self.layout = placed.Layout.of(self.config.num_layers, self.offload.offload_tail_layers,
                                     self.offload.prefetch_depth or 1, self.layer_execution,
                                     self.mesh, keep_quantized=keep_quantized,
                                     block_activations=self.block_activations)
    except BaseException:
      opened.close()
      raise
    self.loaded = checkpoint.load_opened(opened, args.dtype, self.layout)
    self.model_name = model
    self.tokenizer = self.loaded.tokenizer
    if args.chat_template is not None:
      self.tokenizer = dataclasses.replace(
          self.tokenizer, chat_template=resolve_chat_template(args.chat_template))
    self.graphdef, self.state = nnx.split(self.loaded.model)
    if args.block_activations == "int16" and not any(
        matmul.weight_format(leaf).endswith("_i16") for leaf in jax.tree.leaves(self.state)):
      logging.warning("block_activations='int16' has no effect: no GGUF blocks are kept (they are "
                      "kept for a GGUF file of quantized layers, with weight_format='auto', "
                      "unrolled layers on one device and the CPU kernels built)")
    num_device_blocks, num_host_blocks = self._pool_blocks()
    self.engine_config = EngineConfig(
        max_model_len=self.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.token_budget, block_size=args.block_size,
        num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
        kv_cache_dtype=self.kv_cache_dtype, preemption_mode=args.preemption_mode,
        watermark=args.watermark, victim_policy=args.victim_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        host_prefix_caching=args.host_prefix_caching, trace_path=args.trace_path,
        attention_impl=args.attention_impl, async_scheduling=args.async_scheduling)
    self._engine: Engine | None = None
    self._rng = np.random.default_rng(args.seed)
    self._next_id = 0

  @property
  def engine(self) -> Engine:
    """The engine. Its KV pools are allocated on first use, so a process that only runs the
    padded reference driver (`run_batch`) holds no pools beside it."""
    if self._engine is None:
      self._engine = Engine(nnx.merge(self.graphdef, self.state), self.tokenizer,
                            self.engine_config)
    return self._engine

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

  def _check_model(self, config) -> None:
    """The checks that need the model's config, before any weight is read."""
    args = self.args
    limit = config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
      raise ValueError(f"max_model_len={args.max_model_len}: expected at most {limit}, the "
                       "context window of this model")
    check_offload(args.offload_tail_layers, args.prefetch_depth, config.num_layers)
    sharding.check_tensor_parallel(config, args.tensor_parallel_size)

  @property
  def tensor_parallel_size(self) -> int:
    return sharding.tp_size(self.mesh)

  def _device_memory_bytes(self) -> int | None:
    if self.args.device_memory_gb is not None:
      return int(self.args.device_memory_gb * GB)
    return offload_auto.device_memory_bytes()

  def _activation_reserve_bytes(self) -> int:
    itemsize = np.dtype(checkpoint.resolve_dtype(self.args.dtype)).itemsize
    return offload_auto.activation_reserve_bytes(
        self.config, 1, min(self.args.token_budget, self.max_model_len), itemsize)

  def _explicit_pool_bytes(self) -> int | None:
    if self.args.num_device_blocks is not None:
      return self.args.num_device_blocks * self.block_bytes
    if self.args.kv_cache_memory_gb is not None:
      return int(self.args.kv_cache_memory_gb * GB)
    return None

  def _resolve_offload(self, kept_from=None) -> offload_auto.Resolved:
    """The offload to run. "auto" plans against the paged pool the engine will allocate: the
    explicit pool size when one is given, else the smallest pool that can run (one max_model_len
    sequence), since the default pool takes whatever device memory the weights leave. So nothing
    is offloaded while the weights, the activations and that minimal pool fit in
    `gpu_memory_utilization` of the device memory. `kept_from`: the opened source when resident
    layers may keep its blocks; they are then sized as held (offloaded layers stay floats)."""
    args = self.args
    resident = None
    if kept_from is not None and args.offload_tail_layers != 0:
      resident = placed.resident_bytes(
          self.config, kept_from, checkpoint.resolve_dtype(args.dtype),
          placed.Layout.of(self.config.num_layers, layer_execution=self.layer_execution,
                           keep_quantized=True, block_activations=self.block_activations))
    minimal = blocks_for(self.max_model_len, args.block_size) * self.block_bytes
    kv_reserve = self._explicit_pool_bytes()
    memory = self._device_memory_bytes()
    return offload_auto.resolve(
        self.config, args.dtype, args.offload_tail_layers, args.prefetch_depth,
        memory_bytes=None if memory is None else int(memory * args.gpu_memory_utilization),
        kv_reserve_bytes=((minimal if kv_reserve is None else kv_reserve)
                          // self.tensor_parallel_size),
        tensor_parallel_size=self.tensor_parallel_size,
        activation_reserve_bytes=self._activation_reserve_bytes(),
        batch=pow2_bucket(self.max_num_seqs), context=self.max_model_len, resident=resident)

  def _pool_blocks(self) -> tuple[int, int]:
    """Device and host KV pool sizes in blocks (see `jaxtier.engine_args` for the defaults)."""
    args, block_bytes = self.args, self.block_bytes
    explicit = self._explicit_pool_bytes()
    memory = self._device_memory_bytes()
    host = None  # the host pool's default: the device pool's size, unless the CPU rule sets it
    if explicit is not None:
      device = explicit // block_bytes
    elif memory is not None:
      # Per device: each holds its shard of the weights and 1 / tp of every block's kv heads.
      weights = offload.bytes_per_device(self.state).get(offload.DEVICE, 0)
      free = memory * args.gpu_memory_utilization - weights - self._activation_reserve_bytes()
      device = int(free // (block_bytes // self.tensor_parallel_size))
    else:
      device, host = cpu_default_pool_blocks(self.max_num_seqs, self.max_model_len,
                                             args.block_size, block_bytes)
    needed = blocks_for(self.max_model_len, args.block_size)
    if device < needed:
      raise ValueError(
          f"the device KV pool holds {max(device, 0)} blocks of {args.block_size} tokens "
          f"({max(device, 0) * block_bytes / GB:.3f} GB) but one sequence of max_model_len="
          f"{self.max_model_len} tokens needs {needed}: raise num_device_blocks / "
          "kv_cache_memory_gb (or device memory), or lower max_model_len")
    if args.num_host_blocks is not None:
      host = args.num_host_blocks
    elif args.swap_space_gb is not None:
      host = int(args.swap_space_gb * GB // block_bytes)
    elif host is None:
      host = device
    return device, host

  def memory_report(self) -> dict[str, int]:
    """Where the weights and the KV cache live, and what crosses the host link every step.

    Weight bytes are counted from the placement of the model state; KV bytes are the engine's
    device and pinned-host pools (blocks x `kv_block_bytes`, allocated on the engine's first use).
    Totals are over all devices; `*_per_device` are one device's share under tensor parallelism.
    Every step streams all host-resident weights once (`weight_transfer_bytes_per_step`);
    `kv_swap_bytes_per_step` is the mean over the steps run so far (`kv_swap_bytes_max_step` the
    largest). `weight_bytes_by_format`: the weights' bytes by how they are held, the dtype's name
    or, for weights kept in GGUF blocks, the block format (`matmul.weight_format`: "q4_1",
    "q8_0", "q8_16", "q4_1_i16", "q8_0_i16").
    """
    by_kind = offload.bytes_by_memory_kind(self.state)
    per_device, tp = offload.bytes_per_device(self.state), self.tensor_parallel_size
    host = sum(v for k, v in by_kind.items() if k != offload.DEVICE)
    n, depth = self.offload.offload_tail_layers, self.offload.prefetch_depth
    layer_bytes = host // n if n else 0
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
            "tensor_parallel_size": tp,
            "device_weight_bytes_per_device": per_device.get(offload.DEVICE, 0),
            "host_weight_bytes_per_device": sum(v for k, v in per_device.items()
                                                if k != offload.DEVICE),
            "device_kv_bytes_per_device": c.num_device_blocks * self.block_bytes // tp,
            "weight_bytes_by_format": _bytes_by_format(self.state)}

  def stats(self) -> dict:
    """The engine's figures (swaps, preemptions, pools, requests, compiles; see `Engine.stats`)
    plus the offload: layers, depth, bytes streamed per step and the planner's step times."""
    stats = self.engine.stats()
    plan = self.offload.plan
    stats.update(
        offload_tail_layers=self.offload.offload_tail_layers,
        prefetch_depth=self.offload.prefetch_depth,
        weight_transfer_bytes_per_step=sum(
            v for k, v in offload.bytes_by_memory_kind(self.state).items() if k != offload.DEVICE),
        offload_predicted_step_seconds=plan.predicted_step_s if plan is not None else None,
        offload_compute_step_seconds=plan.compute_step_s if plan is not None else None)
    return stats

  def reset_prefix_cache(self) -> None:
    """Forgets every cached prefix block that no running request uses, on both tiers."""
    self.engine.reset_prefix_cache()

  def doctor(self) -> str:
    """The symptom -> remedy rows that this run's figures show (see `jaxtier.tools.doctor`)."""
    stats = self.stats()
    return doctor.report(doctor.diagnose(stats), stats)

  def prompt_token_ids(self, prompt: Prompt, index: int = 0) -> list[int]:
    """Token ids of one prompt (a string or token ids), checked against vocabulary and context.

    Raises ValueError or TypeError naming the prompt by `index`.
    """
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError(f"prompt {index} is empty")
      self._check_text_fits(prompt, index)
      ids = self.tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) for t in prompt):
      ids = [int(t) for t in prompt]
      bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
      if bad:
        raise ValueError(f"prompt {index} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
    else:
      raise TypeError(f"prompt {index} must be a string or a list of token ids, got "
                      f"{type(prompt).__name__}")
    if not ids:
      raise ValueError(f"prompt {index} is empty")
    if len(ids) >= self.max_model_len:
      raise ValueError(f"prompt {index} has {len(ids)} tokens; the context window max_model_len is "
                       f"{self.max_model_len} and at least one token must be generated")
    return ids

  def _params_list(self, params, n: int) -> list[SamplingParams]:
    if params is None:
      return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
      return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
      raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} of them")
    return params

  def chat_token_ids(self, conversation: Sequence[Message], index: int = 0) -> list[int]:
    """Token ids of a conversation rendered with the chat template, checked like a prompt."""
    text = self.tokenizer.apply_chat_template(conversation)
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
    """A `Request` for `run_batch`; a request without a seed gets one from the engine's seed."""
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
        while not exhausted and engine.num_unfinished < 2 * self.max_num_seqs:
          item = next(items, None)
          if item is None:
            exhausted = True
            break
          key, text, ids, params = item
          request_id, self._next_id = self._next_id, self._next_id + 1
          seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
          engine.add_request(request_id, ids, params, seed)
          mine[request_id] = (key, text, tuple(ids))
        if not mine:
          return
        for update in engine.step():
          generated += len(update.new_token_ids)
          if update.completion is None or update.request_id not in mine:
            continue
          key, text, ids = mine.pop(update.request_id)
          c = update.completion
          if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s",
                                refresh=False)
          yield key, RequestOutput(
              str(key), text, ids,
              (CompletionOutput(0, c.text, c.token_ids, c.finish_reason,
                                None if c.logprobs is None else list(c.logprobs)),),
              None if c.prompt_logprobs is None else list(c.prompt_logprobs), c.num_cached_tokens)
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
