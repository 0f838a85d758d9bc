"""How many tail layers to offload and how deep to prefetch, as a frozen plan.

Symbols: M device memory, K KV reservation, A activation reserve, W bytes of all weights, L bytes
of one layer, N layers, n offloaded tail layers, d prefetch depth, t_x = L / link bandwidth,
t_c = compute time of one layer. R(j) is the device bytes of the first j layers held resident:
j L, or less where resident layers keep a GGUF file's blocks (`ModelBytes.resident_layer_bytes`;
an offloaded layer always moves and computes as L float bytes), and W = R(N) + the rest.

- n = 0 if W <= M - K - A; otherwise the fewest tail layers for which the resident weights plus
  the d + 1 layer buffers of the prefetch fit: W - R(N) + R(N - n) + (d + 1) L <= M - K - A.
- d = ceil(t_x / t_c), clipped to [1, min(4, n)].
- A step cannot beat max(N t_c, n t_x) (plus the step's KV swap bytes over the link, which go
  first): `step_time_bound_s`. `predicted_step_s` plays the schedule of `prefetch_scan_layers` on a
  serial link (`simulate_step`); the transfers are hidden when it equals N t_c.
"""

import dataclasses
import math

from jaxtier.common import kv_bytes
from jaxtier.common.checks import check_int
from jaxtier.common.choices import PLANNED_DTYPE_BYTES, check_dtype
from jaxtier.model.config import ModelConfig
from jaxtier.offload.prefetch import MAX_DEPTH

GB = 1e9


