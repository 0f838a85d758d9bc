"""Compact weights (`jaxtier.model.quant`, `quantization`, GGUF blocks in stacked layers): the
matmul against float64 numpy, GGUF blocks against gguf-py's dequantization, compact models against
their dequantized floats, offloaded compact tails against the same model resident, the engine
argument's bytes, and the CUDA export reading the weights as int4 without a float copy."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtier
from jaxtier.checkpoint import gguf_file, placed
from jaxtier.checkpoint.params import TensorSource, is_layer_path, params_from_model
from jaxtier.checkpoint.quantized import QuantizedSource
from jaxtier.model import Transformer
from jaxtier.model import quant
from jaxtier.sampling import SamplingParams
from jaxtier.tools import export, hlo
from conftest import fixture_path
from test_matmul_blocks import logits_of, q4_config, write_q4_1_gguf

TINY = fixture_path("tiny_qwen3")  # hidden 64, MLP 128: every projection splits into groups
FORMATS = {
    "int8": quant.quantized_format("int8"),
    "int4_32": quant.quantized_format("int4", 32),
    "int4_64": quant.quantized_format("int4", 64),
    "int4_64_cpu": quant.quantized_format("int4", 64).on("cpu"),
    "q4_1": quant.BLOCK_LAYOUTS["q4_1"],
    "q8_16": quant.BLOCK_LAYOUTS["q8_16"],
}


class DictSource(TensorSource):
  """A model's parameters as a float checkpoint."""

  def __init__(self, params):
    super().__init__("params")
    self.params = {k: np.asarray(v) for k, v in params.items()}

  def shapes(self):
    return {k: v.shape for k, v in self.params.items()}

  def read(self, path, layers=None):
    a = self.params[path]
    return a if layers is None or not is_layer_path(path) else a[list(layers)]


def numpy_weight(parts, k: int) -> np.ndarray:
  """The weight the parts hold, in float64, written apart from `quant.dequantize`."""
  values, scales, *mins = (np.asarray(p) for p in parts)
  if values.dtype == np.uint8 and values.shape[-2] * 2 == k:  # two 4-bit values a byte
    values = np.stack([values & 15, values >> 4], axis=-2).reshape(
        *values.shape[:-2], k, values.shape[-1])  # row 2i low, 2i + 1 high
  values = values.astype(np.float64)
  rows = k // scales.shape[-2]
  w = values * np.repeat(scales.astype(np.float64), rows, axis=-2)
  if mins:
    w = w + np.repeat(mins[0].astype(np.float64), rows, axis=-2)
  return w


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_qmatmul_equals_float64_product_of_the_held_weight(name):
  fmt = FORMATS[name]
  rng = np.random.default_rng(0)
  k, n = 128, 48
  w = rng.normal(size=(k, n)).astype(np.float32)
  parts = quant.quantize(w, fmt)
  assert [p.shape for p in parts] == [s.shape for s in fmt.shapes(k, n).values()]
  assert [p.dtype for p in parts] == [s.dtype for s in fmt.shapes(k, n).values()]
  held = numpy_weight(parts, k)
  # the quantization error: half a step of each group's scale, plus its float16 rounding
  step = np.repeat(np.asarray(parts[1], np.float64), k // parts[1].shape[-2], axis=-2)
  assert np.all(np.abs(held - w) <= step * 0.5 + 2e-3 * np.abs(w).max())
  x = rng.normal(size=(3, k)).astype(np.float32)
  got = np.asarray(quant.qmatmul(jnp.asarray(x), *(jnp.asarray(p) for p in parts)))
  np.testing.assert_allclose(got, x.astype(np.float64) @ held, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(*parts)), held.astype(np.float32))


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q5_1"])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_gguf_blocks_dequantize_to_gguf_py_values_bit_for_bit(tensor_type, platform):
  kind = gguf.GGMLQuantizationType[tensor_type]
  rng = np.random.default_rng(1)
  w = rng.normal(size=(32, 256)).astype(np.float32)  # [out, in]
  data = gguf.quants.quantize(w, kind)
  expected = gguf.quants.dequantize(data, kind).T  # [in, out]
  held = gguf_file._BLOCK_TYPES.get(kind, "q8_16")  # pylint: disable=protected-access
  split = gguf_file.block_parts_q8_16 if held == "q8_16" else gguf_file.block_parts
  parts = tuple(a.T for a in split(kind, data, 32, 256))
  fmt = quant.BLOCK_LAYOUTS[held].on(platform)
  got = quant.dequantize(*(jnp.asarray(p) for p in quant.cast_parts(parts, fmt).values()))
  np.testing.assert_array_equal(np.asarray(got), expected)


