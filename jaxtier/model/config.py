"""Model configuration: one frozen dataclass, built from a Hugging Face config.json or GGUF metadata."""

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text",
                           "mixtral", "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU, or GeGLU (Gemma)
LAYER_TYPES = ("full_attention", "sliding_attention")
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
  # Attention over the last `sliding_window` positions only (Mistral, Phi-3, Gemma); None: full.
  sliding_window: int | None = None
  # Each layer's attention, "full_attention" or "sliding_attention" (transformers 5's
  # `layer_types`; Gemma 2 alternates them); None: every layer the same.
  layer_types: tuple[str, ...] | None = None
  hidden_act: str = "silu"  # one of ACTIVATIONS
  # Gemma: norms after the attention and after the MLP too, before each residual add
  sandwich_norms: bool = False
  # What the checkpoint's norm weights w mean: the scale is norm_offset + w (Gemma: 1). Loaders
  # fold it into the weights, so the model's norms scale by their weights alone.
  norm_offset: float = 0.0
  embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
  query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
  attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
  final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
  # The rotary base of the sliding layers where it differs from the full layers' `rope_theta`
  # (Gemma 3: 10,000 against 1,000,000); their rotation is unscaled. None: one rotary table.
  sliding_rope_theta: float | None = None
  # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is `num_experts` gated MLPs of
  # width `moe_intermediate_size`, `num_experts_per_tok` of them per token, picked by a router
  # (softmax over all experts, the top k kept, renormalized when `norm_topk_prob`). 0: dense.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True

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
    if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                         or set(self.layer_types) - set(LAYER_TYPES)):
      raise ValueError(f"layer_types {self.layer_types} must name one of {LAYER_TYPES} for each "
                       f"of the {self.num_layers} layers")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; expected one of "
                       f"{ACTIVATIONS}")
    if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                 and self.moe_intermediate_size > 0):
      raise ValueError(f"num_experts={self.num_experts} needs 0 < num_experts_per_tok "
                       f"({self.num_experts_per_tok}) <= num_experts and a positive "
                       f"moe_intermediate_size ({self.moe_intermediate_size})")
    for name in ("attn_softcap", "final_softcap", "query_scale"):
      if getattr(self, name) is not None and getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive or None, got {getattr(self, name)}")

  def layer_windows(self) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: full attention), or None when no layer has one."""
    if self.sliding_window is None:
      return None
    if self.layer_types is None:
      return (self.sliding_window,) * self.num_layers
    windows = tuple(self.sliding_window if t == "sliding_attention" else None
                    for t in self.layer_types)
    return windows if any(w is not None for w in windows) else None

  @property
  def layer_param_count(self) -> int:
    h, n, k, d, f = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.intermediate_size)
    bias = (n + 2 * k) * d if self.attention_bias else 0
    qk_norm = 2 * d if self.qk_norm else 0
    norms = 4 * h if self.sandwich_norms else 2 * h
    if self.num_experts:
      mlp = h * self.num_experts + self.num_experts * 3 * h * self.moe_intermediate_size
    else:
      mlp = 3 * h * f
    return norms + h * (n + 2 * k) * d + n * d * h + mlp + bias + qk_norm

  def inv_freq(self) -> np.ndarray:
    """Rotary inverse frequencies [head_dim // 2], with the configured scaling applied; with a
    `sliding_rope_theta`, [2, head_dim // 2]: the full layers' (scaled), then the sliding
    layers' (`layer_ropes` picks a row per layer)."""
    full = self._scaled_inv_freq()
    if self.sliding_rope_theta is None:
      return full
    return np.stack([full, self._base_inv_freq(self.sliding_rope_theta).astype(np.float32)])

  def layer_ropes(self) -> tuple[int, ...] | None:
    """Each layer's row of `inv_freq()` (0 full, 1 sliding), or None where there is one row."""
    if self.sliding_rope_theta is None:
      return None
    windows = self.layer_windows() or (None,) * self.num_layers
    return tuple(0 if w is None else 1 for w in windows)

  def _base_inv_freq(self, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))

  def _scaled_inv_freq(self) -> np.ndarray:
    inv = self._base_inv_freq(self.rope_theta)
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
  if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
    return None  # Qwen writes a window but attends fully unless use_sliding_window
  if "layer_types" in hf and "sliding_attention" not in hf["layer_types"]:
    return None  # transformers 5 names each layer's attention; none slides
  return int(window)


def _layer_types(hf: Mapping[str, Any], model_type: str, window: int | None
                 ) -> tuple[str, ...] | None:
  """Each layer's attention where layers differ: transformers 5's `layer_types`, or Gemma 2's
  alternation (sliding first) in configs written before it; None where all layers are alike."""
  if window is None:
    return None
  types = hf.get("layer_types")
  if types is None and model_type in ("gemma2", "gemma3_text"):
    # Gemma 2 alternates (sliding first); Gemma 3 has a full layer every `sliding_window_pattern`
    pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
             for i in range(hf["num_hidden_layers"])]
  if types is None or len(set(types)) == 1:
    return None
  return tuple(types)


