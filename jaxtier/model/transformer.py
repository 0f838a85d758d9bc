"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) in Flax NNX, with layers stacked
along a leading axis. The families differ only by `ModelConfig` options: q/k/v biases
(`attention_bias`), per-head q/k norms (`qk_norm`); Phi-3's fused checkpoint projections are split
on load (`jaxtier.checkpoint.hf`).

The forward pass embeds tokens, scans the stacked decoder layers with `jax.lax.scan`, and projects to
the vocabulary. The KV cache is an explicit argument (any object with `update_and_attend`, see
`jaxtier.kvcache`), and so are the token positions: prefill and decode are one function called with
different shapes.

Shape legend: b batch, t tokens, h hidden size, n query heads, k kv heads, d head dim, v vocab,
l layers, f MLP width.
"""

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtier.kernels.cpu import library as cpu_kernels, matmul
from jaxtier.model import moe, quant
from jaxtier.model.config import ModelConfig
from jaxtier.model.rotary import apply_rotary, rotary_tables
from jaxtier.model.softcap import softcap


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32, scaled in the parameter dtype (as Hugging Face does)."""

  def __init__(self, dim: int, eps: float, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))  # [h]
    self.eps = eps

  def __call__(self, x):
    return matmul.rms_norm(x, self.scale[...], self.eps)


NO_WINDOW = 1 << 30  # a window no context reaches: full attention for a layer of a mixed model


def layer_window(windows: tuple[int | None, ...] | None, layer) -> jax.Array | int | None:
  """The sliding window of `layer` (an int, or traced inside a scan) from a model's per-layer
  `windows`: None where no layer has one; a constant where all share it; else looked up."""
  if windows is None:
    return None
  if len(set(windows)) == 1 and windows[0] is not None:
    return windows[0]
  table = np.array([NO_WINDOW if w is None else w for w in windows], np.int32)
  return jnp.asarray(table)[layer]


def scale_embeddings(config: ModelConfig, x_bth: jax.Array) -> jax.Array:
  """Embeddings times the family's `embed_scale` (Gemma: sqrt(hidden), in the activations'
  dtype as Hugging Face rounds it)."""
  if config.embed_scale == 1.0:
    return x_bth
  return x_bth * jnp.asarray(config.embed_scale, x_bth.dtype)


def softcap_logits(config: ModelConfig, logits: jax.Array) -> jax.Array:
  """The LM head's logits soft-capped where the family caps them (`final_softcap`)."""
  return softcap(logits, config.final_softcap)


def layer_rotary(ropes: tuple[int, ...] | None, cos, sin, layer):
  """The rotary tables of `layer`: the model's [b, t, d] tables, or where its layers rotate
  differently (`ModelConfig.layer_ropes`), row ropes[layer] of its [r, b, t, d] tables."""
  if ropes is None:
    return cos, sin
  row = jnp.asarray(np.array(ropes, np.int32))[layer]
  return (jax.lax.dynamic_index_in_dim(cos, row, keepdims=False),
          jax.lax.dynamic_index_in_dim(sin, row, keepdims=False))


class QLinear(nnx.Module):
  """A linear layer whose kernel [in, out] is held compact (`jaxtier.model.quant`): `values`,
  `scales` and, where the format has them, `mins` and `perm`; `bias` as nn.Linear's. x @ kernel is
  `quant.qmatmul`, the dequantization fused into the dot."""

  def __init__(self, in_features: int, out_features: int, fmt: quant.WeightFormat, use_bias: bool,
               dtype):
    shapes = fmt.shapes(in_features, out_features)
    self.values = nnx.Param(jnp.zeros(shapes["values"].shape, shapes["values"].dtype))
    self.scales = nnx.Param(jnp.ones(shapes["scales"].shape, shapes["scales"].dtype))
    self.mins = (nnx.Param(jnp.zeros(shapes["mins"].shape, shapes["mins"].dtype))
                 if fmt.mins else None)
    self.perm = (nnx.Param(jnp.arange(in_features, dtype=jnp.int32)) if fmt.perm else None)
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

  def __call__(self, x):
    y = quant.qmatmul(x, self.values[...], self.scales[...],
                      None if self.mins is None else self.mins[...],
                      None if self.perm is None else self.perm[...])
    return y if self.bias is None else y + self.bias[...]


