"""Offloaded tail layers: stacked parameters in host memory, streamed to the device d layers ahead.

`prefetch_scan` runs any stack of NNX layers (parameters with a leading [layers] axis) through a
layer function `(layer, carry, j) -> carry`, with the stack's parameters in `pinned_host` memory;
`prefetch_scan_layers` is its form for jaxtier's decoder layers, with the contract of
`jaxtier.model.scan_layers` (its reference). `OffloadedStack` holds any such stack in host memory,
so a research model can offload its own tail. Layer j of the stack computes from a device copy that
was fetched while layer j - d computed:

    queue = fetch(0), ..., fetch(d - 1)              # prologue
    sub-step j:  queue += fetch(j + d)  if j + d < n  # transfer issued before layer j computes
                 x = layer_j(x, queue.pop(0))

A fetch is a `dynamic_slice` of the host stack followed by `device_put` to device memory: only one
layer's bytes cross the link. The sub-steps run as a `lax.scan` whose body holds d + 1 of them, so
the d queued layers travel in the scan carry and each carry slot is refilled with a fresh layer at
the sub-step after the one that read it. A body of exactly d sub-steps would rotate the queue
(slot i <- slot i + 1) and XLA would copy every slot every iteration. The (n - d) mod (d + 1)
leftover sub-steps run unrolled before the scan, the last d (nothing left to fetch) after it.

Fetch order: XLA inserts two device copies per slot when it cannot prove that a slot's refill comes
after the read of its old layer. On CPU (`order="auto"`) the fetch index is therefore tied to the
hidden state the previous layer produced (plus a zero computed from it), which makes the order a
data dependency and removes the copies; elsewhere the index stays a function of the loop counter
only (what XLA's host offloading expects), unless `order="data"` asks for the same tie.

In the text above n is the number of layers and d the prefetch depth. Shape legend of array
names: b batch, t tokens, h hidden size, d head dim (rotary tables).
"""

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtier.common.checks import MAX_PREFETCH_DEPTH, check_int, check_prefetch_depth
from jaxtier.model.transformer import DecoderLayer, GroupedTransformer, Transformer
from jaxtier.offload import placement

MAX_DEPTH = MAX_PREFETCH_DEPTH
ORDERS = ("auto", "data", "none")
LayerFn = Callable[[nnx.Module, Any, Any], Any]  # (layer, carry, j) -> carry


def _zero_after(x_bth: jax.Array) -> jax.Array:
  """An int32 zero that XLA cannot compute before `x_bth` exists (NaN-safe)."""
  return jnp.minimum(jnp.isnan(x_bth.reshape(-1)[0]).astype(jnp.int32), 0)


def _order_token(x_bth: jax.Array, order: str) -> jax.Array | int:
  if order == "none":
    return 0
  if order == "data":
    return _zero_after(x_bth)
  return jax.lax.platform_dependent(x_bth, cpu=_zero_after, default=lambda x: jnp.int32(0))


def _fetcher(host_state: nnx.State, device_shardings: Sequence[Any] | None, order: str):
  """fetch(j, after) -> the device copy of layer j (an int or a traced index) of `host_state`."""
  leaves, treedef = jax.tree.flatten(host_state)
  if device_shardings is None:
    device_shardings = [placement.layer_sharding(a.sharding, placement.DEVICE) for a in leaves]
  if len(device_shardings) != len(leaves):
    raise ValueError(f"{len(device_shardings)} device shardings for {len(leaves)} parameters")

  def fetch(j, after: jax.Array | None):
    index = j if after is None else j + _order_token(after, order)
    return treedef.unflatten([
        jax.device_put(jax.lax.dynamic_index_in_dim(a, index, keepdims=False), s)
        for a, s in zip(leaves, device_shardings)])

  return fetch


