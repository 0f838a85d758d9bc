"""Run an offloaded MoE layer's experts streamed to the device or where they live, on the host.

An offloaded MoE layer keeps its expert stack in pinned host memory. A forward call of n tokens
(the batch's token count) can run those experts two ways:

- "stream": copy the whole stack (all e experts; each a gate and an up [h, f] and a down [f, h])
  host -> device over the link and compute on the device. The copy dominates:
      stream_s = layer_bytes / link_bytes_per_s,    layer_bytes = e * 3 * h * f * weight_itemsize.
- "host": compute the routed experts on the host, where they live (llama.cpp's --cpu-moe). Only
  the activations cross the link, x [n, h] to the host and out [n, h] back, plus the router's
  weights and indices (n * k * 8 bytes). The host runs one of two forms, picked by the static n:
  - "gathered" when n * k <= e: each of the p = n * k (token, expert) pairs gathers its expert's
    weights: p experts' bytes read, p * 6 * h * f FLOPs;
  - "masked" otherwise: every expert on every token, weighted by the router: e experts' bytes
    read, n * e * 6 * h * f FLOPs.
      host_s = round_trip_s + (2 * n * h * activation_itemsize + n * k * 8) / link_bytes_per_s
               + max(bytes_read / host_bytes_per_s, flops / host_flops).

(6 * h * f: three [h, f] matmuls at two FLOPs a multiply-add.) At batch 1 a token touches k
experts, and the link, moving all e, is the cost: the host wins. The host's cost grows with n and
the stream's does not, so from some token count on streaming wins; `stream_from_tokens` finds it.
host_s never decreases with n (the gathered form reads at most e experts and does fewer FLOPs
than the masked form of n + 1 tokens), so the choice switches once.

Symbols: e = num_experts, k = experts_per_tok, h = hidden_size, f = expert_width (the config's
moe_intermediate_size), n = tokens.
"""

import dataclasses
import math
from collections.abc import Iterable

from jaxtier.common.choices import EXPERT_OFFLOAD_MODES, PLANNED_DTYPE_BYTES, check_dtype
from jaxtier.model.config import ModelConfig
from jaxtier.offload.hardware import Hardware

FORCED = EXPERT_OFFLOAD_MODES  # the engine argument's values: "auto" lets the cost model choose
MODES = FORCED[1:]  # ("stream", "host")
HOST_FORMS = ("gathered", "masked")
ROUTER_BYTES_PER_PAIR = 8  # one (token, expert) pair's router weight and index, 4 bytes each
FLOPS_PER_WEIGHT = 2  # a multiply-add per weight per token: 3 * h * f weights -> 6 * h * f FLOPs


def _positive_number(name: str, value) -> None:
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
      or value <= 0):
    raise ValueError(f"{name}={value!r}: expected a positive finite number")


