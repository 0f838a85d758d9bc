"""GGUF files: configuration, tokenizer and chat template from metadata, tensors dequantized on load
(or read as their blocks, for the types the CPU kernels multiply as stored: `block_parts`).

llama.cpp's converter permutes the rows of the Llama q/k projections (interleaved rotary pairs);
`unpermute_rotary` undoes it so the weights match the Hugging Face `rotate_half` convention. Qwen2
and Qwen3 files keep Hugging Face's rows (llama.cpp runs them with NeoX-style rotary); Qwen3's
per-head q/k norms are `attn_q_norm` and `attn_k_norm`. Phi-3 files hold q/k/v fused
(`attn_qkv`) and gate/up fused in `ffn_up`, split into the model's projections by rows as they
are read (`_FUSED_LAYER_NAMES`). llama.cpp writes Mistral checkpoints as `llama` files.
"""

import os

import gguf
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxtier.checkpoint.params import Path, TensorSource, check_layers_present, is_layer_path
from jaxtier.model.config import ModelConfig
from jaxtier.text.tokenizer import Tokenizer

_LAYER_NAMES: dict[str, Path] = {
    "attn_norm.weight": ("layers", "attn_norm", "scale"),
    "attn_q.weight": ("layers", "q_proj", "kernel"),
    "attn_k.weight": ("layers", "k_proj", "kernel"),
    "attn_v.weight": ("layers", "v_proj", "kernel"),
    "attn_output.weight": ("layers", "o_proj", "kernel"),
    "attn_q.bias": ("layers", "q_proj", "bias"),
    "attn_k.bias": ("layers", "k_proj", "bias"),
    "attn_v.bias": ("layers", "v_proj", "bias"),
    "attn_q_norm.weight": ("layers", "q_norm", "scale"),
    "attn_k_norm.weight": ("layers", "k_norm", "scale"),
    "ffn_norm.weight": ("layers", "mlp_norm", "scale"),
    "ffn_gate.weight": ("layers", "gate_proj", "kernel"),
    "ffn_up.weight": ("layers", "up_proj", "kernel"),
    "ffn_down.weight": ("layers", "down_proj", "kernel"),
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")  # `general.architecture` values read
# Phi-3's fused layer tensors and the parameters their output rows split into, in order.
_FUSED_LAYER_NAMES: dict[str, tuple[Path, ...]] = {
    "attn_qkv.weight": (("layers", "q_proj", "kernel"), ("layers", "k_proj", "kernel"),
                        ("layers", "v_proj", "kernel")),
    "ffn_up.weight": (("layers", "gate_proj", "kernel"), ("layers", "up_proj", "kernel")),
}
_GLOBAL_NAMES: dict[str, Path] = {
    "token_embd.weight": ("embed", "embedding"),
    "output_norm.weight": ("final_norm", "scale"),
    "output.weight": ("lm_head",),
}
# GGUF block types the CPU matmul kernel multiplies as stored (`jaxtier.kernels.cpu.matmul`), by the
# format that holds them exactly: blocks of 32 K rows of 4-bit values q with a float32 scale d and
# minimum m (w = d q + m, "q4_1") or of 8-bit values with a scale (w = d q, "q8_0"). Each weight
# comes out bit for bit as the gguf package dequantizes it (d q is exact in float32 in every case,
# so d q + m rounds once, as the file's own formula does):
#   Q4_1: d, m from the block's float16s.
#   Q4_0: w = d (q - 8), so m = -8 d (exact), and d q - 8 d = d (q - 8) is exact too.
#   Q4_K: super-blocks of 256 values, 8 blocks of 32 with 6-bit scales s and minimums n, w =
#     (D s) q - (M n) with D, M the super-block's float16s: d = D s and m = -(M n), both exact
#     (an 11-bit D times a 6-bit s).
#   Q8_0: d from the block's float16.
#   Q5_0: w = d (q5 - 16) with 5-bit q5, so q = q5 - 16 (-16 to 15) in the 8-bit format.
# Every other type whose values fit 8 bits is held exactly by "q8_16" (8-bit values q with a scale
# d and minimum m per 16 values, w = d q + m; `block_parts_q8_16`), as is each of the above:
#   Q6_K: w = (D s) (q6 - 32), s an 8-bit scale per 16 values: d = D s (an 11-bit D times a
#     7-bit s), and d q takes at most 11 + 7 + 5 bits: exact.
#   Q5_K: as Q4_K with 5-bit q; Q5_1: w = d q5 + m.
#   Q3_K: w = (D (s - 32)) q3 with a 6-bit s per 16 values and q3 in [-4, 3].
#   Q2_K: w = (D s) q2 - (M n) with 4-bit s and n per 16 values.
_Q = gguf.GGMLQuantizationType
_BLOCK_TYPES = {_Q.Q4_0: "q4_1", _Q.Q4_1: "q4_1", _Q.Q4_K: "q4_1", _Q.Q5_0: "q8_0",
                _Q.Q8_0: "q8_0"}
_Q8_16_TYPES = frozenset((_Q.Q6_K, _Q.Q5_K, _Q.Q5_1, _Q.Q3_K, _Q.Q2_K))
# Pre-tokenizer splits for the `tokenizer.ggml.pre` values we know, as the original tokenizer.json
# files define them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def open_gguf(path: str) -> gguf.GGUFReader:
  """Opens a GGUF file, turning a truncated or corrupt file into a clear error."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
    raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                     f"{type(e).__name__}: {e}") from None


def _field(reader: gguf.GGUFReader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader, path: str) -> ModelConfig:
  """ModelConfig from GGUF metadata."""
  arch = _field(reader, "general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise ValueError(f"{path}: architecture {arch!r} is not supported; expected one of "
                     f"{GGUF_ARCHITECTURES}")
  names = {t.name for t in reader.tensors}
  if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
    raise ValueError(f"{path}: rope scaling 'longrope' (rope_factors_long/short) is not supported")
  if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
    raise ValueError(f"{path}: rope scaling {_field(reader, f'{arch}.rope.scaling.type')!r} in "
                     "GGUF files is not supported")
  try:
    hidden, heads = _field(reader, f"{arch}.embedding_length"), _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // heads)
    rotary = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
      raise ValueError(f"{path}: rotary embeddings over {rotary} of the head's {head_dim} "
                       "dimensions (a partial rotary factor) are not supported")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=_field(reader, f"{arch}.attention.sliding_window") or None,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048))
  except TypeError:
    raise ValueError(f"{path}: metadata lacks the {arch} shape fields (embedding_length, "
                     "block_count, attention.head_count, feed_forward_length)") from None


def unpermute_rotary(w_oi: np.ndarray, heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` of q/k weights [out, in] (or biases [out])."""
  rest = w_oi.shape[1:]
  return w_oi.reshape(heads, w_oi.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w_oi.shape)


def _dequantize(tensor, path: str) -> np.ndarray:
  try:
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
  except NotImplementedError:
    raise ValueError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                     "this gguf package cannot dequantize") from None