class QExperts(nnx.Module):
  """A mixture of experts' stacked projection [e, in, out] held compact: each expert's kernel in
  `fmt` (`jaxtier.model.quant`), its parts (`values`, `scales`, and `mins`, `perm` where the
  format has them) stacked on a leading expert axis. `expert_weights` dequantizes them for the
  grouped matmul, so they are compact in memory and over the host link, and float only inside
  the step that multiplies them."""

  def __init__(self, experts: int, in_features: int, out_features: int,
               fmt: quant.WeightFormat):
    for name, spec in fmt.shapes(in_features, out_features).items():
      setattr(self, name, nnx.Param(jnp.zeros((experts,) + spec.shape, spec.dtype)))
    for name in quant.PARTS:
      if name not in fmt.shapes(in_features, out_features):
        setattr(self, name, None)


def expert_weights(held, dtype) -> jax.Array:
  """A stacked expert projection [..., e, in, out] in `dtype`: a float parameter or array as it
  is, a `QExperts` (or its parts as a dict) dequantized, act-order rows put back in order."""
  if isinstance(held, QExperts):
    held = {name: getattr(held, name)[...] for name in quant.PARTS
            if getattr(held, name) is not None}
  if not isinstance(held, dict):
    return (held[...] if isinstance(held, nnx.Variable) else held).astype(dtype)
  w = quant.dequantize(held["values"], held["scales"], held.get("mins"), dtype)
  if held.get("perm") is not None:  # row j holds input row perm[j]: undo per expert
    w = jnp.take_along_axis(w, jnp.argsort(held["perm"], axis=-1)[..., None], axis=-2)
  return w


class CompactTable(nnx.Module):
  """A vocabulary table held compact for the LM head (`jaxtier.model.quant`, [hidden, vocab]: a GGUF
  file's blocks of the table): logits are `quant.qmatmul`, and where the table is tied the
  embedding lookup dequantizes the tokens' columns (`quant.columns`) into `dtype`."""

  def __init__(self, values, scales, mins=None, dtype=jnp.float32):
    self.values, self.scales = nnx.Param(values), nnx.Param(scales)
    self.mins = None if mins is None else nnx.Param(mins)
    self.dtype = jnp.dtype(dtype).name

  def _parts(self):
    return self.values[...], self.scales[...], None if self.mins is None else self.mins[...]

  def rows(self, tokens):
    return quant.columns(*self._parts(), tokens, jnp.dtype(self.dtype))

  def logits(self, h):
    return quant.qmatmul(h, *self._parts())


