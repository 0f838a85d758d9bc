"""What an exported program asks the device to move: memory-kind transfers in StableHLO, counted.

On CPU a transfer between memory kinds lowers to nothing, so a prefetch schedule is checked on the
program exported for the target platform (`jax.export` with `platforms=["cuda"]`). `placement_report(text)` walks that
module (through calls and `while` loops) and tracks where each value comes from:

- every `annotate_device_placement` custom call is a `Transfer`: its bytes, the trip counts of the
  loops around it, the host-kind arguments it reads from, and how far ahead of its first use it is
  issued ("layers_ahead": how many uses of other transfers from the same host argument happen in
  between, following the value through the loop carry into later iterations); one that places a
  value where it already is moves nothing and is no `Transfer` (jit's annotation of a result that
  the device computed or `device_put` placed on it; a transfer's result placed there again);
- host computation placed on purpose (`jax.experimental.compute_on.compute_on("device_host")`:
  ops whose frontend attributes say `_xla_compute_type = "host"`, and every op of a function a
  `func.call` so marked reaches) is reported in `host_offload_compute`: each op other than data
  movement (`MOVES`), a constant, a transfer, a call or control flow (whose bodies' ops count one
  by one); what it produces is host memory (a transfer of it to the device is host to device);
- any other op that reads a host-kind value, slicing, reshaping, a bitcast and a sharding
  constraint aside, is reported in `host_compute` (the device would compute on host memory: by
  accident); a `dynamic_update_slice` into a host-kind value is one (it reads the value it
  updates).

A loop whose trip count is not a constant (a `fori_loop` up to an argument) has trip count None:
its transfers' bytes per call need the trip count from the caller (`transfer_bytes`).

`custom_call_targets(text)` counts every custom call of a module by target, which `cpu_only`
and `is_kernel` sort into calls only a CPU can run (jaxtier's C++ kernels, LAPACK, ...) and
hand-written kernels (Pallas' Triton and Mosaic calls).
"""

import collections
import dataclasses
import math
import re
from typing import Callable

import jax

# The MLIR context with JAX's dialects registered (stablehlo, sdy, func); no public entry exists.
from jax._src.interpreters.mlir import make_ir_context
from jax._src.lib.mlir import ir

from jaxtier.kernels.cpu import library as cpu_kernels

MOVES = frozenset({"stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.reshape",
                   "stablehlo.bitcast_convert", "sdy.sharding_constraint"})
# Custom-call targets only a CPU runs: jaxtier's C++ kernels (`jaxtier.kernels.cpu.library`) and the
# CPU builds of jaxlib's LAPACK, FFT (DUCC) and host callbacks.
CPU_ONLY_PREFIXES = ("jaxtier_", "lapack_", "ducc_", "xla_python_cpu_callback",
                     "xla_ffi_python_cpu_callback")
# Custom-call targets of hand-written kernels: Pallas on GPU (Triton, Mosaic GPU) and TPU (Mosaic).
KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "mosaic_gpu_v2",
                  "tpu_custom_call")
TERMINATORS = frozenset({"stablehlo.return", "func.return"})
BRANCHES = frozenset({"stablehlo.case", "stablehlo.if"})
HOST = frozenset({("h", -1)})  # the tags of a value in host memory that no host argument moved to


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One `annotate_device_placement` in the program."""
  destination: str  # "device", "pinned_host", ...
  shape: tuple[int, ...]
  nbytes: int
  loops: tuple[int, ...]  # trip counts of the enclosing while loops, outermost first
  sources: tuple[int, ...]  # indices of the host-kind main arguments it reads from
  layers_ahead: int | None = None  # inside a loop: uses of the same source between issue and use

  @property
  def bytes_per_call(self) -> int:
    return self.bytes_assuming(None)

  def bytes_assuming(self, unknown_trips: int | None) -> int:
    """Bytes per call, a loop of unknown trip count running `unknown_trips` times (None: such a
    loop is a ValueError)."""
    if None in self.loops and unknown_trips is None:
      raise ValueError(f"a transfer of {self.nbytes} bytes sits in a loop of unknown trip count "
                       f"(loops {self.loops}): give the trip count")
    return self.nbytes * math.prod(unknown_trips if n is None else n for n in self.loops)


@dataclasses.dataclass(frozen=True)
class PlacementReport:
  transfers: tuple[Transfer, ...]
  host_compute: tuple[str, ...]  # "op : type" of ops that read host-kind operands by accident
  host_arguments: dict[int, int]  # main argument index -> bytes, for host-kind arguments
  # main argument index -> how many shards a device holds one of (1: unsharded), host-kind only
  host_argument_shards: dict[int, int] = dataclasses.field(default_factory=dict)
  # "op : type" of ops placed on the host on purpose (`compute_on("device_host")`)
  host_offload_compute: tuple[str, ...] = ()

  def to_device(self, in_loop: bool | None = None) -> tuple[Transfer, ...]:
    """Transfers to device memory; `in_loop` True/False keeps those inside/outside loops."""
    return tuple(t for t in self.transfers if t.destination == "device"
                 and (in_loop is None or bool(t.loops) == in_loop))

  def to_device_bytes_per_call(self) -> int:
    return sum(t.bytes_per_call for t in self.to_device())

  def transfer_bytes(self, to_device: bool, unknown_trips: int | None = None) -> int:
    """Bytes one call moves to the device (`to_device`) or from it to a host memory kind, loops
    of unknown trip count running `unknown_trips` times (see `Transfer.bytes_assuming`)."""
    return sum(t.bytes_assuming(unknown_trips) for t in self.transfers
               if (t.destination == "device") == to_device)

  def to_device_bytes_per_device(self) -> int:
    """Bytes one device receives per call: each transfer slices one host argument along its
    unsharded layer axis, so a device moves 1 / shards of it (its own shard)."""
    return sum(t.bytes_per_call // self.host_argument_shards.get(t.sources[0], 1)
               for t in self.to_device())


def exported_text(fn: Callable, *args, platform: str = "cuda") -> str:
  """StableHLO text of `fn` (a jitted function) exported for `platform`; args may be abstract.
  Traced with every platform's branch of the CPU kernels (`traced_for_every_platform`)."""
  with cpu_kernels.traced_for_every_platform():
    return jax.export.export(fn, platforms=[platform])(*args).mlir_module()


