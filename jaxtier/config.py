"""Model configuration: one frozen dataclass, built from a Hugging Face config.json or GGUF metadata."""

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Rotary frequency scaling; `rope_type` "default" means none."""
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; expected one of "
                       f"{SUPPORTED_ROPE_TYPES}")
    if self.factor <= 0:
      raise ValueError(f"rope_scaling factor must be positive, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Llama-family decoder."""
  architecture: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  max_position_embeddings: int = 2048
  # Per-family options of the one decoder (`jaxtier.model.DecoderLayer`):
  qk_norm: bool = False  # RMSNorm over each q and k head before the rotary embedding (Qwen3)
  # Attention over the last `sliding_window` positions only (Mistral, Phi-3); None: full. The
  # engine runs only contexts the window covers, where attention is full (`check_sliding_window`).
  sliding_window: int | None = None

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"architecture {self.architecture!r} is not supported; expected one of "
                       f"{SUPPORTED_ARCHITECTURES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")

  def check_sliding_window(self, max_model_len: int) -> None:
    """Raises ValueError where a sliding window is shorter than the context the engine runs: a
    window of at least max_model_len positions is full attention, which is exact."""
    if self.sliding_window is not None and self.sliding_window < max_model_len:
      raise ValueError(
          f"this {self.architecture} model attends over a sliding window of "
          f"{self.sliding_window} positions, shorter than max_model_len={max_model_len}: "
          "sliding-window attention is not supported yet; run with max_model_len <= "
          f"{self.sliding_window}, where it equals full attention")

  @property
  def layer_param_count(self) -> int:
    h, n, k, d, f = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.intermediate_size)
    bias = (n + 2 * k) * d if self.attention_bias else 0
    qk_norm = 2 * d if self.qk_norm else 0
    return 2 * h + h * (n + 2 * k) * d + n * d * h + 3 * h * f + bias + qk_norm

  def inv_freq(self) -> np.ndarray:
    """Rotary inverse frequencies [head_dim // 2], with the configured scaling applied."""
    inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
    s = self.rope_scaling
    if s.rope_type == "linear":
      return (inv / s.factor).astype(np.float32)
    if s.rope_type == "llama3":
      low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
      high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
      smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                / (s.high_freq_factor - s.low_freq_factor))
      smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
      medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
      return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv.astype(np.float32)


def _rope_scaling_from_hf(raw: Mapping[str, Any] | None, source: str) -> RopeScaling:
  if not raw:
    return RopeScaling()
  rope_type = raw.get("rope_type", raw.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"{source}: rope scaling {rope_type!r} is not supported (jaxtier implements "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)})")
  fields = {f.name for f in dataclasses.fields(RopeScaling)}
  kwargs = {k: v for k, v in raw.items() if k in fields and k != "rope_type"}
  return RopeScaling(rope_type=rope_type, **kwargs)


def _sliding_window(hf: Mapping[str, Any], model_type: str) -> int | None:
  """The attention window as the family's transformers model applies it (None: full)."""
  window = hf.get("sliding_window")
  if model_type == "llama" or not window:
    return None
  if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
    return None  # Qwen writes a window but attends fully unless use_sliding_window
  if "layer_types" in hf and "sliding_attention" not in hf["layer_types"]:
    return None  # transformers 5 names each layer's attention; none slides
  return int(window)


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
  """Builds a ModelConfig from the dict of a Hugging Face config.json.

  Rotary settings are read from `rope_theta` and `rope_scaling`, or from the `rope_parameters`
  that transformers 5 writes in their place.
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{source}: model_type {model_type!r} (architectures "
                     f"{hf.get('architectures')}) is not supported; expected one of "
                     f"{SUPPORTED_ARCHITECTURES}")
  if hf.get("mlp_bias"):
    raise ValueError(f"{source}: mlp_bias=true is not supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported; expected 'silu'")
  try:
    num_heads = hf["num_attention_heads"]
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    params = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta") or params.get("rope_theta") or (rope or {}).get(
        "rope_theta", 10000.0)
    partial = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
      raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported (rotary "
                       "embeddings over the whole head only)")
    return ModelConfig(
        architecture=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling_from_hf(rope, source),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(hf, model_type),
    )
  except KeyError as e:
    raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
