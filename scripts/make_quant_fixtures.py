"""Regenerates the pre-quantized checkpoint fixtures under tests/fixtures/quantized (needs
`pip install -e .[ref] compressed-tensors`; the test suite reads only the files).

One tiny random Llama (hidden 128, MLP 256, 2 layers, 4 heads of 32, 2 KV heads, tied
embeddings, tiny_llama's tokenizer) quantized in each format, its projections alone (the
embedding and norms stay float16 / bfloat16, as the quantizers leave them):

  ct_w4a16         compressed-tensors pack-quantized: int4, symmetric, groups of 128 (W4A16)
  ct_w4a16_asym    ... int4 with zero points, groups of 32 (W4A16_ASYM)
  ct_w8a16         ... int8, symmetric, one scale per output channel (W8A16)
  ct_w8a16_asym    ... int8 with zero points (packed), groups of 64
  ct_w8a8          int-quantized: int8 per channel, activations int8 dynamic per token (W8A8)
  ct_fp8_dynamic   float-quantized: FP8 per channel, activations FP8 dynamic per token (FP8_DYNAMIC)
  ct_fp8_tensor    FP8 with one scale per tensor and static activation scales (FP8)
  gptq_4bit        GPTQ, 4-bit, groups of 128, symmetric, no desc_act ("gptq" checkpoint format)
  gptq_act_order   GPTQ, 4-bit, groups of 32, zero points, desc_act (act-order `g_idx`)
  gptq_8bit        GPTQ, 8-bit, groups of 64, zero points
  gptq_v2          GPTQ, 4-bit, groups of 64, zero points (one of them 0), "gptq_v2" checkpoint
                   format (zero points stored as they are)
  awq_4bit         AWQ GEMM, 4-bit, groups of 64, zero points
  gptq_moe         tests/fixtures/tiny_qwen3_moe in GPTQ 4-bit, groups of 32, zero points (its
                   experts and attention; the router float)
  gptq_phi3        tests/fixtures/tiny_phi3 in GPTQ 4-bit, groups of 32, symmetric (its fused
                   qkv_proj and gate_up_proj quantized whole, as GPTQ quantizes Phi-3)

compressed-tensors' are packed by the library itself (`PackedQuantizationCompressor`,
`IntQuantizationCompressor`, `FloatQuantizationCompressor`, scales and zero points from its
`calculate_qparams`, `quantization_config` from its `QuantizationConfig`). GPTQ and AWQ are packed
here as AutoGPTQ's `QuantLinear.pack` and AutoAWQ's `WQLinear_GEMM.from_linear` pack (fields low
bits first; GPTQ's qweight along the input rows, its qzeros along the columns, zero points minus
one; AWQ's both along the columns in the order 0, 2, 4, 6, 1, 3, 5, 7), and each tensor written is
checked first against the libraries' unpacking as tests/quant_reference.py ports it.
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
from absl import app, flags
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import quant_reference  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                        "quantized"), "fixture directory")
TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tiny_llama")
HIDDEN, MLP, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 2, 4, 2, 32, 300
PROJECTIONS = {  # HF name -> (out, in)
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (MLP, HIDDEN),
    "mlp.up_proj": (MLP, HIDDEN),
    "mlp.down_proj": (HIDDEN, MLP),
}


def config(dtype: str, quantization: dict) -> dict:
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
      "hidden_size": HIDDEN, "intermediate_size": MLP, "num_hidden_layers": LAYERS,
      "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
      "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False,
      "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype,
      "quantization_config": quantization,
  }


def float_model(seed: int = 0) -> dict[str, torch.Tensor]:
  """The float model's tensors (float32) in HF naming, projections [out, in]."""
  rng = np.random.default_rng(seed)
  t = lambda *shape, scale=1.0: torch.tensor(rng.normal(0, scale, shape), dtype=torch.float32)
  out = {"model.embed_tokens.weight": t(VOCAB, HIDDEN, scale=0.5),
         "model.norm.weight": 1 + t(HIDDEN, scale=0.1)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = 1 + t(HIDDEN, scale=0.1)
    out[p + "post_attention_layernorm.weight"] = 1 + t(HIDDEN, scale=0.1)
    for name, (o, k) in PROJECTIONS.items():
      out[p + name + ".weight"] = t(o, k, scale=1 / np.sqrt(k))
  return out


def projections(tensors: dict) -> list[str]:
  """Every linear layer's module name (attention, MLP and experts' projections; not the
  router, `mlp.gate`)."""
  return sorted(k[:-len(".weight")] for k in tensors if k.endswith("proj.weight"))


def fixture_model(name: str) -> tuple[dict[str, torch.Tensor], dict, str]:
  """tests/fixtures/`name`'s tensors (float32), config and directory."""
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  directory = os.path.join(os.path.dirname(TOKENIZER), name)
  with open(os.path.join(directory, "config.json")) as f:
    raw = json.load(f)
  return load_file(os.path.join(directory, "model.safetensors")), raw, directory


def write(directory: str, tensors: dict, dtype: str, quantization: dict, base=None) -> None:
  """`base`: (config.json's dict, the directory of its tokenizer), default this script's Llama."""
  if os.path.isdir(directory):
    shutil.rmtree(directory)
  os.makedirs(directory)
  save_file({k: v.contiguous() for k, v in tensors.items()},
            os.path.join(directory, "model.safetensors"))
  raw, tokenizer = (config(dtype, quantization), TOKENIZER) if base is None else (
      {**base[0], "torch_dtype": dtype, "quantization_config": quantization}, base[1])
  raw.pop("dtype", None)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(raw, f, indent=2)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tokenizer, name), directory)
  size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
  assert size < 1 << 20, (directory, size)
  print(f"{directory}: {size / 1e3:.0f} kB", file=sys.stderr)