class DecoderLayer(nnx.Module):
  """Pre-norm attention block and gated MLP block (SwiGLU, or GeGLU for Gemma); with `qk_norm`,
  q and k are RMS-normed per head (`q_norm`, `k_norm` over the head dim) before the rotary
  embedding; with sandwich norms (Gemma), each block's output is normed again before its
  residual add (`post_attn_norm`, `post_mlp_norm`). Sliding windows, the attention scale and
  the scores' soft cap are static options (`_set_options`). `weights` holds the named projections
  compact ({"q_proj": `quant.WeightFormat`, ...}: `QLinear`; a mixture of experts'
  "expert_gate", "expert_up", "expert_down": `QExperts`), the others as float `nnx.Linear`."""

  def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs,
               weights: Mapping[str, quant.WeightFormat] | None = None):
    c = config
    h, n, k, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    weights = dict(weights or {})

    def linear(name, i, o, bias=False):
      if name in weights:
        return QLinear(i, o, weights.pop(name), bias, dtype)
      return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                        kernel_init=nnx.initializers.normal(0.02))

    self.attn_norm = RMSNorm(h, c.rms_norm_eps, dtype)
    self.q_proj = linear("q_proj", h, n * d, c.attention_bias)
    self.k_proj = linear("k_proj", h, k * d, c.attention_bias)
    self.v_proj = linear("v_proj", h, k * d, c.attention_bias)
    self.o_proj = linear("o_proj", n * d, h)
    self.mlp_norm = RMSNorm(h, c.rms_norm_eps, dtype)
    self.experts = c.num_experts_per_tok if c.num_experts else None  # static: k, or dense
    self.normalize_topk = c.norm_topk_prob
    if c.num_experts:  # router [h, e]; each expert's projections stacked: [e, in, out]
      e, fe = c.num_experts, c.moe_intermediate_size
      init = nnx.initializers.normal(0.02)
      self.router = nnx.Param(init(rngs.params(), (h, e), dtype))

      def experts(name, i, o):
        if name in weights:
          return QExperts(e, i, o, weights.pop(name))
        return nnx.Param(init(rngs.params(), (e, i, o), dtype))

      self.expert_gate = experts("expert_gate", h, fe)
      self.expert_up = experts("expert_up", h, fe)
      self.expert_down = experts("expert_down", fe, h)
    else:
      self.gate_proj = linear("gate_proj", h, f)
      self.up_proj = linear("up_proj", h, f)
      self.down_proj = linear("down_proj", f, h)
    if weights:
      raise ValueError(f"compact weights for {sorted(weights)}: this layer has no such "
                       "projections")
    self.q_norm = RMSNorm(d, c.rms_norm_eps, dtype) if c.qk_norm else None
    self.k_norm = RMSNorm(d, c.rms_norm_eps, dtype) if c.qk_norm else None
    self.post_attn_norm = RMSNorm(h, c.rms_norm_eps, dtype) if c.sandwich_norms else None
    self.post_mlp_norm = RMSNorm(h, c.rms_norm_eps, dtype) if c.sandwich_norms else None
    self.shape = (n, k, d)
    self._set_options(c.layer_windows(), c.hidden_act,
                      None if c.query_scale is None else c.query_scale / d ** -0.5, c.attn_softcap,
                      c.layer_ropes())

  def _set_options(self, windows, act: str, q_scale: float | None, softcap: float | None,
                   ropes: tuple[int, ...] | None):
    """The layer's static options: each layer's sliding window (or None), the MLP's activation,
    the factor on q that turns the attention's head_dim ** -0.5 into the family's scale (None:
    1), the attention scores' soft cap (None: none), and each layer's rotary table (None: the
    model has one)."""
    self.windows, self.act, self.q_scale, self.softcap = windows, act, q_scale, softcap
    self.ropes = ropes

  def project_qkv(self, y_bth):
    return self.q_proj(y_bth), self.k_proj(y_bth), self.v_proj(y_bth)

  def normed_qkv(self, x_bth):
    """q, k and v of the attention block: its norm, then `project_qkv`."""
    return self.project_qkv(self.attn_norm(x_bth))

  def rotated_qkv(self, x_bth, cos_btd, sin_btd):
    """q [b, t, n, d], k and v [b, t, k, d] of the attention block: `normed_qkv`, the per-head
    q/k norms where the model has them, then the rotary embedding of q and k."""
    n, k, d = self.shape
    b, t, _ = x_bth.shape
    q, k_new, v_new = self.normed_qkv(x_bth)
    q_btnd, k_btkd = q.reshape(b, t, n, d), k_new.reshape(b, t, k, d)
    if self.q_norm is not None:
      q_btnd, k_btkd = self.q_norm(q_btnd), self.k_norm(k_btkd)
    return (apply_rotary(q_btnd, cos_btd, sin_btd), apply_rotary(k_btkd, cos_btd, sin_btd),
            v_new.reshape(b, t, k, d))

  def normed_gate_up(self, x_bth):
    """gate and up of the MLP block: its norm, then `project_gate_up`."""
    return self.project_gate_up(self.mlp_norm(x_bth))

  def project_gate_up(self, y_bth):
    return self.gate_proj(y_bth), self.up_proj(y_bth)

  def mlp(self, x_bth):
    """The MLP block's output before its post-norm (where the family has one) and the residual
    add: down(act(gate) * up) of the normed x, act SiLU or GELU (tanh form), or the mixture of
    experts (`moe`)."""
    if self.experts is not None:
      return self.moe(x_bth)
    gate, up = self.normed_gate_up(x_bth)
    act = jax.nn.silu(gate) if self.act == "silu" else jax.nn.gelu(gate, approximate=True)
    return self.project_down(act * up)

  def moe(self, x_bth, experts=None):
    """The mixture-of-experts MLP block of the normed x: the router's top k (`moe.route`), then
    the routed experts as a grouped matmul (`moe.grouped_experts`), or as `experts(x_nh,
    weights_nk, experts_nk) -> [n, h]` computes them where given (experts held elsewhere: see
    `jaxtier.offload.experts`; the layer's own expert parameters are then not read)."""
    b, t, h = x_bth.shape
    y_nh = self.mlp_norm(x_bth).reshape(b * t, h)
    weights_nk, experts_nk = moe.route(y_nh @ self.router[...], self.experts, self.normalize_topk)
    if experts is not None:
      return experts(y_nh, weights_nk, experts_nk).reshape(b, t, h)
    out_nh = moe.grouped_experts(y_nh, weights_nk, experts_nk,
                                 *(expert_weights(w, y_nh.dtype) for w in (
                                     self.expert_gate, self.expert_up, self.expert_down)),
                                 self.act)
    return out_nh.reshape(b, t, h)

  def project_out(self, attn_btf):
    return self.o_proj(attn_btf)

  def project_down(self, h_btf):
    return self.down_proj(h_btf)

  def __call__(self, x_bth, cos_btd, sin_btd, cache, layer, pos_bt, meta, experts=None):
    """One layer over x [b, t, h]; `experts` computes a mixture of experts' routed experts
    instead of the layer (see `moe`)."""
    n, k, d = self.shape
    b, t, _ = x_bth.shape
    with jax.named_scope("attention"):
      cos_btd, sin_btd = layer_rotary(self.ropes, cos_btd, sin_btd, layer)
      q_btnd, k_btkd, v_btkd = self.rotated_qkv(x_bth, cos_btd, sin_btd)
      if self.q_scale is not None:
        q_btnd = q_btnd * jnp.asarray(self.q_scale, q_btnd.dtype)
      cache, attn_btnd = cache.update_and_attend(layer, q_btnd, k_btkd, v_btkd, pos_bt, meta,
                                                 layer_window(self.windows, layer), self.softcap)
      out_bth = self.project_out(attn_btnd.reshape(b, t, n * d))
      if self.post_attn_norm is not None:
        out_bth = self.post_attn_norm(out_bth)
      x_bth = x_bth + out_bth
    with jax.named_scope("mlp"):
      out_bth = self.mlp(x_bth) if experts is None else self.moe(x_bth, experts)
      if self.post_mlp_norm is not None:
        out_bth = self.post_mlp_norm(out_bth)
      x_bth = x_bth + out_bth
    return x_bth, cache