def _half(a: np.ndarray) -> np.ndarray:
  """Float16s stored as pairs of bytes (the last axis) as float32."""
  return np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)


def block_parts(tensor_type, data: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
  """The blocks of a GGUF tensor [n, k] of a `_BLOCK_TYPES` type, as the format that holds them
  exactly (see there): "q4_1", (q uint8 [n, k] 0-15, d [n, k / 32], m [n, k / 32]), or "q8_0",
  (q int8 [n, k], d [n, k / 32]); d and m float32."""
  if tensor_type not in _BLOCK_TYPES:
    raise ValueError(f"{tensor_type.name} blocks are not kept (dequantize them instead)")
  block, size = gguf.GGML_QUANT_SIZES[tensor_type]
  raw = np.asarray(data, np.uint8).reshape(n, k // block, size)
  nibbles = lambda qs: np.concatenate([qs & 15, qs >> 4], axis=-1)  # byte i: q[i], q[i + 16]
  if tensor_type == _Q.Q4_1:  # d, m (float16), then 16 bytes of nibbles
    return nibbles(raw[..., 4:]).reshape(n, k), _half(raw[..., 0:2]), _half(raw[..., 2:4])
  if tensor_type == _Q.Q4_0:  # d (float16), then 16 bytes of nibbles; w = d (q - 8)
    d = _half(raw[..., 0:2])
    return nibbles(raw[..., 2:]).reshape(n, k), d, -8 * d
  if tensor_type == _Q.Q4_K:  # D, M (float16), 12 bytes of 6-bit scales and minimums, 128 of q
    scales, minimums = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
    d = (_half(raw[..., 0:2])[..., None] * scales.reshape(n, k // 256, 8)).reshape(n, k // 32)
    m = -(_half(raw[..., 2:4])[..., None] * minimums.reshape(n, k // 256, 8)).reshape(n, k // 32)
    qs = raw[..., 16:].reshape(n, k // 256, 4, 1, 32)  # 32 bytes: blocks 2j (low), 2j + 1 (high)
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, k)
    return q, d, m
  if tensor_type == _Q.Q8_0:  # d (float16), then 32 int8
    return raw[..., 2:].copy().view(np.int8).reshape(n, k), _half(raw[..., 0:2])
  # Q5_0: d (float16), 4 bytes of high bits (bit i: value i), 16 bytes of low nibbles
  high = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")
  q = (nibbles(raw[..., 6:]) | (high << 4)).astype(np.int8) - np.int8(16)
  return q.reshape(n, k), _half(raw[..., 0:2])


def block_parts_q8_16(tensor_type, data: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
  """The blocks of a GGUF tensor [n, k] of a type that fits 8 bits (`_BLOCK_TYPES` or
  `_Q8_16_TYPES`) as the "q8_16" format's (q int8 [n, k], d [n, k / 16], m [n, k / 16]), d and m
  float32: d q + m is bit for bit the gguf package's dequantization."""
  if tensor_type in _BLOCK_TYPES:
    q, d, *m = block_parts(tensor_type, data, n, k)
    m = m[0] if m else np.zeros_like(d)
    return q.astype(np.int8), np.repeat(d, 2, axis=-1), np.repeat(m, 2, axis=-1)
  if tensor_type not in _Q8_16_TYPES:
    raise ValueError(f"{tensor_type.name} blocks are not kept (dequantize them instead)")
  block, size = gguf.GGML_QUANT_SIZES[tensor_type]
  raw = np.asarray(data, np.uint8).reshape(-1, size)  # one row per block
  rows = raw.shape[0]
  shifts = lambda *bits: np.array(bits, np.uint8).reshape(1, 1, -1, 1)
  zeros = lambda: np.zeros((rows, block // 16), np.float32)
  if tensor_type == _Q.Q6_K:  # 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, D
    low = (raw[:, :128].reshape(rows, -1, 1, 64) >> shifts(0, 4)) & 15
    high = (raw[:, 128:192].reshape(rows, -1, 1, 32) >> shifts(0, 2, 4, 6)) & 3
    q = (low.reshape(rows, -1) | (high.reshape(rows, -1) << 4)).astype(np.int8) - np.int8(32)
    d = _half(raw[:, 208:210])[:, None] * raw[:, 192:208].view(np.int8).astype(np.float32)
    m = zeros()
  elif tensor_type == _Q.Q5_K:  # D, M, 12 bytes of 6-bit scales and minimums, 32 of high bits
    scales, minimums = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])
    low = (raw[:, 48:].reshape(rows, -1, 1, 32) >> shifts(0, 4)) & 15
    high = (raw[:, 16:48].reshape(rows, -1, 1, 32) >> shifts(*range(8))) & 1
    q = (low.reshape(rows, -1) | (high.reshape(rows, -1) << 4)).astype(np.int8)
    d = np.repeat(_half(raw[:, 0:2])[:, None] * scales.astype(np.float32), 2, axis=-1)
    m = np.repeat(-(_half(raw[:, 2:4])[:, None] * minimums.astype(np.float32)), 2, axis=-1)
  elif tensor_type == _Q.Q5_1:  # d, m, 4 bytes of high bits (bit i: value i), 16 of nibbles
    high = np.unpackbits(raw[:, 4:8], axis=-1, bitorder="little")
    q = (np.concatenate([raw[:, 8:] & 15, raw[:, 8:] >> 4], axis=-1) | (high << 4)).astype(np.int8)
    d, m = (np.repeat(_half(raw[:, at:at + 2])[:, None], 2, axis=-1) for at in (0, 2))
  elif tensor_type == _Q.Q3_K:  # 32 bytes of high-bit masks, 64 of bit pairs, 12 of scales, D
    low = ((raw[:, 32:96].reshape(rows, -1, 1, 32) >> shifts(0, 2, 4, 6)) & 3).reshape(rows, -1)
    high = ((raw[:, :32].reshape(rows, -1, 1, 32) >> shifts(*range(8))) & 1).reshape(rows, -1)
    q = low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)  # a set mask bit adds no -4
    packed = raw[:, 96:108]
    low_s = ((packed[:, None, :8] >> np.array([0, 4], np.uint8)[None, :, None]) & 15)
    high_s = ((packed[:, None, 8:] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3)
    scales = (low_s.reshape(rows, 16) | (high_s.reshape(rows, 16) << 4)).astype(np.int8) - 32
    d = _half(raw[:, 108:110])[:, None] * scales.astype(np.float32)
    m = zeros()
  else:  # Q2_K: 16 bytes of 4-bit scales and minimums, 64 of bit pairs, D, M
    q = ((raw[:, 16:80].reshape(rows, -1, 1, 32) >> shifts(0, 2, 4, 6)) & 3).reshape(rows, -1)
    q = q.astype(np.int8)
    d = _half(raw[:, 80:82])[:, None] * (raw[:, :16] & 15).astype(np.float32)
    m = -(_half(raw[:, 82:84])[:, None] * (raw[:, :16] >> 4).astype(np.float32))
  return q.reshape(n, k), d.reshape(n, k // 16), m.reshape(n, k // 16)


class GGUFSource(TensorSource):
  """The tensors of a GGUF file (memory mapped), each dequantized to float32 when read and laid
  out as the model's parameters (q/k rows unpermuted for Llama, linear weights [in, out])."""
  kind = "gguf"

  def __init__(self, reader: gguf.GGUFReader, config: ModelConfig, path: str):
    super().__init__(path)
    self._config = config
    self._globals, self._shapes = {}, {}
    per_layer: dict[Path, list] = {}
    for tensor in reader.tensors:
      name = tensor.name
      shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
      if name.startswith("blk."):
        _, layer, sub = name.split(".", 2)
        fused = config.architecture == "phi3" and sub in _FUSED_LAYER_NAMES
        if sub not in _LAYER_NAMES and not fused:
          raise ValueError(f"{path}: unexpected tensor {name!r}")
        if not 0 <= int(layer) < config.num_layers:
          raise ValueError(f"{path}: tensor {name} is for layer {layer}, but the file has "
                           f"{config.num_layers} layers")
        if fused:
          rows = _fused_rows(sub, config)
          if shape[0] != rows[-1][1]:
            raise ValueError(f"{path}: tensor {name} has {shape[0]} rows; the config's parts "
                             f"need {rows[-1][1]}")
          parts = list(zip(_FUSED_LAYER_NAMES[sub], rows))
        else:
          parts = [(_LAYER_NAMES[sub], None)]
        for model_path, rows_of in parts:
          part = shape if rows_of is None else (rows_of[1] - rows_of[0],) + shape[1:]
          per_layer.setdefault(model_path, [None] * config.num_layers)[int(layer)] = (
              sub, tensor, rows_of)
          self._shapes[model_path] = (config.num_layers,) + (
              part[::-1] if len(part) == 2 and sub.endswith("weight") else part)
      elif name in _GLOBAL_NAMES:
        self._globals[_GLOBAL_NAMES[name]] = tensor
        self._shapes[_GLOBAL_NAMES[name]] = shape
      elif name != "rope_freqs.weight":
        raise ValueError(f"{path}: unexpected tensor {name!r}")
    check_layers_present(per_layer, config.num_layers, path)
    self._layers = per_layer

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return dict(self._shapes)

  def _layer(self, sub: str, tensor, rows: tuple[int, int] | None) -> np.ndarray:
    array = _dequantize(tensor, self.where)
    if rows is not None:
      array = array[rows[0]:rows[1]]
    if self._config.architecture == "llama" and sub.startswith(("attn_q", "attn_k")):
      array = unpermute_rotary(array, self._config.num_heads if sub.startswith("attn_q")
                               else self._config.num_kv_heads)
    if sub.endswith("weight") and array.ndim == 2:
      array = array.T  # [out, in] -> [in, out]
    return array

  def quantization(self, path: Path, layer: int | None = None) -> str | None:
    if is_layer_path(path):
      slots = self._layers.get(path) or ()
      tensors = [t for _, t, _ in (slots if layer is None else slots[layer:layer + 1])]
    else:
      tensors = [self._globals[path]] if path in self._globals else []
    return _held(tensors)

  def _blocks(self, sub: str | None, tensor, rows: tuple[int, int] | None, fmt: str
              ) -> tuple[np.ndarray, ...]:
    """A tensor [out, in] (its output `rows` only, if given) as its blocks in format `fmt`,
    transposed to [in, out] (q/k rows unpermuted)."""
    n, k = (int(v) for v in reversed(tensor.shape))
    parts = (block_parts_q8_16 if fmt == "q8_16" else block_parts)(
        tensor.tensor_type, np.asarray(tensor.data), n, k)
    if rows is not None:
      parts = tuple(a[rows[0]:rows[1]] for a in parts)
    if (sub is not None and self._config.architecture == "llama"
        and sub.startswith(("attn_q", "attn_k"))):
      heads = self._config.num_heads if sub.startswith("attn_q") else self._config.num_kv_heads
      parts = tuple(unpermute_rotary(a, heads) for a in parts)
    return tuple(a.T for a in parts)

  def read_blocks(self, path: Path, layers=None, fmt: str | None = None
                  ) -> tuple[np.ndarray, ...]:
    if not is_layer_path(path):
      kind = self.quantization(path)
      if kind is None or fmt not in (None, kind, "q8_16"):
        return super().read_blocks(path, layers, fmt)
      return self._blocks(None, self._globals[path], None, fmt or kind)
    slots = self._layers[path]
    layers = range(len(slots)) if layers is None else layers
    held = _held([slots[i][1] for i in layers])
    if held is None or fmt not in (None, held, "q8_16"):
      return super().read_blocks(path, layers, fmt)
    parts = [self._blocks(*slots[i], fmt or held) for i in layers]
    return tuple(np.stack(a) for a in zip(*parts))

  def read(self, path: Path, layers=None) -> np.ndarray:
    if is_layer_path(path):
      slots = self._layers[path]
      layers = range(len(slots)) if layers is None else layers
      return np.stack([self._layer(*slots[i]) for i in layers])
    return _dequantize(self._globals[path], self.where)

  def close(self) -> None:
    self._globals, self._layers = {}, {}  # the reader's memory map closes once it is collected


def _fused_rows(sub: str, config: ModelConfig) -> list[tuple[int, int]]:
  """The [start, stop) output rows of each part of a fused Phi-3 tensor (`_FUSED_LAYER_NAMES`)."""
  if sub == "attn_qkv.weight":
    n, k, d = config.num_heads, config.num_kv_heads, config.head_dim
    return [(0, n * d), (n * d, (n + k) * d), ((n + k) * d, (n + 2 * k) * d)]
  f = config.intermediate_size
  return [(0, f), (f, 2 * f)]


def _kind(tensor) -> str | None:
  """The block format that holds a 2-d tensor's type exactly ("q4_1", "q8_0" or "q8_16"), or
  None (dequantized on load)."""
  if len(tensor.shape) != 2:
    return None
  if tensor.tensor_type in _BLOCK_TYPES:
    return _BLOCK_TYPES[tensor.tensor_type]
  return "q8_16" if tensor.tensor_type in _Q8_16_TYPES else None


def _held(tensors) -> str | None:
  """The block format that holds every one of `tensors` exactly: their shared `_kind`, "q8_16"
  where their kinds differ (all fit 8 bits), None where one is not kept or there are none."""
  kinds = {_kind(t) for t in tensors}
  if len(kinds) == 1:
    return kinds.pop()
  return None if not kinds or None in kinds else "q8_16"


def open_source(path: str) -> tuple[ModelConfig, Tokenizer, GGUFSource]:
  """Config, tensor source and tokenizer of a GGUF file (no tensor data read yet)."""
  reader = open_gguf(path)
  config = read_config(reader, path)
  return config, read_tokenizer(reader, path), GGUFSource(reader, config, path)


def _pre_tokenizer(pre: str | None):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  split = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
  if split is not None:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  return byte_level


def read_tokenizer(reader: gguf.GGUFReader, path: str) -> Tokenizer:
  """A byte-level BPE tokenizer and chat template built from `tokenizer.*` metadata."""
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer model {kind!r} is not supported; expected 'gpt2' "
                     "(byte-level BPE)")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                            ignore_merges=False))
  backend.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
  backend.decoder = decoders.ByteLevel()
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                              for t, k in zip(tokens, types) if k == gguf.TokenType.CONTROL])
  backend.add_tokens([tokenizers.AddedToken(t, normalized=False)
                      for t, k in zip(tokens, types) if k == gguf.TokenType.USER_DEFINED])
  bos_id, eos_id = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
  bos = tokens[bos_id] if bos_id is not None else None
  if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  eos_ids = [i for i in (eos_id, _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None]
  return Tokenizer(backend, tuple(dict.fromkeys(eos_ids)), bos,
                   tokens[eos_id] if eos_id is not None else None,
                   _field(reader, "tokenizer.chat_template"))
