"""Checkpoints quantized before they were downloaded: compressed-tensors, GPTQ and AWQ, read as
stored and kept compact.

`config.json`'s `quantization_config` names the method (`scheme_of`); the tensors themselves say
which projections are quantized and how (bits from the packed shape, group size from the scales',
zero points and `g_idx` by their presence), so a checkpoint whose layers mix schemes reads too.
Each quantized projection is unpacked, per layer, into one canonical form (`Stored`):

    w[k, n] = scale[group(k), n] * (q[k, n] - zero[group(k), n])     (zero absent: 0)

with q integers (or FP8 values), scale float32 (the checkpoint's float16 / bfloat16 scales,
exactly), `group(k)` = k // group or, with act-order, `g_idx[k]`. That form maps exactly onto the
compact layouts the model already multiplies (`jaxtier.model.quant`):

- The CPU kernels' blocks (`TensorSource.quantization`): 4-bit values with groups of a multiple
  of 32 rows as Q4_1 (u = q - lo in 0-15, d = scale, m = scale (lo - zero), float32, per 32 rows);
  8-bit ones as Q8_0 (symmetric) or Q8_16 (with zero points, or groups of 16). d u + m equals
  scale (q - zero) exactly: both products have at most 16 significant bits (an 11-bit float16
  or 8-bit bfloat16 scale times a value of at most 8 bits) and so are exact in float32, and
  their sum, scale (q - zero), fits float32 too, so it rounds to itself.
- The stacked layers' layout (`TensorSource.layout`: scanned, offloaded, portable): the same
  values and float32 scales and minimums in the checkpoint's own group size (a tail of 128-row
  int4 groups moves 0.56 bytes per weight), the rows permuted where act-order groups are not
  runs of rows (`quant.WeightFormat.perm`), FP8 values as float8_e4m3fn with a scale per output
  channel.
- Everything else (`read`): the dequantized float32 weight, scale (q - zero), for paths that hold
  floats (`weight_format="float"`, unrolled layers under tensor parallelism, a mixture of
  experts' experts). FP8 and act-order weights, which the CPU kernels' blocks cannot hold, keep
  the stacked layout in unrolled layers too (`placed.group_formats`).

Formats (each `Stored` from the files by `_unpack_*`):

- compressed-tensors (llm-compressor): "pack-quantized" int4 / int8 weights (`weight_packed`
  int32 [N, K / (32 / bits)], values + 2^(bits - 1) packed low bits first along K;
  `weight_scale` [N, G]; `weight_zero_point` [N / (32 / bits), G] packed along N, or unpacked
  [N, G], where asymmetric; `weight_g_idx` [K] with group act-order; `weight_shape`),
  "int-quantized" / "naive-quantized" (int8 `weight` [N, K]), "float-quantized" (float8_e4m3fn
  `weight` [N, K] with a scale per channel [N, 1] or per tensor [1]). Quantized activations
  (W8A8, FP8_DYNAMIC) load as weight-only: the activations stay in the compute dtype.
- GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` int32 [K / (32 / bits), N] packed low bits first
  along K, `qzeros` int32 [G, N / (32 / bits)] along N (stored zero - 1 in the "gptq" checkpoint
  format, as is in "gptq_v2"), `scales` float16 [G, N], `g_idx` int32 [K]; bits 4 or 8.
- AWQ (AutoAWQ, GEMM): `qweight` int32 [K, N / 8], each word's eight 4-bit values in the order
  0, 2, 4, 6, 1, 3, 5, 7 of its columns, `qzeros` [G, N / 8] likewise, `scales` float16 [G, N].

Refused with a message naming the scheme and the supported ones: other methods (bitsandbytes,
HQQ, ...), sparsity (2:4), FP8 block scales, 2- and 3-bit values, Marlin / GEMV / ExLlama
repackings. A fused projection (Phi-3's qkv_proj, gate_up_proj) splits into its parts by output
columns, each held compact. A mixture of experts' expert projections stack into [layers,
experts, ...] parts of the same layouts (`model.QExperts`), dequantized inside the step that
multiplies them.
"""

import dataclasses
import json
import os
import struct
from typing import Sequence