class FusedDecoderLayer(DecoderLayer):
  """A DecoderLayer with its q/k/v and gate/up kernels concatenated: the same arithmetic in three
  fewer matmuls per layer, which matters where each matmul is a separate kernel call (CPU decode).

  `packed` stores the four kernels in column panels (`jaxtier.kernels.cpu.matmul`) and multiplies
  with the CPU kernel, which streams them once per step at the batch sizes of decoding; the q/k/v
  and gate/up products take their pre-norm in the same call (`matmul.norm_packed_matmul`), q/k/v its
  bias and rotary embedding too (`matmul.norm_rope_packed_matmul`; with per-head q/k norms, which
  the kernel does not apply, the rotary embedding runs after them in XLA), and the down projection
  its SwiGLU gating (`matmul.glu_packed_matmul`). The default packs float32 layers built for CPU
  when the kernel is available (`jaxtier.kernels.cpu.library`) and every kernel's width is a
  multiple of the panel width (no padding, so the same bytes), and keeps the [in, out] layout
  elsewhere. `formats` keeps the named kernels packed in a block format instead ({kernel: "q4_1",
  "q8_0" or "q8_16"}, `matmul.pack_blocks`: 0.75, 1.125 or 1.5 bytes a weight against 4), the others
  float32 panels: the loader builds such layers and fills them with a checkpoint's own blocks
  (`jaxtier.checkpoint.placed`), whose products are then bit for bit those of the float32 panels of
  the dequantized weights (built from a float layer, the kernels are quantized:
  `matmul.quantize_blocks`). `activations="int16"` lays the blocks out to multiply x quantized to
  int16 per block instead (faster; `matmul.pack_q4_1`).
  """

  # Each fused parameter is its parts' parameters concatenated along the last (output) axis.
  PARTS = {
      "qkv_kernel": (("q_proj", "kernel"), ("k_proj", "kernel"), ("v_proj", "kernel")),
      "qkv_bias": (("q_proj", "bias"), ("k_proj", "bias"), ("v_proj", "bias")),
      "gate_up_kernel": (("gate_proj", "kernel"), ("up_proj", "kernel")),
      "o_kernel": (("o_proj", "kernel"),),
      "down_kernel": (("down_proj", "kernel"),),
  }
  KERNELS = ("qkv_kernel", "gate_up_kernel", "o_kernel", "down_kernel")  # packed when `packed`

  # pylint: disable-next=super-init-not-called
  def __init__(self, layer: DecoderLayer, packed: bool | None = None,
               activations: str = "float32", formats: Mapping[str, str] | None = None):
    self.shape = layer.shape
    self._set_options(layer.windows, layer.act, layer.q_scale, layer.softcap, layer.ropes)
    self.experts = None  # only dense layers are fused (`fuses`)
    self.attn_norm, self.mlp_norm = layer.attn_norm, layer.mlp_norm
    self.post_attn_norm, self.post_mlp_norm = layer.post_attn_norm, layer.post_mlp_norm
    self.q_norm, self.k_norm = layer.q_norm, layer.k_norm
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    kernels = {
        "qkv_kernel": jnp.concatenate([p.kernel[...] for p in projections], axis=1),
        "gate_up_kernel": jnp.concatenate([layer.gate_proj.kernel[...], layer.up_proj.kernel[...]],
                                          axis=1),
        "o_kernel": layer.o_proj.kernel[...],
        "down_kernel": layer.down_proj.kernel[...],
    }
    if packed is None:  # by default only where packing adds no padding: the same bytes
      packed = (packs_by_default(kernels["qkv_kernel"].dtype)
                and matmul.packs_exactly(*(w.shape[-1] for w in kernels.values())))
    self.packed = packed
    blocks = dict(formats or {})
    if set(blocks) - set(self.KERNELS):
      raise ValueError(f"formats name kernels {sorted(set(blocks) - set(self.KERNELS))}; "
                       f"the layer's kernels are {self.KERNELS}")
    if set(blocks.values()) - set(matmul.BLOCK_FORMATS):
      raise ValueError(f"formats {formats}: expected block formats among {matmul.BLOCK_FORMATS}")
    if blocks and not (packed and all(kernels[name].shape[0] % matmul.QUANT_BLOCK == 0
                                      for name in blocks)):
      raise ValueError("kernels kept in blocks must be packed and have input widths that are "
                       f"multiples of {matmul.QUANT_BLOCK}; got packed={packed}, input widths "
                       f"{[kernels[name].shape[0] for name in sorted(blocks)]}")
    self.widths = tuple((name, w.shape[-1]) for name, w in kernels.items())  # before packing
    for name, w in kernels.items():
      if name in blocks:
        w = matmul.pack_blocks(blocks[name], matmul.quantize_blocks(blocks[name], w), activations)
      elif self.packed:
        w = matmul.pack(w)
      setattr(self, name, nnx.Param(w))
    self.qkv_bias = (nnx.Param(jnp.concatenate([p.bias[...] for p in projections]))
                     if layer.q_proj.bias is not None else None)

  def _matmul(self, y, name: str):
    kernel = getattr(self, name)[...]
    return matmul.packed_matmul(y, kernel, dict(self.widths)[name]) if self.packed else y @ kernel

  def _normed_matmul(self, x, norm: RMSNorm, name: str):
    """norm(x) @ the named kernel; packed, in one kernel call (`matmul.norm_packed_matmul`)."""
    if not self.packed:
      return self._matmul(norm(x), name)
    return matmul.norm_packed_matmul(x, norm.scale[...], getattr(self, name)[...],
                                     dict(self.widths)[name], norm.eps)

  def _split_qkv(self, qkv):
    n, k, d = self.shape
    if self.qkv_bias is not None:
      qkv = qkv + self.qkv_bias[...]
    return qkv[..., :n * d], qkv[..., n * d:(n + k) * d], qkv[..., (n + k) * d:]

  @staticmethod
  def _split_gate_up(gate_up):
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]

  def project_qkv(self, y_bth):
    return self._split_qkv(self._matmul(y_bth, "qkv_kernel"))

  def normed_qkv(self, x_bth):
    return self._split_qkv(self._normed_matmul(x_bth, self.attn_norm, "qkv_kernel"))

  def rotated_qkv(self, x_bth, cos_btd, sin_btd):
    """Packed: the bias and rotary embedding in the projection's kernel call
    (`matmul.norm_rope_packed_matmul`), except with q/k norms, which come between them."""
    if not self.packed or self.q_norm is not None:
      return super().rotated_qkv(x_bth, cos_btd, sin_btd)
    n, k, d = self.shape
    b, t, _ = x_bth.shape
    qkv = matmul.norm_rope_packed_matmul(
        x_bth, self.attn_norm.scale[...], self.qkv_kernel[...], dict(self.widths)["qkv_kernel"],
        self.attn_norm.eps, None if self.qkv_bias is None else self.qkv_bias[...], cos_btd,
        sin_btd, (n + k) * d)
    return (qkv[..., :n * d].reshape(b, t, n, d), qkv[..., n * d:(n + k) * d].reshape(b, t, k, d),
            qkv[..., (n + k) * d:].reshape(b, t, k, d))

  def project_gate_up(self, y_bth):
    return self._split_gate_up(self._matmul(y_bth, "gate_up_kernel"))

  def mlp(self, x_bth):
    """Packed: the SiLU gating in the down projection's kernel call
    (`matmul.glu_packed_matmul`); another activation gates in XLA."""
    if not self.packed or self.act != "silu":
      return super().mlp(x_bth)
    gate_up = self._normed_matmul(x_bth, self.mlp_norm, "gate_up_kernel")
    down = self.down_kernel[...]
    return matmul.glu_packed_matmul(gate_up, down, dict(self.widths)["down_kernel"])

  def normed_gate_up(self, x_bth):
    return self._split_gate_up(self._normed_matmul(x_bth, self.mlp_norm, "gate_up_kernel"))

  def project_out(self, attn_btf):
    return self._matmul(attn_btf, "o_kernel")

  def project_down(self, h_btf):
    return self._matmul(h_btf, "down_kernel")