def _activation(hf: Mapping[str, Any], source: str) -> str:
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  if act in ("gelu_pytorch_tanh", "gelu_tanh"):
    return "gelu_pytorch_tanh"
  if act != "silu":
    raise ValueError(f"{source}: hidden activation {act!r} is not supported; expected one of "
                     f"{ACTIVATIONS}")
  return act


def _gemma_options(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """Gemma 2's and 3's numerics: norms around both blocks with a scale of 1 + w, embeddings times
  sqrt(hidden), scores scaled by query_pre_attn_scalar ** -0.5, scores and logits soft-capped
  (Gemma 2)."""
  if model_type not in ("gemma2", "gemma3_text"):
    return {}
  scalar = hf.get("query_pre_attn_scalar")
  return dict(sandwich_norms=True, norm_offset=1.0, embed_scale=float(hf["hidden_size"]) ** 0.5,
              query_scale=None if scalar is None else float(scalar) ** -0.5,
              attn_softcap=hf.get("attn_logit_softcapping") or None,
              final_softcap=hf.get("final_logit_softcapping") or None)


def _sliding_rope_theta(theta, window, full_theta, full_scaling: RopeScaling) -> float | None:
  """The sliding layers' own rotary base, or None where they rotate as the full layers do."""
  if theta is None or window is None:
    return None
  if float(theta) == float(full_theta) and full_scaling.rope_type == "default":
    return None
  return float(theta)


def _moe_options(hf: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
  """The experts of a Mixtral or Qwen3-MoE config (every layer sparse)."""
  if model_type not in ("mixtral", "qwen3_moe"):
    return {}
  if model_type == "qwen3_moe" and (hf.get("decoder_sparse_step", 1) != 1
                                    or hf.get("mlp_only_layers")):
    raise ValueError(f"{source}: dense layers among the sparse ones (decoder_sparse_step="
                     f"{hf.get('decoder_sparse_step')}, mlp_only_layers="
                     f"{hf.get('mlp_only_layers')}) are not supported")
  experts = hf.get("num_local_experts") or hf["num_experts"]  # transformers 5 / 4 names
  if model_type == "mixtral":
    return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
  return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
              moe_intermediate_size=hf["moe_intermediate_size"],
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
  """Builds a ModelConfig from the dict of a Hugging Face config.json.

  Rotary settings are read from `rope_theta` and `rope_scaling`, or from the `rope_parameters`
  that transformers 5 writes in their place (per layer type for Gemma 3). A `gemma3` checkpoint
  (image and text) gives its text tower's config.
  """
  if hf.get("model_type") == "gemma3" and "text_config" in hf:
    hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"],
          "model_type": "gemma3_text"}
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{source}: model_type {model_type!r} (architectures "
                     f"{hf.get('architectures')}) is not supported; expected one of "
                     f"{SUPPORTED_ARCHITECTURES}")
  if hf.get("mlp_bias"):
    raise ValueError(f"{source}: mlp_bias=true is not supported")
  try:
    num_heads = hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    sliding_theta = None
    if "full_attention" in params:  # transformers 5, rotary settings per layer type
      sliding_theta = params.get("sliding_attention", {}).get("rope_theta")
      params = params["full_attention"]
    elif model_type == "gemma3_text":
      sliding_theta = hf.get("rope_local_base_freq", 10000.0)
    rope = hf.get("rope_scaling") or params or None
    rope_theta = hf.get("rope_theta") or params.get("rope_theta") or (rope or {}).get(
        "rope_theta", 10000.0)
    partial = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
      raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported (rotary "
                       "embeddings over the whole head only)")
    window = _sliding_window(hf, model_type)
    scaling = _rope_scaling_from_hf(rope, source)
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
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        sliding_window=window,
        layer_types=_layer_types(hf, model_type, window),
        hidden_act=_activation(hf, source),
        **_gemma_options(hf, model_type),
        **_moe_options(hf, model_type, source),
        sliding_rope_theta=_sliding_rope_theta(sliding_theta, window, rope_theta, scaling),
    )
  except KeyError as e:
    raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