import ml_dtypes
import numpy as np
from absl import logging

from jaxtier.checkpoint import hf
from jaxtier.checkpoint.params import (HF_FUSED_LAYER_NAMES, Path, fused_row_splits, hf_layer_names,
                                       is_layer_path)
from jaxtier.kernels.cpu import matmul
from jaxtier.model import quant
from jaxtier.model.config import ModelConfig

METHODS = ("compressed-tensors", "gptq", "awq")
SUPPORTED = ("compressed-tensors (pack-quantized int4 / int8 weights, per group or channel, "
             "symmetric or with zero points, group act-order; int-quantized int8 weights; "
             "float-quantized FP8 weights, per channel or tensor; activation quantization "
             "loaded as weight-only), GPTQ (4 or 8 bits, with or without desc_act, formats gptq "
             "and gptq_v2), AWQ (4 bits, GEMM packing)")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# The tensor suffixes each method stores a quantized projection's parts under (a module's
# `<suffix>`; compressed-tensors' int8 and FP8 values keep the name `weight`).
PARTS = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                           "weight_g_idx", "input_scale", "input_zero_point", "k_scale",
                           "v_scale"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
# Activation and KV cache scales: read as weight-only, so not used.
UNUSED_PARTS = frozenset({"input_scale", "input_zero_point", "k_scale", "v_scale"})
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # column j of a word's 8 is in nibble AWQ_ORDER.index(j)
STORED = "stored"  # `quantization`'s answer where no CPU block format holds the weight
_SAFETENSORS_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U8": np.uint8, "U32": np.uint32, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class Scheme:
  """What `config.json`'s `quantization_config` says: `method` (one of METHODS); `packing`
  ("pack-quantized", "int-quantized", "float-quantized" for compressed-tensors; "gptq" or
  "gptq_v2"; "awq"); `bits` of GPTQ and AWQ values (compressed-tensors: per tensor, from
  the shapes); `activations`: the activation quantization loaded as weight-only, described, or
  None; `symmetric`: GPTQ's `sym`."""
  method: str
  packing: str
  bits: int | None = None
  activations: str | None = None
  symmetric: bool = True  # GPTQ's `sym`: 8-bit zero points all the midpoint

  @property
  def name(self) -> str:
    return self.method if self.method == self.packing else f"{self.method} ({self.packing})"


@dataclasses.dataclass(frozen=True)
class Stored:
  """One layer's quantized projection as the canonical form above, in the model's [in, out]
  layout: `q` [K, N] int32 (or float8_e4m3fn values), `scale` [G, N] float32, `zero` [G, N]
  int32 or None, `g_idx` [K] int32 or None (groups are runs of K / G rows), `lo` the least value
  q can take (-2^(bits-1) for signed values, 0 for unsigned ones), `bits`."""
  q: np.ndarray
  scale: np.ndarray
  zero: np.ndarray | None
  g_idx: np.ndarray | None
  lo: int
  bits: int

  @property
  def shape(self) -> tuple[int, int]:
    return self.q.shape

  @property
  def group(self) -> int:
    return self.q.shape[0] // self.scale.shape[0]

  def groups_of_rows(self) -> np.ndarray:
    """The group of each input row [K]."""
    if self.g_idx is not None:
      return self.g_idx
    return np.arange(self.q.shape[0]) // self.group

  def dequantize(self) -> np.ndarray:
    """The float32 weight [K, N]: scale (q - zero) per row's group."""
    rows = self.groups_of_rows()
    q = self.q.astype(np.float32)
    if self.zero is not None:
      q = q - self.zero[rows].astype(np.float32)
    return self.scale[rows] * q

  def permutation(self) -> np.ndarray | None:
    """The rows in group order where groups are not runs of consecutive rows (act-order), so
    that the permuted rows' groups are; None where they already are. ValueError where groups
    are not all K / G rows."""
    if self.g_idx is None:
      return None
    k, g = self.q.shape[0], self.scale.shape[0]
    runs = np.arange(k) // (k // g)
    if np.array_equal(self.g_idx, runs):
      return None
    perm = np.argsort(self.g_idx, kind="stable")
    if not np.array_equal(self.g_idx[perm], runs):
      raise ValueError(f"g_idx assigns groups of unequal sizes (expected {g} groups of "
                       f"{k // g} rows)")
    return perm.astype(np.int32)


