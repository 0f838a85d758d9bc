"""GGUF files: configuration, tokenizer and chat template from metadata, tensors dequantized on load.

llama.cpp's converter permutes the rows of the Llama q/k projections (interleaved rotary pairs);
`unpermute_rotary` undoes it so the weights match the Hugging Face `rotate_half` convention.
"""

import os

import gguf
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxtier.checkpoint.params import Path, TensorSource, check_layers_present, is_layer_path
from jaxtier.config import ModelConfig
from jaxtier.tokenizer import Tokenizer

_LAYER_NAMES: dict[str, Path] = {
    "attn_norm.weight": ("layers", "attn_norm", "scale"),
    "attn_q.weight": ("layers", "q_proj", "kernel"),
    "attn_k.weight": ("layers", "k_proj", "kernel"),
    "attn_v.weight": ("layers", "v_proj", "kernel"),
    "attn_output.weight": ("layers", "o_proj", "kernel"),
    "attn_q.bias": ("layers", "q_proj", "bias"),
    "attn_k.bias": ("layers", "k_proj", "bias"),
    "attn_v.bias": ("layers", "v_proj", "bias"),
    "ffn_norm.weight": ("layers", "mlp_norm", "scale"),
    "ffn_gate.weight": ("layers", "gate_proj", "kernel"),
    "ffn_up.weight": ("layers", "up_proj", "kernel"),
    "ffn_down.weight": ("layers", "down_proj", "kernel"),
}
_GLOBAL_NAMES: dict[str, Path] = {
    "token_embd.weight": ("embed", "embedding"),
    "output_norm.weight": ("final_norm", "scale"),
    "output.weight": ("lm_head",),
}
# Block formats the CPU matmul kernel multiplies as stored (`jaxtier.matmul`).
_BLOCK_TYPES = {gguf.GGMLQuantizationType.Q4_1: "q4_1", gguf.GGMLQuantizationType.Q8_0: "q8_0"}
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
  if arch not in ("llama", "qwen2"):
    raise ValueError(f"{path}: architecture {arch!r} is not supported; expected 'llama' or 'qwen2'")
  if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
    raise ValueError(f"{path}: rope scaling {_field(reader, f'{arch}.rope.scaling.type')!r} in "
                     "GGUF files is not supported")
  names = {t.name for t in reader.tensors}
  try:
    hidden, heads = _field(reader, f"{arch}.embedding_length"), _field(reader, f"{arch}.attention.head_count")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"), num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // heads),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
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
        if sub not in _LAYER_NAMES:
          raise ValueError(f"{path}: unexpected tensor {name!r}")
        if not 0 <= int(layer) < config.num_layers:
          raise ValueError(f"{path}: tensor {name} is for layer {layer}, but the file has "
                           f"{config.num_layers} layers")
        model_path = _LAYER_NAMES[sub]
        per_layer.setdefault(model_path, [None] * config.num_layers)[int(layer)] = (sub, tensor)
        self._shapes[model_path] = (config.num_layers,) + (shape[::-1] if len(shape) == 2
                                                           and sub.endswith("weight") else shape)
      elif name in _GLOBAL_NAMES:
        self._globals[_GLOBAL_NAMES[name]] = tensor
        self._shapes[_GLOBAL_NAMES[name]] = shape
      elif name != "rope_freqs.weight":
        raise ValueError(f"{path}: unexpected tensor {name!r}")
    check_layers_present(per_layer, config.num_layers, path)
    self._layers = per_layer

  def shapes(self) -> dict[Path, tuple[int, ...]]:
    return dict(self._shapes)

  def _layer(self, sub: str, tensor) -> np.ndarray:
    array = _dequantize(tensor, self.where)
    if self._config.architecture == "llama" and sub.startswith(("attn_q", "attn_k")):
      array = unpermute_rotary(array, self._config.num_heads if sub.startswith("attn_q")
                               else self._config.num_kv_heads)
    if sub.endswith("weight") and array.ndim == 2:
      array = array.T  # [out, in] -> [in, out]
    return array

  def quantization(self, path: Path) -> str | None:
    tensors = ([t for _, t in self._layers.get(path) or ()] if is_layer_path(path)
               else [self._globals[path]] if path in self._globals else [])
    kinds = {_BLOCK_TYPES.get(t.tensor_type) if len(t.shape) == 2 else None for t in tensors}
    return kinds.pop() if len(kinds) == 1 else None

  def _blocks(self, sub: str | None, tensor) -> tuple[np.ndarray, ...]:
    """A tensor [out, in] as its blocks, transposed to [in, out] (q/k rows unpermuted)."""
    n, k = (int(v) for v in reversed(tensor.shape))
    kind = _BLOCK_TYPES[tensor.tensor_type]
    raw = np.asarray(tensor.data).reshape(n, k // 32, 20 if kind == "q4_1" else 34)
    half = lambda a: a.copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "q4_1":  # d, m (float16), then 16 bytes: byte i holds q[i] and q[i + 16]
      qs = raw[..., 4:]
      parts = (np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k), half(raw[..., 0:2]),
               half(raw[..., 2:4]))
    else:  # d (float16), then 32 int8
      parts = (raw[..., 2:].copy().view(np.int8).reshape(n, k), half(raw[..., 0:2]))
    if (sub is not None and self._config.architecture == "llama"
        and sub.startswith(("attn_q", "attn_k"))):
      heads = self._config.num_heads if sub.startswith("attn_q") else self._config.num_kv_heads
      parts = tuple(unpermute_rotary(a, heads) for a in parts)
    return tuple(a.T for a in parts)

  def read_blocks(self, path: Path, layers=None) -> tuple[np.ndarray, ...]:
    if self.quantization(path) is None:
      return super().read_blocks(path, layers)
    if not is_layer_path(path):
      return self._blocks(None, self._globals[path])
    slots = self._layers[path]
    parts = [self._blocks(*slots[i]) for i in (range(len(slots)) if layers is None else layers)]
    return tuple(np.stack(a) for a in zip(*parts))

  def read(self, path: Path, layers=None) -> np.ndarray:
    if is_layer_path(path):
      slots = self._layers[path]
      layers = range(len(slots)) if layers is None else layers
      return np.stack([self._layer(*slots[i]) for i in layers])
    return _dequantize(self._globals[path], self.where)

  def close(self) -> None:
    self._globals, self._layers = {}, {}  # the reader's memory map closes once it is collected


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