def write_q4_file(directory, tied: bool):
  config = q4_config(tied)
  model = Transformer(config, rngs=nnx.Rngs(3))
  path = str(directory / "model.gguf")
  write_q4_1_gguf(path, model)  # layers in Q4_1, the head's table in Q8_0
  return config, model, path


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
  return write_q4_file(tmp_path_factory.mktemp("q4"), False)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("groups", [((2, "scan"),), ((1, "scan"), (1, "offload"))])
def test_gguf_blocks_in_stacked_layers_match_the_dequantized_model(tmp_path, groups, tied):
  config, _, path = write_q4_file(tmp_path, tied)
  _, _, source = gguf_file.open_source(path)
  dequantized = placed.build(config, source, jnp.float32,
                             placed.Layout(groups, 1, portable=True))
  compact = placed.build(config, source, jnp.float32,
                         placed.Layout(groups, 1, portable=True, keep_quantized=True))
  kinds = {str(a.dtype) for a in jax.tree.leaves(nnx.state(compact))}
  assert "uint8" in kinds and "float32" in kinds  # nibbles, and their scales
  assert compact.compact_head is not None and compact.compact_head.values.dtype == jnp.int8
  assert (getattr(compact, "embed", None) is None) == tied  # a tied table is held once
  for got, want in zip(logits_of(compact, config), logits_of(dequantized, config)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int4", 32), ("int4", 64), ("q8_0", 32),
                                        ("q4_1", 32)])
def test_an_offloaded_compact_tail_equals_the_same_model_resident(fmt, group):
  config = q4_config()
  model = Transformer(config, rngs=nnx.Rngs(0))
  source = QuantizedSource(DictSource(params_from_model(model)), fmt, group, head=False)
  resident = placed.build(config, source, jnp.float32,
                          placed.Layout(((2, "scan"),), keep_quantized=True, portable=True))
  offloaded = placed.build(config, source, jnp.float32, placed.Layout(
      ((1, "scan"), (1, "offload")), 1, keep_quantized=True, portable=True))
  host = [a for a in jax.tree.leaves(nnx.state(offloaded))
          if a.sharding.memory_kind == "pinned_host"]
  assert {str(a.dtype) for a in host} >= {"float32", "int8" if "8" in fmt else "uint8"}
  floats = logits_of(model, config)
  for got, want, exact in zip(logits_of(offloaded, config), logits_of(resident, config), floats):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and near the float model: within the quantization's error on random weights
    assert np.abs(got - exact).max() < (0.05 if "8" in fmt else 0.3) * np.abs(exact).max()


def generate(llm, n: int = 8):
  out = llm.generate(["hello world", "the quick brown fox"],
                     SamplingParams(max_tokens=n, temperature=0))
  return [o.outputs[0].token_ids for o in out]