def fuses(layer) -> bool:
  """Whether `UnrolledLayers` holds `layer` fused: a plain dense `DecoderLayer` (a mixture of
  experts, and compact projections (`QLinear`), keep their layer as it is)."""
  return (type(layer) is DecoderLayer and layer.experts is None
          and isinstance(layer.q_proj, nnx.Linear))


def packs_by_default(dtype) -> bool:
  """Whether fused layers of `dtype` are packed by default: float32 on a CPU backend with the CPU
  kernels built."""
  return (jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu"
          and cpu_kernels.available())


def make_layer_stack(config: ModelConfig, dtype, rngs: nnx.Rngs, num: int | None = None,
                     weights: Mapping[str, quant.WeightFormat] | None = None) -> DecoderLayer:
  """A DecoderLayer whose every parameter has a leading [num] axis (default: all the model's
  layers), its `weights` projections compact (`DecoderLayer`). A stack of part of the layers
  keeps the model's per-layer options (windows, rotary tables), which the layers look up by their
  index in the whole model."""
  num = config.num_layers if num is None else num

  @nnx.split_rngs(splits=num)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num)
  def create(rngs):
    return DecoderLayer(config, dtype, rngs, weights)

  return create(rngs)


def scan_layers(graphdef: nnx.GraphDef, stacked_state: nnx.State, x_bth, cos_btd, sin_btd, cache,
                pos_bt, meta, first_layer: int = 0):
  """Runs a stack of layers (state with a leading layer axis) with `lax.scan`.

  `first_layer` is the global index of the stack's first layer: the cache is indexed globally, so a
  model split into several stacks (resident head, offloaded tail) writes the right cache layers.
  """
  num = jax.tree_util.tree_leaves(stacked_state)[0].shape[0]

  def body(carry, xs):
    x, cache = carry
    layer_state, layer = xs
    x, cache = nnx.merge(graphdef, layer_state)(x, cos_btd, sin_btd, cache, layer, pos_bt, meta)
    return (x, cache), None

  layers = jnp.arange(first_layer, first_layer + num, dtype=jnp.int32)
  (x_bth, cache), _ = jax.lax.scan(body, (x_bth, cache), (stacked_state, layers))
  return x_bth, cache