@dataclasses.dataclass(frozen=True)
class ModelBytes:
  """What the planner needs to know about a model.

  Attributes:
    num_layers: decoder layers N.
    layer_bytes: parameter bytes of one layer, L.
    other_bytes: embedding table, LM head, final norm and rotary frequencies (always resident).
    kv_bytes_per_token: K and V of one token over all layers (int8 scales included), see
      `jaxtier.common.kv_bytes.kv_bytes_per_token`.
    layer_flops_per_token: matmul FLOPs of one layer for one token (2 x its parameters).
    attention_width: query heads x head dim (attention FLOPs per cached token are 4 x this).
    resident_layer_bytes: per layer, its bytes when held resident on the device, where that is
      not `layer_bytes` (the loader keeps a GGUF file's blocks in resident layers, while an
      offloaded layer is held, moved and computed as `layer_bytes` of floats); empty: every layer
      `layer_bytes`. `checkpoint.placed.resident_bytes` computes them.
    expert_layer_bytes: of `layer_bytes`, the routed experts' (0 for a dense model): what a
      layer whose experts are offloaded (`offload_expert_layers`) keeps in host memory instead.
  """
  num_layers: int
  layer_bytes: int
  other_bytes: int = 0
  kv_bytes_per_token: int = 0
  layer_flops_per_token: int = 0
  attention_width: int = 0
  resident_layer_bytes: tuple[int, ...] = ()
  expert_layer_bytes: int = 0

  def __post_init__(self):
    check_int("num_layers", self.num_layers, 1)
    check_int("layer_bytes", self.layer_bytes, 1)
    for name in ("other_bytes", "kv_bytes_per_token", "layer_flops_per_token", "attention_width",
                 "expert_layer_bytes"):
      check_int(name, getattr(self, name), 0)
    if self.resident_layer_bytes:
      if len(self.resident_layer_bytes) != self.num_layers:
        raise ValueError(f"resident_layer_bytes: {len(self.resident_layer_bytes)} entries, "
                         f"expected num_layers={self.num_layers}")
      for value in self.resident_layer_bytes:
        check_int("resident_layer_bytes", value, 1)

  def resident_bytes(self, layers: range) -> int:
    """Device bytes of `layers` held resident (R(stop) - R(start) in the module docstring)."""
    if not self.resident_layer_bytes:
      return len(layers) * self.layer_bytes
    return sum(self.resident_layer_bytes[i] for i in layers)

  def without_experts(self, layers: range) -> "ModelBytes":
    """The model with the routed experts of `layers` held in host memory: those layers' resident
    bytes less `expert_layer_bytes` (an offloaded tail layer still moves as `layer_bytes`)."""
    resident = self.resident_layer_bytes or (self.layer_bytes,) * self.num_layers
    return dataclasses.replace(self, resident_layer_bytes=tuple(
        b - self.expert_layer_bytes if i in layers else b for i, b in enumerate(resident)))

  @property
  def weight_bytes(self) -> int:
    """Every weight resident: W."""
    return self.resident_bytes(range(self.num_layers)) + self.other_bytes

  @classmethod
  def from_config(cls, config: ModelConfig, dtype: str = "bfloat16",
                  kv_cache_dtype: str | None = None,
                  tensor_parallel_size: int = 1) -> "ModelBytes":
    """Bytes and FLOPs of `config` on one device: parameters in `dtype`, KV in `kv_cache_dtype`.

    With `tensor_parallel_size` > 1, each device holds 1 / tp of every layer's projections and
    of the KV heads (its norms and the vocabulary tables are replicated, see
    `jaxtier.model.sharding`) and computes 1 / tp of the layer's FLOPs.

    `kv_cache_dtype` is a name of `jaxtier.common.kv_bytes.ELEMENT_BYTES` ("int8" counts its
    scales); None stores KV in the parameter dtype (float16 parameters count as bfloat16 KV: the
    cache has no float16 mode, and both take two bytes).
    """
    size = _itemsize(dtype, "dtype")
    if kv_cache_dtype is None:
      kv_cache_dtype = "bfloat16" if dtype == "float16" else dtype
    c, tp = config, tensor_parallel_size
    check_int("tensor_parallel_size", tp, 1)
    tables = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    norms = 2 * c.hidden_size
    layer_params = (c.layer_param_count - norms) // tp + norms
    return cls(num_layers=c.num_layers, layer_bytes=layer_params * size,
               # the tables, the final norm and the rotary frequencies (float32)
               other_bytes=(tables + c.hidden_size) * size + c.head_dim // 2 * 4,
               kv_bytes_per_token=kv_bytes.kv_bytes_per_token(c.num_layers, c.num_kv_heads // tp,
                                                              c.head_dim, kv_cache_dtype),
               layer_flops_per_token=2 * (c.layer_param_count - norms) // tp,
               attention_width=c.num_heads * c.head_dim // tp,
               expert_layer_bytes=(c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
                                   // tp * size if c.num_experts else 0))


def simulate_step(num_layers: int, offloaded: int, depth: int, compute_s: float,
                  transfer_s: float, kv_swap_s: float = 0.0) -> float:
  """Seconds of one step under the prefetch schedule, on a link that moves one layer at a time.

  The link first carries the step's KV swaps (`kv_swap_s`), then tail layers in order. Tail layers
  0..d-1 may move from the start of the step (during the resident head); layer j >= d moves once
  tail layer j - d - 1 has computed (its buffer is free), as `prefetch_scan_layers` issues it.
  """
  head = num_layers - offloaded
  done = head * compute_s  # when the previous layer finished computing
  finished, link_free = [], kv_swap_s
  for j in range(offloaded):
    issue = 0.0 if j < depth else (finished[j - depth - 1] if j > depth else head * compute_s)
    link_free = max(link_free, issue) + transfer_s
    done = max(done, link_free) + compute_s
    finished.append(done)
  return done


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
  """A plan and the numbers it came from (seconds and bytes)."""
  model: ModelBytes
  device_memory_bytes: int
  kv_reserve_bytes: int
  activation_reserve_bytes: int
  link_bytes_per_s: float
  layer_compute_s: float
  kv_swap_bytes_per_step: int
  offload_tail_layers: int
  prefetch_depth: int  # 0 when nothing is offloaded
  fits: bool
  predicted_step_s: float
  max_hidden_layers: int  # most tail layers whose transfers the compute still hides

  def __post_init__(self):
    check_int("offload_tail_layers", self.offload_tail_layers, 0)
    if self.offload_tail_layers > self.model.num_layers:
      raise ValueError(f"offload_tail_layers={self.offload_tail_layers}: expected at most "
                       f"num_layers={self.model.num_layers}")
    if not 0 <= self.prefetch_depth <= min(MAX_DEPTH, self.offload_tail_layers) or \
        (self.offload_tail_layers and not self.prefetch_depth):
      raise ValueError(f"prefetch_depth={self.prefetch_depth!r}: expected 1 to "
                       f"{min(MAX_DEPTH, self.offload_tail_layers)} (0 when nothing is offloaded)")

  @property
  def resident_budget_bytes(self) -> int:
    """M - K - A: device bytes left for weights."""
    return self.device_memory_bytes - self.kv_reserve_bytes - self.activation_reserve_bytes

  @property
  def host_weight_bytes(self) -> int:
    return self.offload_tail_layers * self.model.layer_bytes

  @property
  def prefetch_buffer_bytes(self) -> int:
    """Device bytes of the d queued layers plus the one in flight."""
    return (self.prefetch_depth + 1) * self.model.layer_bytes if self.offload_tail_layers else 0

  @property
  def device_weight_bytes(self) -> int:
    """Resident weights plus the prefetch buffers."""
    return _resident(self.model, self.offload_tail_layers, self.prefetch_depth)

  @property
  def weight_transfer_bytes_per_step(self) -> int:
    return self.host_weight_bytes

  @property
  def transfer_layer_s(self) -> float:
    return self.model.layer_bytes / self.link_bytes_per_s

  @property
  def compute_step_s(self) -> float:
    return self.model.num_layers * self.layer_compute_s

  @property
  def step_time_bound_s(self) -> float:
    """max(compute, (KV swap + offloaded weight) bytes / link bandwidth)."""
    link_s = (self.kv_swap_bytes_per_step + self.host_weight_bytes) / self.link_bytes_per_s
    return max(self.compute_step_s, link_s)

  @property
  def hidden(self) -> bool:
    """True when the transfers cost the step nothing: predicted == N t_c."""
    return self.predicted_step_s <= self.compute_step_s * (1 + 1e-9)

  def message(self) -> str:
    """What the plan says, in plain words."""
    return explain(self)

  def to_dict(self) -> dict:
    """Every field and derived number, JSON-ready."""
    out = dataclasses.asdict(self)
    for name in ("resident_budget_bytes", "host_weight_bytes", "prefetch_buffer_bytes",
                 "device_weight_bytes", "weight_transfer_bytes_per_step", "transfer_layer_s",
                 "compute_step_s", "step_time_bound_s", "hidden"):
      out[name] = getattr(self, name)
    out["message"] = self.message()
    return out


def explain(p: OffloadPlan) -> str:
  """The plan in plain words: what to offload, whether the link keeps up, what to do if not."""
  m, n, total = p.model, p.offload_tail_layers, p.model.num_layers
  room = (f"{_gb(p.resident_budget_bytes)} left after the KV reservation "
          f"({_gb(p.kv_reserve_bytes)}) and activation reserve ({_gb(p.activation_reserve_bytes)})")
  if p.resident_budget_bytes <= 0:
    return (f"Does not fit: the KV reservation ({_gb(p.kv_reserve_bytes)}) and activation reserve "
            f"({_gb(p.activation_reserve_bytes)}) alone exceed the device memory "
            f"({_gb(p.device_memory_bytes)}). Lower the concurrency or the context length.")
  if not p.fits:
    return (f"Does not fit: even with {n} of {total} layers offloaded, the resident weights and "
            f"prefetch buffers need {_gb(p.device_weight_bytes)} but only {room}. Lower the "
            "concurrency or the context length, or use a device with more memory.")
  if n == 0:
    return f"All weights ({_gb(m.weight_bytes)}) fit on the device ({room}): nothing to offload."
  layer = (f"a layer takes {_ms(p.transfer_layer_s)} over the link and {_ms(p.layer_compute_s)} "
           "to compute")
  head = (f"Offload the last {n} of {total} layers ({_gb(p.host_weight_bytes)} to pinned host "
          f"memory) and prefetch {p.prefetch_depth} layer(s) ahead: {layer}")
  if p.hidden:
    return (f"{head}, so the transfers hide behind compute; a step should take about "
            f"{_ms(p.predicted_step_s)}, the bound max(compute, transfer) being "
            f"{_ms(p.step_time_bound_s)}.")
  keep = n - p.max_hidden_layers
  return (f"{head}. Offloading cannot be hidden: the step becomes link-bound at about "
          f"{_ms(p.predicted_step_s)} instead of {_ms(p.compute_step_s)} of compute "
          f"({p.predicted_step_s / p.compute_step_s:.2f}x; bound {_ms(p.step_time_bound_s)}). "
          f"Offload fewer layers: at most {p.max_hidden_layers} can be hidden; keeping the other "
          f"{keep} resident needs {_gb(m.resident_bytes(range(total - n, total - n + keep)))} "
          "more device memory (lower the "
          "concurrency or context length), or accept the slowdown.")


def _gb(nbytes: float) -> str:
  for unit, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes:.0f} B"


def _ms(seconds: float) -> str:
  ms = seconds * 1e3
  return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def depth_for(transfer_s: float, compute_s: float, offloaded: int) -> int:
  """ceil(t_x / t_c) in [1, min(MAX_DEPTH, offloaded)]; 0 when nothing is offloaded."""
  if not offloaded:
    return 0
  return max(1, min(MAX_DEPTH, offloaded, math.ceil(transfer_s / compute_s - 1e-9)))


def kv_reservation(model: ModelBytes, concurrency: int, context_len: int) -> int:
  """K for `concurrency` sequences of `context_len` tokens each."""
  check_int("concurrency", concurrency, 1)
  check_int("context_len", context_len, 1)
  return concurrency * context_len * model.kv_bytes_per_token


def plan(model: ModelBytes, *, device_memory_bytes: int, link_bytes_per_s: float,
         layer_compute_s: float, kv_reserve_bytes: int = 0, activation_reserve_bytes: int = 0,
         kv_swap_bytes_per_step: int = 0, offload_tail_layers: int | None = None,
         prefetch_depth: int | None = None) -> OffloadPlan:
  """Plans the offload of `model` (see the module docstring).

  `offload_tail_layers` fixes n instead of deriving it from memory (the plan then only chooses d
  and predicts the step); `prefetch_depth` fixes d (at most n) instead of ceil(t_x / t_c), for the
  memory fit and the prediction alike.
  """
  for name, value in (("device_memory_bytes", device_memory_bytes),
                      ("kv_reserve_bytes", kv_reserve_bytes),
                      ("activation_reserve_bytes", activation_reserve_bytes),
                      ("kv_swap_bytes_per_step", kv_swap_bytes_per_step)):
    check_int(name, value, 1 if name == "device_memory_bytes" else 0)
  for name, value in (("link_bytes_per_s", link_bytes_per_s), ("layer_compute_s", layer_compute_s)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"{name}={value!r}: expected a positive number")
  if prefetch_depth is not None:
    check_int("prefetch_depth", prefetch_depth, 1)
  t_x, t_c, total = model.layer_bytes / link_bytes_per_s, layer_compute_s, model.num_layers

  def depth_of(n: int) -> int:
    return depth_for(t_x, t_c, n) if prefetch_depth is None or not n else min(prefetch_depth, n)

  budget = device_memory_bytes - kv_reserve_bytes - activation_reserve_bytes
  if offload_tail_layers is None:
    needed = _fewest_offloaded(model, budget, depth_of(total))
    offload_tail_layers, fits = min(needed, total), needed <= total
  else:
    check_int("offload_tail_layers", offload_tail_layers, 0)
    fits = _resident(model, offload_tail_layers, depth_of(offload_tail_layers)) <= budget
  depth = depth_of(offload_tail_layers)
  kv_s = kv_swap_bytes_per_step / link_bytes_per_s
  hidden_max = max((n for n in range(total + 1)
                    if simulate_step(total, n, depth_of(n), t_c, t_x, kv_s)
                    <= total * t_c * (1 + 1e-9)), default=0)
  return OffloadPlan(model, device_memory_bytes, kv_reserve_bytes, activation_reserve_bytes,
                     link_bytes_per_s, layer_compute_s, kv_swap_bytes_per_step, offload_tail_layers,
                     depth, fits, simulate_step(total, offload_tail_layers, depth, t_c, t_x, kv_s),
                     hidden_max)


def _resident(model: ModelBytes, offloaded: int, depth: int) -> int:
  """Device weight bytes with the last `offloaded` layers offloaded, prefetched `depth` ahead."""
  buffers = (depth + 1) * model.layer_bytes if offloaded else 0
  return (model.resident_bytes(range(model.num_layers - offloaded)) + model.other_bytes
          + buffers)


def _fewest_offloaded(model: ModelBytes, budget: int, depth: int) -> int:
  """Fewest tail layers whose offload fits the budget; num_layers + 1 when none does."""
  for n in range(model.num_layers + 1):
    if _resident(model, n, min(depth, n)) <= budget:
      return n
  return model.num_layers + 1


def scheduler_link_fields(offload_plan: OffloadPlan) -> dict[str, int | float]:
  """Fields of `jaxtier.scheduler.SchedulerConfig` that share the host link with this plan.

  `link_bytes_per_step`: what the link moves in one predicted step;
  `weight_prefetch_bytes_per_step`: the offloaded bytes every step streams;
  `kv_link_share`: the rest of the link, which KV swaps may take first (the scheduler then grants
  weight prefetch what is left, up to its own share).
  """
  link = max(1, math.floor(offload_plan.link_bytes_per_s * offload_plan.predicted_step_s))
  weights = offload_plan.weight_transfer_bytes_per_step
  return {"link_bytes_per_step": link, "weight_prefetch_bytes_per_step": weights,
          "kv_link_share": max(0.0, (link - weights) / link)}


def _itemsize(dtype: str, name: str) -> int:
  check_dtype(name, dtype, planned=True)
  return PLANNED_DTYPE_BYTES[dtype]