def scheme_of(raw: dict, where: str) -> Scheme | None:
  """The scheme of a Hugging Face `config.json` (`raw`), or None where it has no
  `quantization_config`. ValueError naming the scheme and the supported ones where jaxtier cannot
  run it."""
  qc = raw.get("quantization_config")
  if not qc:
    return None
  if not isinstance(qc, dict):
    raise ValueError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
  method = str(qc.get("quant_method", "")).lower()

  def refuse(what: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported; supported: {SUPPORTED}")

  if method == "gptq":
    bits = int(qc.get("bits", 4))
    packing = str(qc.get("checkpoint_format", "gptq")).lower()
    if bits not in (4, 8):
      raise refuse(f"GPTQ with {bits}-bit values")
    if packing not in ("gptq", "gptq_v2"):
      raise refuse(f"GPTQ checkpoint_format {packing!r}")
    if str(qc.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
      raise refuse(f"GPTQ packed in {qc.get('pack_dtype')}")
    return Scheme("gptq", packing, bits, symmetric=bool(qc.get("sym", True)))
  if method == "awq":
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
      raise refuse(f"AWQ version {version!r} (its own packing)")
    if not qc.get("zero_point", True):
      raise refuse("AWQ without zero points (zero_point: false)")
    if bits != 4:
      raise refuse(f"AWQ with {bits}-bit values")
    return Scheme("awq", "awq", bits)
  if method == "compressed-tensors":
    return _compressed_tensors_scheme(qc, refuse)
  raise refuse(f"quantization_config.quant_method {qc.get('quant_method')!r}")


def _compressed_tensors_scheme(qc: dict, refuse) -> Scheme:
  status = qc.get("quantization_status", "compressed")
  if status != "compressed":
    raise refuse(f"compressed-tensors with quantization_status {status!r} (weights not stored "
                 "compressed)")
  if qc.get("transform_config"):
    raise refuse("compressed-tensors with a transform_config (rotated weights)")
  sparsity = qc.get("sparsity_config") or {}
  if sparsity and str(sparsity.get("format", "dense")) != "dense":
    raise refuse(f"compressed-tensors sparsity ({sparsity.get('format')}, "
                 f"{sparsity.get('sparsity_structure', 'unstructured')})")
  groups = qc.get("config_groups") or {}
  if not groups:
    raise refuse("compressed-tensors without config_groups")
  formats, activations = set(), set()
  for name, group in groups.items():
    weights = group.get("weights") or {}
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    strategy = weights.get("strategy", "tensor")
    fmt = group.get("format") or qc.get("format") or (
        "float-quantized" if kind == "float" else "pack-quantized")
    formats.add(fmt)
    if fmt not in CT_FORMATS:
      raise refuse(f"compressed-tensors format {fmt!r} (config group {name})")
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
      raise refuse(f"compressed-tensors {bits}-bit {kind} weights (config group {name})")
    if strategy not in ("tensor", "channel", "group"):
      raise refuse(f"compressed-tensors {kind} weights with strategy {strategy!r} (config group "
                   f"{name})")
    if weights.get("dynamic"):
      raise refuse(f"compressed-tensors dynamic weight quantization (config group {name})")
    act = group.get("input_activations")
    if act:
      activations.add(f"{act.get('type', 'int')}{act.get('num_bits', '')} "
                      f"{'dynamic' if act.get('dynamic') else 'static'} "
                      f"{act.get('strategy', 'tensor')}")
  if qc.get("kv_cache_scheme"):
    activations.add("KV cache scales (the KV cache keeps kv_cache_dtype)")
  packing = sorted(formats)[0] if len(formats) == 1 else "mixed"
  return Scheme("compressed-tensors", packing, None,
                ", ".join(sorted(activations)) or None)


def read_scheme(directory: str) -> Scheme | None:
  """`scheme_of` the directory's config.json (None where there is none or it has no
  quantization_config)."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    try:
      raw = json.load(f)
    except json.JSONDecodeError:
      return None  # `hf.read_config` says what is wrong with it
  return scheme_of(raw, path)


class _Shards:
  """Raw tensors of safetensors shards by name, read from their headers and memory maps (the
  safetensors package's numpy reader has no float8 types)."""

  def __init__(self):
    self._where: dict[str, tuple[str, dict, int]] = {}

  def add(self, shard: str) -> None:
    with open(shard, "rb") as f:
      (size,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(size))
    for name, info in header.items():
      if name != "__metadata__":
        self._where[name] = (shard, info, 8 + size)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._where[name][1]["shape"])

  def dtype(self, name: str) -> str:
    return self._where[name][1]["dtype"]

  def read(self, name: str) -> np.ndarray:
    shard, info, base = self._where[name]
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
      raise ValueError(f"{shard}: tensor {name} has dtype {info['dtype']}, which a quantized "
                       "checkpoint's parts do not use")
    start, stop = info["data_offsets"]
    shape = tuple(info["shape"])
    if stop - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
      raise ValueError(f"{shard}: tensor {name}'s data ({stop - start} bytes) does not fit its "
                       f"shape {shape} and dtype {info['dtype']}")
    if not shape or 0 in shape:
      return np.zeros(shape, dtype)
    return np.array(np.memmap(shard, dtype=dtype, mode="r", offset=base + start, shape=shape))


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
  """int32 words [R, N] holding 32 / bits values each along the rows, low bits first ->
  int32 [R * 32 / bits, N] (GPTQ's `qweight`)."""
  per = 32 // bits
  w = words.astype(np.uint32)
  shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
  out = (w[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
  return out.reshape(words.shape[0] * per, words.shape[1]).astype(np.int32)


def unpack_columns(words: np.ndarray, bits: int, order: np.ndarray | None = None) -> np.ndarray:
  """int32 words [R, C] holding 32 / bits values each along the columns, low bits first ->
  int32 [R, C * 32 / bits]; `order`: the column (of a word's) each successive field holds (AWQ)."""
  per = 32 // bits
  w = words.astype(np.uint32)
  shifts = np.arange(per, dtype=np.uint32) * bits
  fields = (w[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)  # [R, C, per] by field
  if order is not None:
    fields = fields[:, :, np.argsort(order)]  # by column
  return fields.reshape(words.shape[0], words.shape[1] * per).astype(np.int32)


def _scales(a: np.ndarray) -> np.ndarray:
  return np.asarray(a).astype(np.float32)


class PrequantizedSource(hf.HFSource):
  """A Hugging Face directory whose projections are stored quantized (`Scheme`): the model's
  tensors as `HFSource` reads them, its quantized projections in their blocks
  (`quantization`, `read_blocks`), their stacked layout (`layout`) or dequantized (`read`)."""

  def __init__(self, directory: str, config: ModelConfig, scheme: Scheme):
    self.scheme = scheme
    self._shards = _Shards()
    self._modules: dict[str, dict[str, str]] = {}  # module -> {part suffix: stored name}
    # path -> per layer, its module and, for part of a fused one, its output columns
    self._quantized: dict[Path, list[tuple[str, tuple[int, int] | None] | None]] = {}
    self._formats: dict[str, tuple] = {}  # module -> `_describe_module`
    self._kernel_shapes: dict[str, tuple[int, int]] = {}  # module -> (K, N)
    # a mixture of experts' stacks: path -> per layer, each expert's module
    self._experts: dict[Path, list[list[str | None] | None]] = {}
    self._config = config
    for shard in hf.safetensors_files(directory):
      self._shards.add(shard)
    super().__init__(directory, config)
    if scheme.activations:
      logging.warning("%s: activations quantized as %s load as weight-only (the weights as "
                      "stored, activations in the compute dtype)", directory, scheme.activations)

  # -- reading the directory (`HFSource` hooks) --

  def _claim(self, shard: str, stored: str, name: str) -> bool:
    del shard
    module, _, part = name.rpartition(".")
    parts = PARTS[self.scheme.method] if self.scheme.method in PARTS else ()
    if part not in parts:
      return False
    self._modules.setdefault(module, {})[part] = stored
    return True

  def _claimed(self, per_layer: dict[Path, list]) -> None:
    names = hf_layer_names(self._config)
    layers = self._config.num_layers
    for module, parts in self._modules.items():
      if set(parts) <= UNUSED_PARTS:
        continue  # activation or KV cache scales alone: not used (weight-only)
      match = hf._LAYER_RE.match(module + ".weight")
      sub = match.group(2) if match else None
      expert = match and self._config.num_experts and hf._EXPERT_RE.match(sub)
      if expert:  # one expert's projection: its slot of the layer's stack, dequantized on read
        layer, e = int(match.group(1)), int(expert.group(1))
        if layer >= layers or e >= self._config.num_experts:
          raise ValueError(f"{self.where}: tensor {module} is outside the config's {layers} "
                           f"layers of {self._config.num_experts} experts")
        path = hf._EXPERT_PATHS[expert.group(2)]
        slots = per_layer.setdefault(path, [None] * layers)
        if slots[layer] is None:
          slots[layer] = [None] * self._config.num_experts
        slots[layer][e] = module
        self._experts[path] = slots
        k, n = self._kernel_shape(module, parts)
        self._shapes[path] = (layers, self._config.num_experts, k, n)
      elif match and (sub in names or sub in HF_FUSED_LAYER_NAMES):
        layer = int(match.group(1))
        if layer >= layers:
          raise ValueError(f"{self.where}: tensor {module} is for layer {layer}, but the "
                           f"config has {layers} layers")
        k, n = self._kernel_shape(module, parts)
        # a fused projection (Phi-3's qkv_proj, gate_up_proj): each part its output columns
        splits = (zip(HF_FUSED_LAYER_NAMES[sub], fused_row_splits(sub, self._config))
                  if sub in HF_FUSED_LAYER_NAMES else [(names[sub], (0, n))])
        for path, (start, stop) in splits:
          per_layer.setdefault(path, [None] * layers)[layer] = ("quantized", module)
          self._quantized.setdefault(path, [None] * layers)[layer] = (
              module, None if (start, stop) == (0, n) else (start, stop))
          self._shapes[path] = (layers, k, stop - start)
      elif module + ".weight" in hf.HF_GLOBAL_NAMES:
        path = hf.HF_GLOBAL_NAMES[module + ".weight"]
        k, n = self._kernel_shape(module, parts)
        self._names[path] = ("quantized", module)
        self._quantized[path] = [(module, None)]
        self._shapes[path] = (n, k)
      else:
        raise ValueError(f"{self.where}: unexpected quantized tensor {module} for a "
                         f"{self._config.architecture} model")

  def _part(self, module: str, part: str) -> str | None:
    if part == "weight":
      return module + ".weight" if module + ".weight" in self._shards._where else None
    return self._modules.get(module, {}).get(part)

  def _kernel_shape(self, module: str, parts: dict) -> tuple[int, int]:
    """(K, N) of a quantized projection, from its parts' shapes (and `weight_shape`)."""
    if module not in self._kernel_shapes:
      self._kernel_shapes[module] = self._shape_of(module, parts)
    return self._kernel_shapes[module]

  def _shape_of(self, module: str, parts: dict) -> tuple[int, int]:
    s = self._shards
    if self.scheme.method == "compressed-tensors":
      if "weight_packed" in parts:
        n, packed = s.shape(parts["weight_packed"])
        if "weight_shape" not in parts:
          raise ValueError(f"{self.where}: {module} is pack-quantized without a weight_shape")
        shape = tuple(int(v) for v in s.read(parts["weight_shape"]).reshape(-1))
        return shape[1], shape[0]
      n, k = s.shape(module + ".weight")
      return k, n
    if self.scheme.method == "gptq":
      rows, n = s.shape(parts["qweight"])
      return rows * 32 // self.scheme.bits, n
    k, cols = s.shape(parts["qweight"])  # awq
    return k, cols * 8

  def _slot(self, slot) -> np.ndarray:
    if isinstance(slot, list) and any(isinstance(part, str) for part in slot):
      missing = [j for j, part in enumerate(slot) if part is None]
      if missing:
        raise ValueError(f"{self.where}: experts {missing[:8]} of a layer have no tensor")
      return np.stack([self.unpack(module).dequantize() for module in slot])
    return super()._slot(slot)

  # -- the canonical form --

  def stored(self, path: Path, layer: int) -> Stored:
    """Layer `layer`'s projection at `path` unpacked (`Stored`)."""
    module, columns = self._quantized[path][layer if is_layer_path(path) else 0]
    st = self.unpack(module)
    if columns is None:
      return st
    cut = slice(*columns)  # a fused projection's part: its output columns
    return dataclasses.replace(st, q=st.q[:, cut], scale=st.scale[:, cut],
                               zero=None if st.zero is None else st.zero[:, cut])

  def unpack(self, module: str) -> Stored:
    """The quantized module `module` (its checkpoint name) unpacked (`Stored`)."""
    parts = self._modules.get(module, {})
    unpack = {"compressed-tensors": self._unpack_ct, "gptq": self._unpack_gptq,
              "awq": self._unpack_awq}[self.scheme.method]
    return unpack(module, parts)

  def _unpack_gptq(self, module: str, parts: dict) -> Stored:
    s, bits = self._shards, self.scheme.bits
    q = unpack_rows(s.read(parts["qweight"]), bits)
    scale = _scales(s.read(parts["scales"]))
    zero = unpack_columns(s.read(parts["qzeros"]), bits)[:, :q.shape[1]]
    if self.scheme.packing == "gptq":
      # the "gptq" checkpoint format stores each zero point minus one (AutoGPTQ's packing); the
      # unpacking adds it back within the field (GPTQModel's), so a zero of 0, stored as all
      # ones, reads back as 0
      zero = (zero + 1) & ((1 << bits) - 1)
    g_idx = s.read(parts["g_idx"]).astype(np.int32) if "g_idx" in parts else None
    return Stored(q, scale, zero, g_idx, 0, bits)

  def _unpack_awq(self, module: str, parts: dict) -> Stored:
    s = self._shards
    q = unpack_columns(s.read(parts["qweight"]), 4, AWQ_ORDER)
    scale = _scales(s.read(parts["scales"]))
    zero = (unpack_columns(s.read(parts["qzeros"]), 4, AWQ_ORDER) if "qzeros" in parts
            else None)
    return Stored(q, scale, zero, None, 0, 4)

  def _unpack_ct(self, module: str, parts: dict) -> Stored:
    s = self._shards
    scale = _scales(s.read(parts["weight_scale"]))
    g_idx = (s.read(parts["weight_g_idx"]).astype(np.int32) if "weight_g_idx" in parts
             else None)
    if "weight_packed" in parts:
      k, n = self._kernel_shape(module, parts)
      words = s.read(parts["weight_packed"])  # [N, K / per]
      bits = 32 * words.shape[1] // k
      if bits not in (4, 8) or words.shape[1] * (32 // bits) != k:
        raise ValueError(f"{self.where}: {module}.weight_packed {words.shape} does not pack a "
                         f"[{n}, {k}] weight in 4 or 8 bits")
      lo = -(1 << (bits - 1))
      q = unpack_columns(words, bits).T + lo  # [K, N], signed
    else:
      values = s.read(module + ".weight")  # [N, K] int8 or float8_e4m3fn
      q = values.T.astype(np.int32) if values.dtype == np.int8 else values.T
      bits, lo = 8, (-128 if values.dtype == np.int8 else 0)
      n = values.shape[0]
    if scale.ndim < 2 or scale.size == 1:  # one scale for the tensor
      scale = np.full((n, 1), scale.reshape(-1)[0], np.float32)
    scale = np.ascontiguousarray(scale.T)  # [G, N]
    zero = None
    if "weight_zero_point" in parts:
      z = s.read(parts["weight_zero_point"])
      if z.dtype == np.int32 and z.shape[0] != n:  # packed along N, as the values are
        z = unpack_columns(np.ascontiguousarray(z.T), bits).T[:n] + lo
      zero = np.ascontiguousarray(z.astype(np.int32).reshape(n, -1).T)
      if zero.shape != scale.shape:
        raise ValueError(f"{self.where}: {module}'s zero points {zero.shape[::-1]} do not "
                         f"match its scales {scale.shape[::-1]}")
    return Stored(q, scale, zero, g_idx, lo, bits)

  # -- `TensorSource` --

  def read(self, path: Path, layers: Sequence[int] | None = None) -> np.ndarray:
    if path not in self._quantized:
      return super().read(path, layers)
    if not is_layer_path(path):
      return self.stored(path, 0).dequantize().T  # [vocab, hidden], as the table is stored
    layers = range(self._config.num_layers) if layers is None else layers
    return np.stack([self.stored(path, i).dequantize() for i in layers])

  def _describe(self, path: Path, layer: int) -> tuple:
    """`_describe_module` of a layer's projection (of an expert stack: its experts', which
    must agree)."""
    if path in self._experts:
      described = {self._describe_module(m) for m in self._experts[path][layer]}
      if len(described) > 1:
        raise ValueError(f"{self.where}: the experts of layer {layer}'s {'/'.join(path)} are "
                         "quantized in different schemes; a stack holds one")
      return described.pop()
    return self._describe_module(self._quantized[path][layer][0])

  def _describe_module(self, module: str) -> tuple:
    """(kind "int" / "fp8", bits, group rows (None: one group), zero points, act-order) of a
    quantized module, from its parts' headers (and its `g_idx`): nothing else is read, so a
    plan of a large checkpoint reads no weights."""
    key = module
    if key in self._formats:
      return self._formats[key]
    parts, s, scheme = self._modules.get(module, {}), self._shards, self.scheme
    k, _ = self._kernel_shape(module, parts)
    if scheme.method == "compressed-tensors":
      if "weight_packed" in parts:
        kind, bits = "int", 32 * s.shape(parts["weight_packed"])[1] // k
      else:
        kind = "fp8" if s.dtype(module + ".weight") == "F8_E4M3" else "int"
        bits = 8
      scale = s.shape(parts["weight_scale"])
      groups = scale[-1] if len(scale) == 2 else 1
      zeros, g_idx = "weight_zero_point" in parts, parts.get("weight_g_idx")
    else:
      kind, bits = "int", scheme.bits
      groups = s.shape(parts["scales"])[0]
      zeros = scheme.method == "awq" or not scheme.symmetric
      g_idx = parts.get("g_idx")
    perm = False
    if g_idx is not None:
      rows = s.read(g_idx).astype(np.int32)
      perm = not np.array_equal(rows, np.arange(k) // (k // groups))
    self._formats[key] = (kind, bits, None if groups == 1 else k // groups, zeros, perm)
    return self._formats[key]

  def quantization(self, path: Path, layer: int | None = None) -> str | None:
    if path in self._experts:
      return STORED  # an expert stack: its layout only (experts are never packed for CPU)
    if path not in self._quantized or not is_layer_path(path):
      return None
    layers = range(self._config.num_layers) if layer is None else [layer]
    kinds = {self._block_kind(*self._describe(path, i)) for i in layers}
    return kinds.pop() if len(kinds) == 1 else STORED

  @staticmethod
  def _block_kind(kind: str, bits: int, group: int | None, zeros: bool, perm: bool) -> str:
    """The CPU block format that holds such a weight exactly, or STORED."""
    if kind != "int" or perm:
      return STORED
    rows = group or matmul.QUANT_BLOCK  # one group: any block size
    if bits == 4 and rows % matmul.QUANT_BLOCK == 0:
      return "q4_1"
    if bits == 8 and rows % matmul.QUANT_BLOCK == 0 and not zeros:
      return "q8_0"
    if rows % matmul.HALF_BLOCK == 0:
      return "q8_16"
    return STORED

  def layout(self, path: Path) -> quant.WeightFormat | None:
    if path not in self._quantized and path not in self._experts or not is_layer_path(path):
      return None
    described = [self._describe(path, i) for i in range(self._config.num_layers)]
    if len({d[:3] for d in described}) > 1:
      raise ValueError(f"{self.where}: the layers of {'/'.join(path)} are quantized in "
                       "different schemes; a stack holds one")
    kind, bits, group = described[0][:3]
    zeros, perm = any(d[3] for d in described), any(d[4] for d in described)
    if kind == "fp8":
      return quant.WeightFormat("float8_e4m3fn", None, False, "float32", perm)
    mins = bits == 4 or zeros  # 4-bit values are held unsigned: a minimum per group
    return quant.WeightFormat("uint4" if bits == 4 else "int8", group, mins, "float32", perm)

  def read_blocks(self, path: Path, layers: Sequence[int] | None = None, fmt: str | None = None
                  ) -> tuple[np.ndarray, ...]:
    layers = list(range(self._config.num_layers) if layers is None else layers)
    if path in self._experts:  # [layers, experts, ...] in the stack's layout
      layout = self.layout(path)
      per_layer = [tuple(np.stack(parts) for parts in zip(
          *(self._in_layout(self.unpack(m), layout) for m in self._experts[path][i])))
                   for i in layers]
      return tuple(np.stack(parts) for parts in zip(*per_layer))
    if path not in self._quantized or not is_layer_path(path):
      return super().read_blocks(path, layers, fmt)
    fmt = fmt or self.quantization(path)
    if fmt in matmul.BLOCK_FORMATS:
      per_layer = [self._blocks(self.stored(path, i), fmt) for i in layers]
    else:
      layout = self.layout(path)
      per_layer = [self._in_layout(self.stored(path, i), layout) for i in layers]
    return tuple(np.stack(parts) for parts in zip(*per_layer))

  def _blocks(self, st: Stored, fmt: str) -> tuple[np.ndarray, ...]:
    """`st` as the CPU kernels' blocks `fmt` (q, d[, m]), d and m per 32 rows (Q8_16: 16)."""
    if st.permutation() is not None or st.q.dtype == ml_dtypes.float8_e4m3fn:
      raise ValueError(f"{self.where}: act-order and FP8 weights have no {fmt} blocks")
    rows = matmul.HALF_BLOCK if fmt == "q8_16" else matmul.QUANT_BLOCK
    d, m, v = self._split(st, "uint4" if fmt == "q4_1" else "int8")
    every = lambda a: np.repeat(a, st.group // rows, axis=0)
    if fmt == "q8_0":
      if np.any(m):
        raise ValueError(f"{self.where}: a weight with zero points has no q8_0 blocks")
      return v, every(d)
    return v, every(d), every(m)

  def _split(self, st: Stored, values: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale [G, N], minimum [G, N], values [K, N]) with w = scale v + minimum per group: v the
    values held unsigned (uint8, 0-15) for "uint4", signed (int8) for "int8"."""
    offset = st.lo if values == "uint4" else (st.lo + 128 if st.bits == 8 else 0)
    v = st.q - offset  # uint4: q - lo in [0, 16); int8: 8-bit values in [-128, 128)
    zero = st.zero if st.zero is not None else np.zeros((1, 1), np.int32)
    # w = scale (q - zero) = scale v + scale (offset - zero), each product exact in float32
    m = st.scale * (offset - zero).astype(np.float32)
    m = np.broadcast_to(m, st.scale.shape)
    return st.scale, np.ascontiguousarray(m, np.float32), v.astype(
        np.uint8 if values == "uint4" else np.int8)

  def _in_layout(self, st: Stored, fmt: quant.WeightFormat) -> tuple[np.ndarray, ...]:
    """`st` as `fmt`'s parts (values, scales[, mins][, perm]), rows in group order."""
    perm = st.permutation()
    if fmt.values == "float8_e4m3fn":
      out = (st.q, st.scale)
    else:
      scale, m, v = self._split(st, "uint4" if fmt.values in ("uint4", "u4x2") else "int8")
      if not fmt.mins and np.any(m):
        raise ValueError(f"{self.where}: a weight said to be symmetric has zero points other "
                         "than the midpoint")
      out = (v, scale) + ((m,) if fmt.mins else ())
    if perm is not None:
      out = (out[0][perm],) + out[1:]
    if fmt.perm:
      out += (np.arange(st.q.shape[0], dtype=np.int32) if perm is None else perm,)
    return out