@pytest.mark.parametrize("kernels", ["auto", "portable"])
def test_quantization_argument_from_a_float_checkpoint(kernels):
  float_llm = jaxtier.LLM(TINY, kernels=kernels)
  floats, tokens = float_llm.memory_report()["device_weight_bytes"], generate(float_llm)
  del float_llm
  reports = {}
  for name in ("int8", "int4"):
    llm = jaxtier.LLM(TINY, kernels=kernels, quantization=name)
    reports[name] = llm.memory_report()
    if name == "int8":  # a tiny random model's greedy tokens survive int8 (int4: bench_quant)
      assert generate(llm) == tokens
    plan = jaxtier.llm.dry_run(TINY, kernels=kernels, quantization=name)
    assert plan["device_weight_bytes"] == reports[name]["device_weight_bytes"], name
    del llm
  formats = {k: set(r["weight_bytes_by_format"]) for k, r in reports.items()}
  if kernels == "portable":
    assert {"int8", "bfloat16"} <= formats["int8"] and {"u4x2", "float16"} <= formats["int4"]
  else:  # the CPU kernels' blocks
    assert any(f.startswith("q8_0") for f in formats["int8"])
    assert any(f.startswith("q4_1") for f in formats["int4"])
  # the tiny model's tables are a third of its bytes; the real model's ratios are in bench_quant
  assert reports["int8"]["device_weight_bytes"] < 0.45 * floats
  assert reports["int4"]["device_weight_bytes"] < reports["int8"]["device_weight_bytes"]


def test_quantized_tail_is_held_and_moved_compact():
  kw = dict(kernels="portable", quantization="int4")
  resident = jaxtier.LLM(TINY, **kw)
  tokens = generate(resident)
  del resident
  floats = jaxtier.LLM(TINY, kernels="portable", offload_tail_layers=1).memory_report()
  llm = jaxtier.LLM(TINY, offload_tail_layers=1, **kw)
  report = llm.memory_report()
  assert generate(llm) == tokens
  assert report["host_weight_bytes"] <= 0.35 * floats["host_weight_bytes"]
  assert report["weight_transfer_bytes_per_step"] == report["host_weight_bytes"]
  plan = jaxtier.llm.dry_run(TINY, offload_tail_layers=1, **kw)
  assert plan["host_weight_bytes"] == report["host_weight_bytes"]


def test_bad_quantization_arguments_are_clear_errors(q4_file):
  _, _, path = q4_file
  with pytest.raises(ValueError, match="float checkpoints; this one stores its layers quantized"):
    jaxtier.LLM(path, quantization="int8")
  with pytest.raises(ValueError, match="mixture-of-experts"):
    jaxtier.LLM(fixture_path("tiny_mixtral"), quantization="int8")
  with pytest.raises(ValueError, match="blocks of 32 rows"):
    jaxtier.LLM(TINY, quantization="int4", quantization_group_size=64)
  with pytest.raises(ValueError, match="multiples of 128"):
    jaxtier.LLM(TINY, quantization="int4", quantization_group_size=128, kernels="portable")
  with pytest.raises(ValueError, match="quantization_group_size=48"):
    jaxtier.engine.args.EngineArgs(model=TINY, quantization_group_size=48)
  with pytest.raises(ValueError, match="weight_format='float'"):
    jaxtier.engine.args.EngineArgs(model=TINY, quantization="int8", weight_format="float")
  with pytest.raises(ValueError, match="quantization"):
    jaxtier.engine.args.EngineArgs(model=TINY, quantization="int3")


def test_cuda_decode_reads_int4_weights_without_a_float_copy():
  engine = export.abstract_engine(TINY, "cuda", quantization="int4", offload_tail_layers=1,
                                  max_num_seqs=4)
  leaves = engine.runner._leaves  # pylint: disable=protected-access
  values = [a for a in leaves if a.dtype == jnp.uint4]
  assert len(values) == 7 * 2  # every projection of both layers, as XLA's 4-bit type
  weight_shapes = {a.shape for a in values}
  floats = [a for a in leaves if jnp.issubdtype(a.dtype, jnp.floating) and a.shape in weight_shapes]
  assert not floats  # no parameter holds a float copy of a weight
  texts = {}
  decode = export.export_engine_programs(engine, "cuda", texts)["decode"]
  assert decode["ok"], decode["error"]
  assert decode["h2d_bytes"] == engine.host_weight_bytes  # the compact tail crosses the link
  # every 4-bit weight (and the int8 KV or ids, if any) converts into a multiply or the dot only
  users = hlo.narrow_convert_users(texts["decode"])
  assert users["stablehlo.multiply"] >= 14, users
  assert set(users) <= {"stablehlo.multiply", "stablehlo.dot_general"}, users
