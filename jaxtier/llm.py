"""The offline API, in the shape vLLM users know: `LLM(model).generate(prompts, SamplingParams(...))`."""

import dataclasses
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxtier import checkpoint, offload
from jaxtier.generate import Completion, Request, StepUpdate, bucket_pow2, generate_batch
from jaxtier.model import GroupedTransformer
from jaxtier.offload import auto as offload_auto
from jaxtier.sampling import SamplingParams
from jaxtier.tokenizer import Message

Prompt = str | Sequence[int]
LAYER_EXECUTIONS = ("auto", "scan", "unrolled")


def resolve_layer_execution(value: str) -> str:
  """"scan" or "unrolled" for an engine argument that may be "auto"."""
  if value not in LAYER_EXECUTIONS:
    raise ValueError(f"layer_execution={value!r} is not supported; expected one of {LAYER_EXECUTIONS}")
  if value == "auto":
    return "unrolled" if jax.default_backend() == "cpu" else "scan"
  return value


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
  index: int
  text: str
  token_ids: tuple[int, ...]  # generated tokens only
  finish_reason: str  # "stop" or "length"


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """One prompt's result; `text`, `token_ids`, `finish_reason` are those of its first completion."""
  request_id: str
  prompt: str | None
  prompt_token_ids: tuple[int, ...]
  outputs: tuple[CompletionOutput, ...]

  @property
  def text(self) -> str:
    return self.outputs[0].text

  @property
  def token_ids(self) -> tuple[int, ...]:
    return self.outputs[0].token_ids

  @property
  def finish_reason(self) -> str:
    return self.outputs[0].finish_reason