# -- compressed-tensors, by the library --

def compressed_tensors(directory: str, preset: str, fmt: str, strategy=None, group=None,
                       static_input: bool = False, symmetric: bool | None = None) -> None:
  # pylint: disable=import-outside-toplevel
  from compressed_tensors.compressors import BaseCompressor
  from compressed_tensors.quantization import QuantizationConfig
  from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
  from compressed_tensors.quantization.utils import calculate_qparams
  scheme = preset_name_to_scheme(preset, ["Linear"])
  updates = {k: v for k, v in (("strategy", strategy), ("group_size", group),
                                ("symmetric", symmetric)) if v is not None}
  if updates:
    scheme.weights = scheme.weights.model_copy(update=updates)
  compressor = BaseCompressor.load_from_registry(fmt)
  dtype = torch.bfloat16
  model = float_model()
  out = {k: v.to(dtype) for k, v in model.items() if not k.endswith("proj.weight")}
  reference = {}
  for prefix in projections(model):
    w = model[prefix + ".weight"].to(dtype)
    args = scheme.weights
    if args.strategy == "group":
      g = w.float().reshape(w.shape[0], -1, args.group_size)
      lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
      lo, hi = w.float().amin(-1, keepdim=True), w.float().amax(-1, keepdim=True)
    else:
      lo, hi = w.float().amin().reshape(1), w.float().amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale.to(dtype)}
    if not args.symmetric:
      state["weight_zero_point"] = torch.round(zero).to(torch.int8)
    if static_input:
      state["input_scale"] = torch.tensor([0.05], dtype=dtype)
    state = compressor.compress(state, scheme)
    for k, v in state.items():
      out[f"{prefix}.{k}"] = v
    # the library's own decompression: the weights these tensors stand for
    reference[prefix] = compressor.decompress(dict(state), scheme)["weight"]
  qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                               ignore=["lm_head"], quantization_status="compressed").model_dump()
  write(directory, out, "bfloat16", json.loads(json.dumps(qconfig, default=str)))
  # the numpy port (tests/quant_reference.py) equals the library's decompression
  written = quant_reference.read_safetensors(os.path.join(directory, "model.safetensors"))
  for prefix, w in reference.items():
    ours = torch.tensor(quant_reference.ct_dequantize(written, prefix)).to(w.dtype)
    assert torch.equal(ours, w), (directory, prefix)


# -- GPTQ and AWQ, packed as their libraries pack --

