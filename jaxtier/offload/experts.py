"""Mixture-of-experts layers whose routed experts live in pinned host memory.

A layer group (`ExpertOffloadedLayers`) of consecutive MoE decoder layers, stacked on a leading
[layers] axis: the routed experts' parameters (`EXPERT_PARAMS`, most of a MoE model's bytes) are in
`pinned_host` memory, everything else (attention, norms, router) on the device. A forward call
runs the group's experts one of two ways, fixed when it is traced by its token count n (the
rows times tokens of the call, a static shape):

- **stream** (n >= `stream_from_tokens`): `prefetch_scan_layers` over the stack, as the offloaded
  tail runs, each layer's whole expert stack fetched `depth` layers ahead; the device computes
  every layer (`moe.grouped_experts`). One call moves every offloaded expert byte once.
- **host** (n < `stream_from_tokens`, or it is None): each layer's router runs on the device,
  and the routed experts are computed where they live, under
  `compute_on("device_host")`, as llama.cpp computes offloaded experts on the CPU: the normed
  activations and the routing go to the host and the [n, h] result comes back. The host uses
  `moe.gathered_experts` where n * k <= e (it reads only the experts routed to) and
  `moe.masked_experts` otherwise (each expert once, e / k times the routed FLOPs); both build no
  constant arrays, which a host computation cannot mix with its host operands. Layers run one
  after another (unrolled), each reading its own experts by a static index. One device only.

`jaxtier.offload.expert_cost` chooses `stream_from_tokens` from the link and host rates. Outputs
equal the resident model's (`jaxtier.model.LayerStack`) in both modes.

Shape legend: b batch, t tokens, h hidden size, n = b * t tokens, e experts, k experts per token.
"""

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding, PartitionSpec, Sharding
from flax import nnx

from jaxtier.common.checks import check_int, check_prefetch_depth
from jaxtier.model import moe
from jaxtier.model.transformer import DecoderLayer, expert_weights
from jaxtier.offload import placement
from jaxtier.offload.prefetch import ORDERS, prefetch_scan_layers

EXPERT_PARAMS = ("expert_gate", "expert_up", "expert_down")


def is_expert_param(path) -> bool:
  """Whether the parameter at `path` (a key path of a layer's state) is a routed expert's."""
  names = [getattr(k, "key", getattr(k, "name", k)) for k in path]
  return any(name in EXPERT_PARAMS for name in names)