class Transformer(nnx.Module):
  """Token embedding, a stack of decoder layers, final norm and LM head (tied or not)."""

  def __init__(self, config: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
               table_dtype=None):
    """`table_dtype`: the embedding and LM head tables' parameter dtype (default `dtype`; a
    quantized float32 model keeps them in bfloat16), computed with in `dtype`."""
    self.config = config
    table_dtype = dtype if table_dtype is None else table_dtype
    self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                           param_dtype=table_dtype,
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = make_layer_stack(config, dtype, rngs)
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(
          rngs.params(), (config.vocab_size, config.hidden_size), table_dtype))  # [v, h]
    self.inv_freq = nnx.Variable(jnp.asarray(config.inv_freq()))  # [d // 2]

  def hidden_states(self, tokens_bt: jax.Array, pos_bt: jax.Array, cache, meta: Any = None):
    """Final-norm hidden states [b, t, h] and the updated cache."""
    x_bth = self.embed_tokens(tokens_bt)
    cos_btd, sin_btd = rotary_tables(self.inv_freq[...], pos_bt)
    x_bth, cache = self.run_layers(x_bth, cos_btd, sin_btd, cache, pos_bt, meta)
    return self.final_norm(x_bth), cache

  def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
    """Token embeddings [b, t, h] (times the family's `embed_scale`)."""
    return scale_embeddings(self.config, self.embed(tokens_bt))

  def run_layers(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    """All decoder layers: one `lax.scan` over the stacked layers."""
    graphdef, stacked = nnx.split(self.layers)
    return scan_layers(graphdef, stacked, x_bth, cos_btd, sin_btd, cache, pos_bt, meta)

  def logits(self, h_bth: jax.Array) -> jax.Array:
    """Vocabulary logits [..., v] for hidden states [..., h]."""
    table_vh = self.embed.embedding[...] if self.config.tie_word_embeddings else self.lm_head[...]
    return softcap_logits(self.config, jnp.einsum("...h,vh->...v", h_bth, table_vh))

  def __call__(self, tokens_bt: jax.Array, pos_bt: jax.Array, cache, meta: Any = None):
    """Logits [b, t, v] for every token, and the updated cache."""
    h_bth, cache = self.hidden_states(tokens_bt, pos_bt, cache, meta)
    return self.logits(h_bth), cache


class LayerStack(nnx.Module):
  """Layers [first, first + n) with parameters stacked on a leading axis, run by `lax.scan`."""

  def __init__(self, layers: DecoderLayer, first: int):
    self.layers = layers
    self.first = first

  @property
  def num_layers(self) -> int:
    return jax.tree_util.tree_leaves(nnx.state(self.layers))[0].shape[0]

  def __call__(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    graphdef, stacked = nnx.split(self.layers)
    return scan_layers(graphdef, stacked, x_bth, cos_btd, sin_btd, cache, pos_bt, meta, self.first)


class UnrolledLayers(nnx.Module):
  """Layers [first, first + n) as separate per-layer buffers, run one after another.

  XLA on CPU copies the slice of stacked weights that each scan iteration reads, so for resident
  layers this form moves a third of the bytes a scan does; on GPU and TPU the scan needs no copy.
  With `fused` the layers are held fused (`FusedDecoderLayer`, layers given fused already are kept):
  fewer, larger matmuls per step. Tensor-parallel models are not fused (see
  `jaxtier.model.sharding`).
  """

  def __init__(self, layers: list[DecoderLayer], first: int, fused: bool = True):
    self.layers = nnx.List([FusedDecoderLayer(layer) if fused and fuses(layer) else layer
                            for layer in layers])
    self.first = first

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def __call__(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    for i, layer in enumerate(self.layers):
      graphdef, state = nnx.split(layer)
      x_bth, cache = _unrolled_layer(graphdef, state, x_bth, cos_btd, sin_btd, cache,
                                     jnp.int32(self.first + i), pos_bt, meta)
    return x_bth, cache


@functools.partial(jax.jit, static_argnums=0)
def _unrolled_layer(graphdef, state, x_bth, cos_btd, sin_btd, cache, layer, pos_bt, meta):
  """One unrolled layer, as its own function: layers of one structure (and the layer index a
  value) share one trace and one lowered function, which a program calls once per layer. XLA
  inlines the calls, so the program runs as before; tracing and lowering 30 layers cost about one.
  (A program with a warm persistent cache spent most of its start-up tracing the layers.)"""
  return nnx.merge(graphdef, state)(x_bth, cos_btd, sin_btd, cache, layer, pos_bt, meta)


def _layer_slice(model: Transformer, start: int, stop: int) -> DecoderLayer:
  graphdef, stacked = nnx.split(model.layers)
  return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a[start:stop], stacked))


def _single_layer(model: Transformer, index: int) -> DecoderLayer:
  graphdef, stacked = nnx.split(model.layers)
  return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a[index], stacked))