def pack_fields(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
  """Non-negative values < 2^bits packed 32 / bits to an int32 along `axis`, field i (bits
  i * bits up) holding element order[i] of each run (default: element i)."""
  per = 32 // bits
  v = np.moveaxis(values.astype(np.uint32), axis, -1)
  v = v.reshape(*v.shape[:-1], -1, per)
  order = np.arange(per) if order is None else np.asarray(order)
  words = np.zeros(v.shape[:-1], np.uint32)
  for i in range(per):
    words |= v[..., order[i]] << np.uint32(i * bits)
  return np.moveaxis(words.view(np.int32), -1, axis)


def minmax_groups(w: np.ndarray, rows_of_group: list[np.ndarray], bits: int, sym: bool):
  """GPTQ's and AWQ's min-max quantizer per group of input columns of w [out, in]: (scales
  float16 [G, out], zeros [G, out], q [in, out]), q = clamp(round(w / s) + z, 0, 2^bits - 1)
  against the float16 scale."""
  maxq = (1 << bits) - 1
  scales, zeros = [], []
  q = np.zeros(w.shape[::-1], np.int64)
  for cols in rows_of_group:
    x = w[:, cols]
    lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    if sym:
      hi = np.maximum(-lo, hi)
      lo = -hi
    s = ((hi - lo) / maxq).astype(np.float16).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1e-4)).astype(np.float16).astype(np.float32)
    z = np.full_like(s, (maxq + 1) // 2) if sym else np.clip(np.round(-lo / s), 0, maxq)
    q[cols] = np.clip(np.round(x / s[:, None]) + z[:, None], 0, maxq).T
    scales.append(s.astype(np.float16))
    zeros.append(z.astype(np.int64))
  return np.stack(scales), np.stack(zeros), q


def gptq(directory: str, bits: int, group: int, sym: bool, desc_act: bool, seed: int = 1,
         base: str | None = None, v2: bool = False) -> None:
  """`base`: another fixture's weights (tiny_qwen3_moe: its experts and attention quantized,
  the router float; tiny_phi3: its fused qkv_proj and gate_up_proj quantized whole). `v2`:
  GPTQModel's "gptq_v2" checkpoint format (zero points stored as they are)."""
  model, raw, tokenizer = fixture_model(base) if base else (float_model(), None, None)
  rng = np.random.default_rng(seed)
  out = {k: v.half() for k, v in model.items() if not k.endswith("proj.weight")}
  for prefix in projections(model):
    w = model[prefix + ".weight"].numpy()
    k = w.shape[1]
    # AutoGPTQ: g_idx[i] = invperm[i] // group under act-order (perm: columns by the Hessian's
    # diagonal, here a random order), else i // group
    perm = rng.permutation(k) if desc_act else np.arange(k)
    g_idx = (np.argsort(perm) // group).astype(np.int32)
    scales, zeros, q = minmax_groups(w, [np.where(g_idx == g)[0] for g in range(k // group)],
                                     bits, sym)
    if v2:  # a zero point of 0 somewhere, which only "gptq_v2" stores
      zeros[0, 0] = 0
    tensors = {"qweight": pack_fields(q, bits, axis=0),
               # stored minus one in the "gptq" format, as they are in "gptq_v2"
               "qzeros": pack_fields(zeros if v2 else zeros - 1, bits, axis=1),
               "scales": scales, "g_idx": g_idx}
    assert v2 or (zeros >= 1).all()  # the "gptq" format cannot store a zero point of 0
    reference = quant_reference.gptq_dequantize(*(tensors[n] for n in ("qweight", "qzeros",
                                                                       "scales", "g_idx")), bits,
                                                v2)
    expected = scales.astype(np.float32)[g_idx] * (q - zeros[g_idx]).astype(np.float32)
    assert np.array_equal(reference, expected.T), prefix
    for name, a in tensors.items():
      out[f"{prefix}.{name}"] = torch.from_numpy(np.ascontiguousarray(a))
  write(directory, out, "float16", {
      "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
      "sym": sym, "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
      "checkpoint_format": "gptq_v2" if v2 else "gptq", "model_name_or_path": None,
      "model_file_base_name": None},
        None if raw is None else (raw, tokenizer))


def awq(directory: str, group: int) -> None:
  model = float_model()
  out = {k: v.half() for k, v in model.items() if not k.endswith("proj.weight")}
  order = [0, 2, 4, 6, 1, 3, 5, 7]
  for prefix in projections(model):
    w = model[prefix + ".weight"].numpy()
    k = w.shape[1]
    groups = [np.arange(g * group, (g + 1) * group) for g in range(k // group)]
    scales, zeros, q = minmax_groups(w, groups, 4, sym=False)
    tensors = {"qweight": pack_fields(q, 4, axis=1, order=order),
               "qzeros": pack_fields(zeros, 4, axis=1, order=order), "scales": scales}
    reference = quant_reference.awq_dequantize(tensors["qweight"], tensors["qzeros"],
                                               tensors["scales"], group)
    expected = np.repeat(scales.astype(np.float32), group, 0) * (
        q - np.repeat(zeros, group, 0)).astype(np.float32)
    assert np.array_equal(reference, expected.T), prefix
    for name, a in tensors.items():
      out[f"{prefix}.{name}"] = torch.from_numpy(np.ascontiguousarray(a))
  write(directory, out, "float16", {
      "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
      "version": "gemm", "modules_to_not_convert": None})


def main(argv):
  del argv
  out = FLAGS.out
  compressed_tensors(os.path.join(out, "ct_w4a16"), "W4A16", "pack-quantized")
  compressed_tensors(os.path.join(out, "ct_w4a16_asym"), "W4A16_ASYM", "pack-quantized",
                     group=32)
  compressed_tensors(os.path.join(out, "ct_w8a16"), "W8A16", "pack-quantized")
  compressed_tensors(os.path.join(out, "ct_w8a16_asym"), "W8A16", "pack-quantized",
                     strategy="group", group=64, symmetric=False)
  compressed_tensors(os.path.join(out, "ct_w8a8"), "W8A8", "int-quantized")
  compressed_tensors(os.path.join(out, "ct_fp8_dynamic"), "FP8_DYNAMIC", "float-quantized")
  compressed_tensors(os.path.join(out, "ct_fp8_tensor"), "FP8", "float-quantized",
                     static_input=True)
  gptq(os.path.join(out, "gptq_4bit"), 4, 128, sym=True, desc_act=False)
  gptq(os.path.join(out, "gptq_act_order"), 4, 32, sym=False, desc_act=True)
  gptq(os.path.join(out, "gptq_8bit"), 8, 64, sym=False, desc_act=False)
  gptq(os.path.join(out, "gptq_v2"), 4, 64, sym=False, desc_act=False, v2=True)
  gptq(os.path.join(out, "gptq_moe"), 4, 32, sym=False, desc_act=False, base="tiny_qwen3_moe")
  gptq(os.path.join(out, "gptq_phi3"), 4, 32, sym=True, desc_act=False, base="tiny_phi3")
  awq(os.path.join(out, "awq_4bit"), 64)


if __name__ == "__main__":
  app.run(main)