def _split(state: nnx.State):
  """(leaves, treedef, which leaves are experts' parameters) of a layer stack's state."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
  return ([a for _, a in with_paths], treedef,
          tuple(is_expert_param(path) for path, _ in with_paths))


def mode_of(stream_from_tokens: int | None, tokens: int) -> str:
  """"stream" for a call of `tokens` tokens from `stream_from_tokens` on, else "host"."""
  return "stream" if stream_from_tokens is not None and tokens >= stream_from_tokens else "host"


def whole(stacked: Sharding, kind: str) -> Sharding:
  """The sharding, in memory kind `kind`, of an unsharded value beside an expert stack of
  sharding `stacked`, which must be on one device."""
  if len(stacked.device_set) != 1:
    raise ValueError("experts computed on the host need their stack on one device; got "
                     f"{stacked} (stream them instead: expert_offload_mode='stream')")
  if isinstance(stacked, NamedSharding):
    return NamedSharding(stacked.mesh, PartitionSpec(), memory_kind=kind)
  return stacked.with_memory_kind(kind)


def host_experts(x_nh, weights_nk, experts_nk, gate, up, down, layer: int, act: str,
                 host: Sharding, device: Sharding):
  """A layer's routed experts computed on the host: `gate`, `up` ([l, e, h, f]) and `down`
  ([l, e, f, h]) are a stack's pinned-host parameters (or, compact, dicts of their parts) and `layer` the static index of this
  layer's; `host` and `device` are the shardings the activations take there and back (`whole`).
  The activations and the routing move to the host, the [n, h] result back."""
  n = x_nh.shape[0]
  e, k = jax.tree.leaves(gate)[0].shape[1], experts_nk.shape[1]
  gathered = n * k <= e
  routing = ((weights_nk, experts_nk) if gathered
             else (moe.mixing_weights(weights_nk, experts_nk, e),))
  moved = jax.device_put((x_nh, *routing), host)

  @compute_on("device_host")
  @jax.jit
  def run(x_nh, routing, gate, up, down):
    # this layer's experts (a compact stack's parts, dequantized here on the host)
    g, u, d = (expert_weights(jax.tree.map(lambda a: a[layer], w), x_nh.dtype)
               for w in (gate, up, down))
    if gathered:
      return moe.gathered_experts(x_nh, *routing, g, u, d, act)
    return moe.masked_experts(x_nh, *routing, g, u, d, act)

  out_nh = run(moved[0], moved[1:], gate, up, down)
  return jax.device_put(out_nh, device).astype(x_nh.dtype)


class ExpertOffloadedLayers(nnx.Module):
  """Layers [first, first + n) of a mixture-of-experts decoder with their routed experts in
  `memory_kind` (see the module docstring); called like `jaxtier.model.LayerStack`.

  `layers` is a DecoderLayer with a leading [n] axis (the experts are copied into
  `memory_kind`, the rest kept where it is); `depth` the stream mode's prefetch depth (at most
  n); `stream_from_tokens` the token count from which a call streams (None: never, 1: always).
  """

  def __init__(self, layers: DecoderLayer, first: int, depth: int,
               stream_from_tokens: int | None, memory_kind: str = placement.PINNED_HOST,
               order: str = "auto"):
    if layers.experts is None:
      raise ValueError("expert offload needs mixture-of-experts layers; these layers are dense")
    leaves, treedef, expert = _split(nnx.state(layers))
    check_prefetch_depth(depth, leaves[0].shape[0])
    check_int("stream_from_tokens", stream_from_tokens, 1, optional=True)
    if order not in ORDERS:
      raise ValueError(f"order={order!r}: expected one of {ORDERS}")
    placement.check_memory_kind(memory_kind)
    leaves = [placement.to_memory_kind(a, memory_kind) if e else a for a, e in zip(leaves, expert)]
    self.device_shardings = tuple(placement.layer_sharding(a.sharding, placement.DEVICE)
                                  for a in leaves)
    self.layers = nnx.merge(nnx.graphdef(layers), treedef.unflatten(leaves))
    self.first, self.depth, self.order = first, depth, order
    self.stream_from_tokens = stream_from_tokens
    stack = next(a for a, e in zip(leaves, expert) if e).sharding
    self.shardings = ((whole(stack, memory_kind), whole(stack, placement.DEVICE))
                      if len(stack.device_set) == 1 else None)  # host mode's activations

  @property
  def num_layers(self) -> int:
    return jax.tree.leaves(nnx.state(self.layers))[0].shape[0]

  def mode(self, tokens: int) -> str:
    """How a call of `tokens` tokens runs the experts: "stream" or "host"."""
    return mode_of(self.stream_from_tokens, tokens)

  def __call__(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    b, t, _ = x_bth.shape
    graphdef, stacked = nnx.split(self.layers)
    if self.mode(b * t) == "stream":
      return prefetch_scan_layers(graphdef, stacked, x_bth, cos_btd, sin_btd, cache, pos_bt, meta,
                                  self.first, self.depth, device_shardings=self.device_shardings,
                                  order=self.order)
    if self.shardings is None:
      raise ValueError("experts computed on the host need their stack on one device; stream "
                       "them under tensor parallelism (expert_offload_mode='stream')")
    leaves, treedef, expert = _split(stacked)
    host = dict(zip(EXPERT_PARAMS, _expert_stacks(stacked)))
    for j in range(self.num_layers):
      # the layer's own expert parameters are left as the whole stacks: `moe` does not read them
      layer = nnx.merge(graphdef, treedef.unflatten(
          [a if e else a[j] for a, e in zip(leaves, expert)]))

      def experts(x_nh, weights_nk, experts_nk, j=j, act=layer.act):
        return host_experts(x_nh, weights_nk, experts_nk, host["expert_gate"],
                            host["expert_up"], host["expert_down"], j, act, *self.shardings)

      x_bth, cache = layer(x_bth, cos_btd, sin_btd, cache, jnp.int32(self.first + j), pos_bt,
                           meta, experts=experts)
    return x_bth, cache


def _expert_stacks(stacked: nnx.State) -> tuple[jax.Array, ...]:
  """The stacked (gate, up, down) expert parameters of a layer stack's state."""
  pure = nnx.to_pure_dict(stacked)
  return tuple(pure[name] for name in EXPERT_PARAMS)


def expert_group(depth: int, stream_from_tokens: int | None,
                 memory_kind: str = placement.PINNED_HOST, order: str = "auto"):
  """A group factory for `jaxtier.model.GroupedTransformer`: `(n, expert_group(d, s))` keeps those
  n layers' experts in `memory_kind`."""

  def make(layers: DecoderLayer, first: int) -> ExpertOffloadedLayers:
    return ExpertOffloadedLayers(layers, first, min(depth, jax.tree.leaves(
        nnx.state(layers))[0].shape[0]), stream_from_tokens, memory_kind, order)

  return make