class GroupedTransformer(Transformer):
  """The same model with its layers split into consecutive groups, each scanned or unrolled.

  `groups` is a sequence of (num_layers, mode) covering all layers in order; mode is "scan",
  "unrolled" or a factory `(stacked_layers, first) -> group` for another group kind (for example
  `jaxtier.offload.tail_group(depth)`), where `stacked_layers` is a DecoderLayer with a leading
  [num_layers] axis and the group is called like `LayerStack`; or a group module already built
  (`jaxtier.checkpoint.placed` builds every group straight from the checkpoint). The parameters are
  copied out of the stacked model; outputs equal the stacked model's. `model` needs only `config`,
  `embed`, `final_norm`, `inv_freq` (and `lm_head` unless tied), plus `layers` for the groups it
  slices.

  With `fused`, where fused layers pack (`packs_by_default`) and the vocabulary is a multiple of
  the panel width P, the LM head is packed too (`packed_head`, [v / P, h, P],
  `jaxtier.kernels.cpu.matmul`): XLA:CPU's product with the [v, h] table at decode's few rows falls
  well short of the bandwidth. A tied table is then held only packed, and embedding a token gathers
  its column of the panels. `model` may bring `packed_head` already packed (the loader packs a
  checkpoint's Q4_1 or Q8_0 blocks, `jaxtier.kernels.cpu.matmul`); then `embed` is needed only
  untied. Or `compact_head`, a `CompactTable` of the table's blocks (what stacked layers keep: the
  portable path), held and used the same way.
  """

  def __init__(self, model: Transformer, groups, fused: bool = True):
    sizes = [n for n, _ in groups]
    if not sizes or sum(sizes) != model.config.num_layers or min(sizes) < 1:
      raise ValueError(f"layer groups {list(groups)} must have positive sizes adding up to "
                       f"num_layers={model.config.num_layers}")
    self.config = model.config
    self.final_norm, self.inv_freq = model.final_norm, model.inv_freq
    tied = model.config.tie_word_embeddings
    packed = getattr(model, "packed_head", None)  # a loader's, packed from a table's blocks
    self.compact_head = getattr(model, "compact_head", None)  # a loader's, a table's blocks
    if self.compact_head is not None:
      self.packed_head = None
    elif packed is not None:
      self.packed_head = nnx.Param(packed)
    else:
      table_vh = model.embed.embedding if tied else model.lm_head
      self.packed_head = (nnx.Param(matmul.pack(table_vh[...].T))
                          if fused and packs_by_default(table_vh.dtype)
                          and matmul.packs_exactly(model.config.vocab_size) else None)
    held = self.packed_head is not None or self.compact_head is not None
    if not (tied and held):
      self.embed = model.embed
    if not tied and not held:
      self.lm_head = model.lm_head
    parts, first = [], 0
    for n, mode in groups:
      if isinstance(mode, nnx.Module):
        parts.append(mode)
      elif mode == "scan":
        parts.append(LayerStack(_layer_slice(model, first, first + n), first))
      elif mode == "unrolled":
        parts.append(UnrolledLayers([_single_layer(model, i) for i in range(first, first + n)],
                                    first, fused))
      elif callable(mode):
        parts.append(mode(_layer_slice(model, first, first + n), first))
      else:
        raise ValueError(f"layer group mode {mode!r} is not supported; expected 'scan', "
                         "'unrolled', a group factory or a group module")
      first += n
    self.groups = nnx.List(parts)

  def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
    if self.config.tie_word_embeddings and self.compact_head is not None:
      return scale_embeddings(self.config, self.compact_head.rows(tokens_bt))
    if self.config.tie_word_embeddings and self.packed_head is not None:
      return scale_embeddings(self.config,
                              matmul.packed_columns(self.packed_head[...], tokens_bt))
    return super().embed_tokens(tokens_bt)

  def logits(self, h_bth: jax.Array) -> jax.Array:
    if self.compact_head is not None:
      return softcap_logits(self.config, self.compact_head.logits(h_bth))
    if self.packed_head is not None:
      return softcap_logits(self.config, matmul.packed_matmul(h_bth, self.packed_head[...],
                                                              self.config.vocab_size))
    return super().logits(h_bth)

  def run_layers(self, x_bth, cos_btd, sin_btd, cache, pos_bt, meta):
    for group in self.groups:
      x_bth, cache = group(x_bth, cos_btd, sin_btd, cache, pos_bt, meta)
    return x_bth, cache