def prefetch_scan(layer_fn: LayerFn, graphdef: nnx.GraphDef, host_state: nnx.State, carry,
                  depth: int = 1, *, device_shardings: Sequence[Any] | None = None,
                  order: str = "auto"):
  """Runs `carry` through a stack of layers whose parameters live in host memory.

  Any stacked NNX layer works: `graphdef` and `host_state` are `nnx.split` of a module whose
  parameters have a leading [layers] axis, and `layer_fn(layer, carry, j) -> carry` applies one
  layer (the module merged from layer j's device copy; j is an int or a traced int32 index into
  the stack). The reference is the same loop over resident layers. `depth` (1 to 4, at most the
  number of layers): layers fetched ahead; `device_shardings` (one per leaf of `host_state`, in
  `jax.tree.leaves` order): where a fetched layer lands, default each stack's own sharding in
  "device" memory, and required under `jit` when the leaves are traced; `order`: see the module
  docstring (the fetch index is tied to the first array leaf of the carry).
  """
  num = jax.tree.leaves(host_state)[0].shape[0]
  check_prefetch_depth(depth, num)
  if order not in ORDERS:
    raise ValueError(f"order={order!r}: expected one of {ORDERS}")
  fetch = _fetcher(host_state, device_shardings, order)

  def substep(carry, queue, j):
    if not isinstance(j, int) or j + depth < num:
      queue = queue + [fetch(j + depth, jax.tree.leaves(carry)[0])]
    carry = layer_fn(nnx.merge(graphdef, queue[0]), carry, j)
    return carry, queue[1:]

  lead = (num - depth) % (depth + 1)
  groups = (num - depth) // (depth + 1)
  queue = [fetch(j, None) for j in range(depth)]
  for j in range(lead):
    carry, queue = substep(carry, queue, j)

  def body(state, group):
    carry, slots = state
    queue, start = list(slots), lead + group * (depth + 1)
    for k in range(depth + 1):
      carry, queue = substep(carry, queue, start + k)
    return (carry, tuple(queue)), None

  if groups:
    (carry, slots), _ = jax.lax.scan(body, (carry, tuple(queue)),
                                     jnp.arange(groups, dtype=jnp.int32))
    queue = list(slots)
  for j in range(num - depth, num):
    carry, queue = substep(carry, queue, j)
  return carry


def _decoder_step(layer, carry, j, first_layer, cos_btd, sin_btd, pos_bt, meta):
  """The layer function of jaxtier's decoder layers: carry is (hidden state, cache)."""
  x, cache = carry
  return layer(x, cos_btd, sin_btd, cache, jnp.int32(first_layer) + j, pos_bt, meta)


def prefetch_scan_layers(graphdef: nnx.GraphDef, host_state: nnx.State, x_bth, cos_btd, sin_btd,
                         cache, pos_bt, meta, first_layer: int = 0, depth: int = 1, *,
                         device_shardings: Sequence[Any] | None = None, order: str = "auto"):
  """`prefetch_scan` for jaxtier's decoder layers: the contract of `jaxtier.model.scan_layers`.

  Same arguments and results as `scan_layers`, plus `depth`, `device_shardings` and `order` (see
  `prefetch_scan`).
  """
  return prefetch_scan(
      lambda layer, carry, j: _decoder_step(layer, carry, j, first_layer, cos_btd, sin_btd,
                                            pos_bt, meta),
      graphdef, host_state, (x_bth, cache), depth, device_shardings=device_shardings,
      order=order)


class OffloadedStack(nnx.Module):
  """Any stack of layers (one NNX module with a leading [layers] axis on its parameters), kept in
  host memory and run by `prefetch_scan`: `stack(carry, *args)` applies
  `layer_fn(layer, carry, j, *args)` for j = 0..n-1, each layer fetched `depth` ahead.

  Construction copies the parameters into `memory_kind` and fixes where each fetched layer lands.
  """

  def __init__(self, layers: nnx.Module, layer_fn, depth: int,
               memory_kind: str = placement.PINNED_HOST, order: str = "auto"):
    graphdef, state = nnx.split(layers)
    leaves = jax.tree.leaves(state)
    check_prefetch_depth(depth, leaves[0].shape[0])
    if order not in ORDERS:
      raise ValueError(f"order={order!r}: expected one of {ORDERS}")
    placement.check_memory_kind(memory_kind)
    self.device_shardings = tuple(placement.layer_sharding(a.sharding, placement.DEVICE)
                                  for a in leaves)
    self.layers = nnx.merge(graphdef, placement.to_memory_kind(state, memory_kind))
    self.layer_fn, self.depth, self.order = layer_fn, depth, order

  @property
  def num_layers(self) -> int:
    return jax.tree.leaves(nnx.state(self.layers))[0].shape[0]

  def __call__(self, carry, *args):
    graphdef, stacked = nnx.split(self.layers)
    layer_fn = self.layer_fn
    return prefetch_scan(lambda layer, c, j: layer_fn(layer, c, j, *args), graphdef, stacked,
                         carry, self.depth, device_shardings=self.device_shardings,
                         order=self.order)