def _nbytes(value) -> tuple[tuple[int, ...], int]:
  t = ir.RankedTensorType(value.type)
  # the width: the type name's first number (f32, bf16, ui4, i1; f8E4M3FN, the float8 types)
  bits = int(re.search(r"(\d+)", str(t.element_type)).group(1))
  if bits == 4:  # 4-bit types as XLA holds them on accelerators: two values a byte
    return tuple(t.shape), -(-math.prod(t.shape) // 2)
  return tuple(t.shape), math.prod(t.shape) * max(bits // 8, 1)


def _string_attr(op, name: str, key: str | None = None) -> str | None:
  if name not in op.attributes:
    return None
  attr = op.attributes[name]
  if key is not None:
    attr = ir.DictAttr(attr)
    if key not in attr:
      return None
    attr = attr[key]
  return ir.StringAttr(attr).value


def _constant(value) -> int | None:
  owner = value.owner
  if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.constant":
    return None
  return ir.DenseIntElementsAttr(owner.attributes["value"]).get_splat_value().value


def _trip_count(while_op) -> int | None:
  """Trip count of a counted loop `while (i < limit)` with constant start and limit, else None."""
  for op in while_op.regions[0].blocks[0].operations:
    if op.operation.name == "stablehlo.compare" and isinstance(op.operands[0].owner, ir.Block):
      slot = ir.BlockArgument(op.operands[0]).arg_number
      start, limit = _constant(while_op.operands[slot]), _constant(op.operands[1])
      if start is not None and limit is not None:
        return limit - start
  return None


class _Walker:
  """Abstract interpretation: each value maps to a frozenset of tags.

  ("h", arg): derived from host-kind main argument `arg` by data movement only (("h", -1): in
  host memory otherwise: moved there by a transfer, or computed there on purpose); ("x", id): the
  result of transfer `id`; ("c", loop, slot): carry slot `slot` of the loop being walked. While
  `on_host`, the ops walked run on the host on purpose (`compute_on("device_host")`).
  """

  def __init__(self, module):
    self.module = module  # owns the ops below
    self.funcs = {_string_attr(op, "sym_name"): op for op in module.body.operations
                  if op.operation.name == "func.func"}
    self.transfers: list[dict] = []
    self.host_compute: list[str] = []
    self.host_offload_compute: list[str] = []
    self.on_host = False
    self.used: set = set()
    self.events: list[tuple] = []  # ("issue", id) and ("use", tag), in program order
    self.loops: list[int | None] = []
    self.shards: dict[int, int] = {}
    self.mesh_axes = {name: int(size) for name, size in
                      re.findall(r'"(\w+)"=(\d+)', " ".join(
                          str(op) for op in module.body.operations
                          if op.operation.name == "sdy.mesh"))}

  def run_main(self) -> dict[int, int]:
    """Walks @main; returns {index: bytes} of its host-kind arguments."""
    main = self.funcs["main"]
    # a module whose arguments carry no attributes (no sharding or memory kind) has none at all
    arg_attrs = (ir.ArrayAttr(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes
                 else None)
    block = main.regions[0].blocks[0]
    tags, host = [], {}
    for i, arg in enumerate(block.arguments):
      attrs = ir.DictAttr(arg_attrs[i]) if arg_attrs is not None else ir.DictAttr.get({})
      if "mhlo.memory_kind" in attrs and ir.StringAttr(attrs["mhlo.memory_kind"]).value != "device":
        host[i] = _nbytes(arg)[1]
        if "sdy.sharding" in attrs:
          self.shards[i] = _shard_count(str(attrs["sdy.sharding"]), self.mesh_axes)
      tags.append(frozenset({("h", i)}) if i in host else frozenset())
    self.walk_block(block, tags, {})
    return host

  def walk_block(self, block, arg_tags, env) -> list[frozenset]:
    for arg, tags in zip(block.arguments, arg_tags):
      env[arg] = tags
    for op in block.operations:
      ins = [env.get(v, frozenset()) for v in op.operands]
      if op.operation.name in TERMINATORS:
        return ins
      outs = self.walk_op(op, ins, env)
      for value, tags in zip(op.results, outs):
        env[value] = tags
    return []

  def walk_op(self, op, ins, env) -> list[frozenset]:
    name = op.operation.name
    if not self.on_host and \
        _string_attr(op, "mhlo.frontend_attributes", "_xla_compute_type") == "host":
      self.on_host = True  # the op, and the ops of what it calls or encloses, run on the host
      try:
        return self.walk_op(op, ins, env)
      finally:
        self.on_host = False
    if name == "func.call":
      callee = self.funcs[ir.FlatSymbolRefAttr(op.attributes["callee"]).value]
      return self.walk_block(callee.regions[0].blocks[0], ins, {})
    if name == "stablehlo.custom_call" and \
        _string_attr(op, "call_target_name") == "annotate_device_placement":
      return [self.transfer(op, ins[0])]
    if name == "stablehlo.while":
      return self.walk_while(op, ins, env)
    if name in BRANCHES:
      outs = [self.walk_block(r.blocks[0], [], env) for r in op.regions]
      return [frozenset().union(*col) for col in zip(*outs)]
    if name == "stablehlo.optimization_barrier":
      return ins
    if name in MOVES:  # the data operand's tags pass through; index operands are not data
      return [ins[0] | HOST] if self.on_host else ins[:1]
    if name != "stablehlo.constant" or not self.on_host:
      self.use(op, ins)
    return [HOST if self.on_host else frozenset()] * len(op.results)

  def use(self, op, ins):
    """Records an op computing on `ins`: host computation (on purpose while `on_host`, else by
    accident where it reads a host-kind value) and the first use of each transfer it reads."""
    tags = frozenset().union(*ins) if ins else frozenset()
    described = f"{op.operation.name} : {[str(r.type) for r in op.results]}"
    if self.on_host:
      self.host_offload_compute.append(described)
    elif any(t[0] == "h" for t in tags):
      self.host_compute.append(described)
    for tag in sorted(t for t in tags if t[0] != "h" and t not in self.used):
      self.used.add(tag)
      self.events.append(("use", tag))

  def transfer(self, op, tags) -> frozenset:
    shape, nbytes = _nbytes(op.operands[0])
    destination = _string_attr(op, "mhlo.frontend_attributes", "_xla_buffer_placement")
    if self._placed_in(tags, destination):
      return tags
    index = len(self.transfers)
    self.transfers.append(dict(destination=destination, shape=shape, nbytes=nbytes,
                               loops=tuple(self.loops),
                               sources=tuple(sorted(t[1] for t in tags if t[0] == "h"))))
    self.events.append(("issue", index))
    return frozenset({("x", index)}) | (frozenset() if destination == "device" else HOST)

  def _placed_in(self, tags, destination) -> bool:
    """Whether a value of `tags` already lies in `destination`: for the device, one of no host
    kind (a device argument, a computation's result, or moved from transfers to the device only);
    for a host kind, one moved from results of transfers there only. A loop's carry may be
    either."""
    moved = [t for t in tags if t[0] == "x"]
    if any(t[0] == "c" or t[0] == "x" and self.transfers[t[1]]["destination"] != destination
           for t in tags):
      return False
    if destination == "device":
      return not any(t[0] == "h" for t in tags)
    return bool(moved)

  def walk_while(self, op, ins, env) -> list[frozenset]:
    loop = id(op)
    self.loops.append(_trip_count(op))
    self.walk_block(op.regions[0].blocks[0], ins, env)
    start = len(self.events)
    body_tags = [frozenset(t for t in tags if t[0] == "h") | {("c", loop, i)}
                 for i, tags in enumerate(ins)]
    returned = self.walk_block(op.regions[1].blocks[0], body_tags, env)
    self.loops.pop()
    self.measure_leads(loop, self.events[start:], returned)
    return [(tags | back) - {("c", loop, i) for i in range(len(ins))}
            for tags, back in zip(ins, returned)]

  def measure_leads(self, loop, events, returned):
    """Sets layers_ahead of the transfers issued in this loop body."""
    slot_of = lambda tag: {i for i, tags in enumerate(returned) if tag in tags}
    for pos, (kind, index) in enumerate(events):
      if kind != "issue":
        continue
      source = self.transfers[index]["sources"]
      same = [p for p, e in enumerate(events)
              if e[0] == "use" and self._source(loop, e[1], returned) == source]
      tag, iterations = ("x", index), 0
      while not any(events[p][1] == tag for p in same) and iterations <= len(returned):
        slots = slot_of(tag)
        if not slots:
          break
        tag, iterations = ("c", loop, min(slots)), iterations + 1
      use = [p for p in same if events[p][1] == tag]
      if not use:
        continue
      if iterations == 0:
        ahead = sum(pos < p < use[0] for p in same)
      else:
        ahead = (sum(p > pos for p in same) + (iterations - 1) * len(same)
                 + sum(p < use[0] for p in same))
      self.transfers[index]["layers_ahead"] = ahead

  def _source(self, loop, tag, returned, depth=0):
    """The host arguments behind a transfer tag, or behind what this loop's carry slot receives."""
    if tag[0] == "x":
      return self.transfers[tag[1]]["sources"]
    if tag[0] == "c" and tag[1] == loop and depth <= len(returned):
      for inner in returned[tag[2]]:
        if inner[0] in "xc" and inner != tag:
          return self._source(loop, inner, returned, depth + 1)
    return None


def _shard_count(sharding: str, mesh_axes: dict[str, int]) -> int:
  """Shards of an `#sdy.sharding<@mesh, [{}, {"tp"}, ...]>`: the product of the sizes of the mesh
  axes its dimensions name."""
  dims = sharding[sharding.index("[") + 1:sharding.rindex("]")]
  return math.prod(mesh_axes.get(name, 1) for name in re.findall(r'"(\w+)"', dims))


def custom_call_targets(mlir_text: str) -> collections.Counter:
  """{target: count} of every custom call in the module (in every function, loop and branch),
  the placement annotations included."""
  counts = collections.Counter()

  def walk(operation):
    for region in operation.regions:
      for block in region.blocks:
        for op in block.operations:
          if op.operation.name == "stablehlo.custom_call":
            counts[_string_attr(op, "call_target_name")] += 1
          walk(op.operation)

  with make_ir_context():
    walk(ir.Module.parse(mlir_text).operation)
  return counts


def narrow_convert_users(mlir_text: str, element_types=("ui4", "i4", "i8", "ui8")
                         ) -> collections.Counter:
  """{op name: count} of the ops that read each `stablehlo.convert` of a tensor of
  `element_types` to a float type, followed through reshapes (in every function, loop and
  branch): where compact weights are dequantized, a "multiply" or "dot_general" (fusable into the
  dot), and never a parameter passing of the float weight whole ("call", "return")."""
  counts = collections.Counter()

  def users(value):
    for use in value.uses:
      owner = use.owner
      name = owner.name if hasattr(owner, "name") else owner.operation.name
      if name == "stablehlo.reshape":
        yield from users(owner.results[0])
      else:
        yield name

  def walk(operation):
    for region in operation.regions:
      for block in region.blocks:
        for op in block.operations:
          if op.operation.name == "stablehlo.convert":
            source = str(ir.RankedTensorType(op.operands[0].type).element_type)
            target = str(ir.RankedTensorType(op.results[0].type).element_type)
            if source in element_types and target.startswith(("f", "bf")):
              counts.update(users(op.results[0]))
          walk(op.operation)

  with make_ir_context():
    walk(ir.Module.parse(mlir_text).operation)
  return counts


def cpu_only(target: str) -> bool:
  """Whether a custom-call target runs on a CPU only (`CPU_ONLY_PREFIXES`)."""
  return target.startswith(CPU_ONLY_PREFIXES)


def is_kernel(target: str) -> bool:
  """Whether a custom-call target is a hand-written kernel (Pallas: `KERNEL_TARGETS`)."""
  return target in KERNEL_TARGETS


def placement_report(mlir_text: str) -> PlacementReport:
  """Counts the memory-kind transfers of an exported module (see the module docstring)."""
  with make_ir_context():
    walker = _Walker(ir.Module.parse(mlir_text))
    host = walker.run_main()
  return PlacementReport(tuple(Transfer(**t) for t in walker.transfers),
                         tuple(walker.host_compute), host, walker.shards,
                         tuple(walker.host_offload_compute))