class LLM:
  """A model ready to generate.

  Args:
    model: a registry name (see `models/`), a Hugging Face directory, a .gguf file or a jaxtier
      Orbax directory.
    dtype: parameter and activation dtype, "float32" or "bfloat16".
    max_model_len: context window (prompt plus generated tokens); defaults to the model's.
    max_num_seqs: how many prompts run together in one batch.
    kv_cache_dtype: "auto" (the model dtype), "float32" or "bfloat16".
    seed: seeds the per-request seeds of requests that do not set one.
    layer_execution: "scan" runs the stacked layers with `lax.scan`; "unrolled" keeps each layer in
      its own buffers and runs them one after another (faster on CPU, where XLA copies the slice a
      scan reads; longer to compile); "auto" picks "unrolled" on CPU and "scan" elsewhere. With
      offloaded layers it applies to the resident head.
    offload_tail_layers: how many of the last layers live in pinned host memory and stream to the
      device every step; "auto" asks the offload planner with measured link and compute numbers
      (offloads nothing when the device memory is unknown, as on CPU without device_memory_gb).
    prefetch_depth: how many layers ahead the offloaded tail is fetched (1 to 4); "auto" uses
      ceil(transfer time / compute time) per layer, measured. On CPU, call
      `jaxtier.cpu_allocator.retain_freed_memory()` first: the d + 1 fetched layers are step
      temporaries, which glibc maps afresh (page-faulting) every step once they pass 32 MB.
    device_memory_gb: device memory the "auto" planner may use (GB = 1e9 bytes); default: what the
      device reports.
  """

  def __init__(self, model: str, dtype: str = "float32", max_model_len: int | None = None,
               max_num_seqs: int = 16, kv_cache_dtype: str = "auto", seed: int = 0,
               layer_execution: str = "auto", offload_tail_layers: int | str = 0,
               prefetch_depth: int | str = "auto", device_memory_gb: float | None = None):
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
      raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    if device_memory_gb is not None and not (isinstance(device_memory_gb, (int, float))
                                             and device_memory_gb > 0):
      raise ValueError(f"device_memory_gb={device_memory_gb!r}: expected a positive number")
    self.loaded = checkpoint.load(model, dtype)
    self.model_name = model
    self.tokenizer = self.loaded.tokenizer
    self.config = self.loaded.model.config
    limit = self.config.max_position_embeddings
    if max_model_len is not None and not 2 <= max_model_len <= limit:
      raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {max_model_len}")
    self.max_model_len = max_model_len or limit
    self.max_num_seqs = max_num_seqs
    self.cache_dtype = checkpoint.resolve_dtype(dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    self.layer_execution = resolve_layer_execution(layer_execution)
    self.offload = self._resolve_offload(dtype, offload_tail_layers, prefetch_depth,
                                         device_memory_gb)
    model = self._arrange_layers(self.loaded.model)
    self.loaded = dataclasses.replace(self.loaded, model=model)  # frees the stack it came from
    self.graphdef, self.state = nnx.split(model)
    self._rng = np.random.default_rng(seed)

  def _resolve_offload(self, dtype: str, offload_tail_layers, prefetch_depth,
                       device_memory_gb: float | None) -> offload_auto.Resolved:
    batch = bucket_pow2(self.max_num_seqs)
    return offload_auto.resolve(
        self.loaded.model, dtype, offload_tail_layers, prefetch_depth,
        memory_bytes=(offload_auto.device_memory_bytes() if device_memory_gb is None
                      else int(device_memory_gb * 1e9)),
        kv_reserve_bytes=self._kv_reserve_bytes(),
        activation_reserve_bytes=offload_auto.activation_reserve_bytes(
            self.config, batch, self.max_model_len,
            np.dtype(checkpoint.resolve_dtype(dtype)).itemsize),
        batch=batch, context=self.max_model_len)

  def _arrange_layers(self, model):
    """The model as it runs: offloaded tail and/or unrolled layers, else the stacked scan."""
    if self.offload.offload_tail_layers:
      return offload.offload_tail(model, self.offload.offload_tail_layers,
                                  self.offload.prefetch_depth, self.layer_execution)
    if self.layer_execution == "unrolled":
      return GroupedTransformer(model, [(self.config.num_layers, "unrolled")])
    return model

  def _kv_reserve_bytes(self) -> int:
    """Bytes of the largest KV cache a batch allocates (max_num_seqs rows of max_model_len)."""
    c = self.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * np.dtype(self.cache_dtype).itemsize
    return bucket_pow2(self.max_num_seqs) * bucket_pow2(self.max_model_len, 128) * per_token

  def memory_report(self) -> dict[str, int]:
    """Where the weights and the KV cache live, and what crosses the host link every step.

    Weight bytes are counted from the placement of the model state; `device_kv_bytes` is the
    largest contiguous KV cache a batch allocates (this driver keeps no host KV pool, so
    `host_kv_bytes` and `kv_swap_bytes_per_step` are 0). Every step streams all host-resident
    weights once: `weight_transfer_bytes_per_step`.
    """
    by_kind = offload.bytes_by_memory_kind(self.state)
    host = sum(v for k, v in by_kind.items() if k != offload.DEVICE)
    n, depth = self.offload.offload_tail_layers, self.offload.prefetch_depth
    layer_bytes = host // n if n else 0
    return {"device_weight_bytes": by_kind.get(offload.DEVICE, 0), "host_weight_bytes": host,
            "device_kv_bytes": self._kv_reserve_bytes(), "host_kv_bytes": 0,
            "weight_transfer_bytes_per_step": host, "kv_swap_bytes_per_step": 0,
            "prefetch_buffer_bytes": (depth + 1) * layer_bytes if n else 0,
            "offload_tail_layers": n, "prefetch_depth": depth}

  def prompt_token_ids(self, prompt: Prompt, index: int = 0) -> list[int]:
    """Token ids of one prompt (a string or token ids), checked against vocabulary and context.

    Raises ValueError or TypeError naming the prompt by `index`.
    """
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError(f"prompt {index} is empty")
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
    return self.prompt_token_ids(self.tokenizer.encode(text, add_special_tokens=False), index)

  def make_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
    """A `Request` for `run_batch`; a request without a seed gets one from the engine's seed."""
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
    return Request(tuple(prompt_ids), params, seed)

  def run_batch(self, requests: Sequence[Request],
                on_step: Callable[[list[StepUpdate]], None] | None = None,
                aborted: Callable[[int], bool] | None = None) -> list[Completion]:
    """Generates for up to `max_num_seqs` requests as one batch (see `generate.generate_batch`)."""
    if not 1 <= len(requests) <= self.max_num_seqs:
      raise ValueError(f"run_batch takes 1 to max_num_seqs={self.max_num_seqs} requests, got "
                       f"{len(requests)}")
    return generate_batch(self.graphdef, self.state, self.tokenizer, requests, self.max_model_len,
                          self.cache_dtype, on_step=on_step, aborted=aborted)

  def _run(self, prompts: list[Any], ids: list[list[int]], params: list[SamplingParams],
           use_tqdm: bool) -> list[RequestOutput]:
    requests = [self.make_request(i, p) for i, p in zip(ids, params)]
    order = sorted(range(len(requests)), key=lambda i: len(ids[i]))  # similar lengths batch together
    results: dict[int, Any] = {}
    with tqdm(total=len(requests), disable=not use_tqdm, desc="generate", unit="prompt") as bar:
      for start in range(0, len(order), self.max_num_seqs):
        chunk = order[start:start + self.max_num_seqs]
        done = self.run_batch([requests[i] for i in chunk])
        results.update(zip(chunk, done))
        bar.update(len(chunk))
    return [RequestOutput(str(i), p if isinstance(p, str) else None, tuple(ids[i]),
                          (CompletionOutput(0, results[i].text, results[i].token_ids,
                                            results[i].finish_reason),))
            for i, p in enumerate(prompts)]

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
    iterator = iter(items)
    while True:
      chunk = [item for _, item in zip(range(self.max_num_seqs), iterator)]
      if not chunk:
        return
      ids, texts = [], []
      for key, prompt, _ in chunk:
        try:
          if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            texts.append(self.tokenizer.apply_chat_template(prompt))
            ids.append(self.prompt_token_ids(self.tokenizer.encode(texts[-1],
                                                                   add_special_tokens=False)))
          else:
            texts.append(prompt if isinstance(prompt, str) else None)
            ids.append(self.prompt_token_ids(prompt))
        except (ValueError, TypeError) as e:
          raise ValueError(f"request {key!r}: {e}") from None
      outputs = self._run(texts, ids, [params for _, _, params in chunk], use_tqdm)
      yield from zip([key for key, _, _ in chunk], outputs)