class OffloadedLayers(OffloadedStack):
  """Layers [first, first + n) of jaxtier's decoder as an `OffloadedStack`: stacked parameters in
  host memory, called like `jaxtier.model.LayerStack`.

  A layer group for `jaxtier.model.GroupedTransformer` (see `tail_group`).
  """

  def __init__(self, layers: DecoderLayer, first: int, depth: int,
               memory_kind: str = placement.PINNED_HOST, order: str = "auto"):
    super().__init__(layers, _decoder_step, depth, memory_kind, order)
    self.first = first

  def __call__(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    return super().__call__((x_bth, cache), self.first, cos_btd, sin_btd, pos_bt, meta)


class UnrolledOffloadedLayers(nnx.Module):
  """Layers [first, first + n) in host memory as separate per-layer buffers (`UnrolledLayers`'
  form: on CPU, fused layers whose kernels the CPU kernels multiply, packed or in GGUF blocks),
  each moved to the device where it computes, called like `jaxtier.model.LayerStack`.

  The CPU kernels' form of an offloaded tail: its layers hold the resident layers' formats (a
  GGUF file's blocks stay blocks), and a per-layer buffer needs no slice of a stack. On CPU, where
  host and device memory kinds are one memory, XLA compiles the move to nothing: the kernels read
  the host buffers in place, so the tail costs what the same layers cost resident. (A GPU or TPU
  runs `OffloadedLayers`, whose stack streams over the link `depth` layers ahead.)
  """

  def __init__(self, layers: Sequence[nnx.Module], first: int):
    self.layers = nnx.List(list(layers))
    self.first = first
    self.device_shardings = tuple(
        tuple(a.sharding.with_memory_kind(placement.DEVICE) for a in jax.tree.leaves(nnx.state(layer)))
        for layer in self.layers)

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def __call__(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    for i, layer in enumerate(self.layers):
      graphdef, state = nnx.split(layer)
      leaves, treedef = jax.tree.flatten(state)
      moved = [jax.device_put(a, s) for a, s in zip(leaves, self.device_shardings[i])]
      x_bth, cache = nnx.merge(graphdef, treedef.unflatten(moved))(
          x_bth, cos_btd, sin_btd, cache, jnp.int32(self.first + i), pos_bt, meta)
    return x_bth, cache


def tail_group(depth: int, memory_kind: str = placement.PINNED_HOST, order: str = "auto"):
  """A group factory for `GroupedTransformer`: `(n, tail_group(d))` offloads those n layers."""

  def make(layers: DecoderLayer, first: int) -> OffloadedLayers:
    return OffloadedLayers(layers, first, depth, memory_kind, order)

  return make


def offload_tail(model: Transformer, num_offloaded: int, depth: int, head: str = "scan",
                 memory_kind: str = placement.PINNED_HOST,
                 order: str = "auto") -> GroupedTransformer:
  """`model` with its last `num_offloaded` layers in `memory_kind`, prefetched `depth` ahead.

  The resident head runs as `head` ("scan" or "unrolled"). The returned model holds copies of the
  parameters; `model` is left as it was.
  """
  total = model.config.num_layers
  check_int("offload_tail_layers", num_offloaded, 0, total)
  groups = [(total - num_offloaded, head)] if num_offloaded < total else []
  if num_offloaded:
    groups.append((num_offloaded, tail_group(depth, memory_kind, order)))
  return GroupedTransformer(model, groups)
