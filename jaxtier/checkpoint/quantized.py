"""A float checkpoint read as a quantized one: the `quantization` engine argument at load time.

`QuantizedSource` wraps any `TensorSource` of float tensors (Hugging Face safetensors, Orbax, a
GGUF file of float types) and presents every decoder projection's kernel (and the LM head's
table, which the CPU kernels then keep in int8 blocks) as stored in blocks of one format, which
the placement-first loader then keeps as it keeps a GGUF file's blocks: each tensor is read as
floats, quantized on the host (numpy) and placed, one tensor (one layer group's share) at a time,
so the float model never exists whole anywhere.

The format depends on who multiplies: the CPU kernels (`kernels="auto"` on a CPU) take 32-row
blocks, so int8 is GGUF's Q8_0 (a float16 scale per 32 rows) and int4 is Q4_1 (a float16 scale
and minimum per 32 rows; `quantization_group_size` must be 32 there); the portable path
(`jaxtier.model.quant`) holds int8 with one scale per output channel, int4 with a scale and
minimum per `quantization_group_size` rows and fp8 as float8_e4m3fn values with a scale per output
channel (`quant.quantize_fp8`; the CPU kernels have no FP8 blocks). Norms, biases, the router and mixture-of-experts tensors
stay float.
"""

from typing import Sequence

import numpy as np

from jaxtier.checkpoint.params import Path, TensorSource, is_layer_path
from jaxtier.common.choices import QUANTIZATIONS, check_quantization
from jaxtier.kernels.cpu import matmul
from jaxtier.model import quant

# On the CPU kernels' path, the block format each quantization is held in.
CPU_BLOCKS = {"int8": "q8_0", "int4": "q4_1"}


def block_format(quantization: str, portable: bool) -> str:
  """The name `QuantizedSource.quantization` answers for a projection: a CPU block format
  ("q8_0", "q4_1") or, portable, the quantization itself ("int8", "int4")."""
  check_quantization(quantization, optional=False)
  if not portable and quantization not in CPU_BLOCKS:
    raise ValueError(f"quantization={quantization!r}: the CPU kernels have no such blocks; it "
                     "runs on the portable path (kernels='portable')")
  return quantization if portable else CPU_BLOCKS[quantization]


def layout_of(name: str, group_size: int = 32) -> quant.WeightFormat:
  """The stacked layers' layout (`jaxtier.model.quant`) of a block format or quantization name."""
  if name in quant.BLOCK_LAYOUTS:
    return quant.BLOCK_LAYOUTS[name]
  return quant.quantized_format(name, group_size)


class QuantizedSource(TensorSource):
  """`source`'s tensors, the projections' kernels (and the head's table where `head`) held in
  `fmt` ("q8_0" / "q4_1": CPU blocks of 32 rows; "int8" / "int4": `jaxtier.model.quant` layouts with
  `group_size` rows per int4 scale)."""

  def __init__(self, source: TensorSource, fmt: str, group_size: int = 32, head: bool = True,
               config=None):
    """`config` (a `ModelConfig`), where given, is checked: a mixture of experts is refused
    (its experts are not quantized yet)."""
    super().__init__(source.where)
    if config is not None and config.num_experts:
      raise ValueError(f"quantization={fmt!r}: mixture-of-experts models ({config.architecture}) "
                       "are not quantized yet; load them without quantization")
    if fmt not in matmul.BLOCK_FORMATS and fmt not in QUANTIZATIONS:
      raise ValueError(f"format {fmt!r}: expected one of {matmul.BLOCK_FORMATS} or "
                       f"{QUANTIZATIONS}")
    if fmt == "q4_1" and group_size != matmul.QUANT_BLOCK:
      raise ValueError(f"quantization_group_size={group_size}: the CPU kernels quantize in "
                       f"blocks of {matmul.QUANT_BLOCK} rows (use kernels='portable' for "
                       "other group sizes)")
    self.source, self.fmt, self.group_size, self.head = source, fmt, group_size, head
    self.kind = source.kind
    kernels = [p for p in source.shapes() if self._quantized(p) and is_layer_path(p)]
    stored = sorted({k for p in kernels if (k := source.quantization(p)) is not None})
    if stored:
      raise ValueError(f"{source.where}: quantization applies to float checkpoints; this one "
                       f"stores its layers quantized already ({', '.join(stored)} blocks, kept "
                       "as they are without the quantization argument)")
    rows = self.group_size if fmt == "int4" else (
        matmul.QUANT_BLOCK if fmt in matmul.BLOCK_FORMATS else 1)
    bad = {"/".join(p[1:]): source.shapes()[p][-2] for p in kernels
           if source.shapes()[p][-2] % rows}
    if bad:
      raise ValueError(f"{source.where}: quantizing to {fmt} takes input widths that are "
                       f"multiples of {rows}; these projections have {bad}")

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return self.source.shapes()

  def read(self, path: Path, layers: Sequence[int] | None = None) -> np.ndarray:
    return self.source.read(path, layers)

  def place(self, path: Path, sharding, dtype):
    return self.source.place(path, sharding, dtype)

  def _quantized(self, path: Path) -> bool:
    if is_layer_path(path):
      return len(path) == 3 and path[1] in quant.PROJECTIONS and path[2] == "kernel"
    return self.head and path in (("embed", "embedding"), ("lm_head",))

  def quantization(self, path: Path, layer: int | None = None) -> str | None:
    del layer
    if not self._quantized(path):
      return None
    if not is_layer_path(path):  # the head: int8 blocks whatever the layers hold
      return "q8_0" if self.fmt in matmul.BLOCK_FORMATS else None
    return self.fmt

  def read_blocks(self, path: Path, layers: Sequence[int] | None = None, fmt: str | None = None
                  ) -> tuple[np.ndarray, ...]:
    kind = self.quantization(path)
    if kind is None:
      return super().read_blocks(path, layers, fmt)
    fmt = fmt or kind
    w = self.source.read(path, layers)
    if not is_layer_path(path):
      w = w.T  # the table [vocab, hidden] as its blocks see it: K = hidden
    if fmt in matmul.BLOCK_FORMATS:
      return tuple(np.asarray(p) for p in matmul.quantize_blocks(fmt, w))
    parts = quant.quantize(w, layout_of(fmt, self.group_size))
    # as `read_blocks` gives blocks: values as integers, scales and minimums as float32
    values = np.asarray(parts[0])
    if fmt != "fp8":
      values = values.astype(np.uint8 if fmt == "int4" else np.int8)
    return (values,) + tuple(np.asarray(p, np.float32) for p in parts[1:])

  def close(self) -> None:
    self.source.close()