def _int_at_least(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")


def _forced(forced) -> str:
  if forced not in FORCED:
    raise ValueError(f"forced={forced!r}: expected one of {FORCED}")
  return forced


@dataclasses.dataclass(frozen=True)
class ExpertRates:
  """The rates that price the two modes.

  Attributes:
    link_bytes_per_s: achieved pinned host <-> device bandwidth.
    host_bytes_per_s: the host's sustained memory bandwidth.
    host_flops: the host's sustained matmul FLOP/s in the experts' dtype.
    round_trip_s: fixed cost of handing a layer's experts to the host and back (a device -> host
      -> device synchronization).
  """
  link_bytes_per_s: float
  host_bytes_per_s: float
  host_flops: float
  round_trip_s: float = 30e-6

  def __post_init__(self):
    for field in dataclasses.fields(self):
      _positive_number(field.name, getattr(self, field.name))


@dataclasses.dataclass(frozen=True)
class ExpertShape:
  """One MoE layer's expert stack.

  Attributes:
    num_experts: e, the experts in the layer.
    experts_per_tok: k, the experts each token is routed to (1 <= k <= e).
    hidden_size: h.
    expert_width: f, each expert's intermediate width.
    weight_itemsize: bytes per expert weight (4 float32, 2 bfloat16).
    activation_itemsize: bytes per activation element crossing the link.
    held_layer_bytes: the stack's bytes as held where they are not its floats' (a
      pre-quantized checkpoint's compact experts); None: e * 3 * h * f * weight_itemsize.
  """
  num_experts: int
  experts_per_tok: int
  hidden_size: int
  expert_width: int
  weight_itemsize: int
  activation_itemsize: int = 4
  held_layer_bytes: int | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if field.name != "held_layer_bytes" or self.held_layer_bytes is not None:
        _int_at_least(field.name, getattr(self, field.name), 1)
    if self.experts_per_tok > self.num_experts:
      raise ValueError(f"experts_per_tok={self.experts_per_tok}: expected at most "
                       f"num_experts={self.num_experts}")

  @property
  def expert_bytes(self) -> int:
    """One expert's gate, up and down weights."""
    if self.held_layer_bytes is not None:
      return self.held_layer_bytes // self.num_experts
    return 3 * self.hidden_size * self.expert_width * self.weight_itemsize

  @property
  def layer_bytes(self) -> int:
    """The layer's whole expert stack."""
    return self.held_layer_bytes or self.num_experts * self.expert_bytes

  @property
  def expert_flops_per_token(self) -> int:
    """One expert on one token: 6 * h * f."""
    return FLOPS_PER_WEIGHT * 3 * self.hidden_size * self.expert_width

  @classmethod
  def of(cls, config: ModelConfig, dtype: str) -> "ExpertShape":
    """The expert stack of `config`'s MoE layers with weights and activations in `dtype`."""
    check_dtype("dtype", dtype, planned=True)
    if not config.num_experts:
      raise ValueError(f"{config.architecture} config has no experts (num_experts=0)")
    size = PLANNED_DTYPE_BYTES[dtype]
    return cls(num_experts=config.num_experts, experts_per_tok=config.num_experts_per_tok,
               hidden_size=config.hidden_size, expert_width=config.moe_intermediate_size,
               weight_itemsize=size, activation_itemsize=size)


def experts_touched(tokens: int, e: int, k: int) -> float:
  """Expected distinct experts `tokens` tokens route to, each to k of e uniformly at random:
  e * (1 - (1 - k / e) ** tokens). 1 token: k; many: e."""
  _int_at_least("tokens", tokens, 0)
  _int_at_least("e", e, 1)
  _int_at_least("k", k, 1)
  if k > e:
    raise ValueError(f"k={k}: expected at most e={e}")
  return e * (1.0 - (1.0 - k / e) ** tokens)


def host_form(shape: ExpertShape, tokens: int) -> str:
  """The host's form for `tokens` tokens: "gathered" when tokens * k <= e, else "masked"."""
  _int_at_least("tokens", tokens, 1)
  return "gathered" if tokens * shape.experts_per_tok <= shape.num_experts else "masked"


def stream_seconds(shape: ExpertShape, rates: ExpertRates) -> float:
  """Copying the layer's whole expert stack over the link: layer_bytes / link."""
  return shape.layer_bytes / rates.link_bytes_per_s


def host_seconds(shape: ExpertShape, rates: ExpertRates, tokens: int) -> float:
  """Computing `tokens` tokens' routed experts on the host (see the module docstring)."""
  if host_form(shape, tokens) == "gathered":
    computed = tokens * shape.experts_per_tok  # (token, expert) pairs, one expert read each
    flops = computed * shape.expert_flops_per_token
  else:
    computed = shape.num_experts
    flops = tokens * shape.num_experts * shape.expert_flops_per_token
  link_bytes = (2 * tokens * shape.hidden_size * shape.activation_itemsize
                + tokens * shape.experts_per_tok * ROUTER_BYTES_PER_PAIR)
  compute_s = max(computed * shape.expert_bytes / rates.host_bytes_per_s, flops / rates.host_flops)
  return rates.round_trip_s + link_bytes / rates.link_bytes_per_s + compute_s


def choose(shape: ExpertShape, rates: ExpertRates, tokens: int, forced: str = "auto") -> str:
  """"stream" or "host" for a call of `tokens` tokens: `forced` unless "auto", else the cheaper
  (a tie streams)."""
  _int_at_least("tokens", tokens, 1)
  if _forced(forced) != "auto":
    return forced
  return "stream" if stream_seconds(shape, rates) <= host_seconds(shape, rates, tokens) else "host"


def stream_from_tokens(shape: ExpertShape, rates: ExpertRates, forced: str = "auto",
                       limit: int = 1 << 20) -> int | None:
  """The smallest token count from which every call streams; None when the host is cheaper up to
  `limit` tokens (or `forced` is "host"). Binary search: host_s never decreases with tokens."""
  _int_at_least("limit", limit, 1)
  if _forced(forced) == "stream":
    return 1
  if forced == "host" or choose(shape, rates, limit) == "host":
    return None
  low, high = 1, limit  # the answer lies in [low, high]; choose(high) streams
  while low < high:
    mid = (low + high) // 2
    if choose(shape, rates, mid) == "stream":
      high = mid
    else:
      low = mid + 1
  return low


def rates_of(hardware: Hardware, round_trip_s: float = 30e-6) -> ExpertRates:
  """The rates of a `jaxtier.offload.hardware.Hardware` preset or measurement."""
  return ExpertRates(link_bytes_per_s=hardware.link_bytes_per_s,
                     host_bytes_per_s=hardware.host_bytes_per_s,
                     host_flops=hardware.host_flops, round_trip_s=round_trip_s)


def report(shape: ExpertShape, rates: ExpertRates, layers: Iterable[int], forced: str = "auto",
           batches: Iterable[int] = (1, 8, 32, 64, 256)) -> dict:
  """A JSON-ready summary: the threshold, each batch's mode and costs, and each offloaded MoE
  layer's threshold (the same for every layer: they share one shape)."""
  _forced(forced)
  layers = tuple(layers)
  for layer in layers:
    _int_at_least("layer", layer, 0)
  threshold = stream_from_tokens(shape, rates, forced)
  stream_s = stream_seconds(shape, rates)
  by_batch = {}
  for tokens in batches:
    by_batch[str(tokens)] = {
        "mode": choose(shape, rates, tokens, forced),
        "host_form": host_form(shape, tokens),
        "host_s": host_seconds(shape, rates, tokens),
        "stream_s": stream_s,
        "experts_touched": experts_touched(tokens, shape.num_experts, shape.experts_per_tok),
    }
  return {"forced": forced, "stream_from_tokens": threshold, "stream_s": stream_s,
          "by_batch": by_batch, "layers": {str(layer): threshold for layer in layers}}
