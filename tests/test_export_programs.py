"""`jaxtier.tools.export` and `scripts/export_programs.py`: the engine's programs exported for CUDA
and TPU from abstract state (no weights, no device), and the facts read from their StableHLO.

The expected bytes are computed here from the model's config, not taken from the code under test.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compute_on import compute_on
from jax.sharding import PartitionSpec as P

from jaxtier import kvcache
from jaxtier.checkpoint import hf
from jaxtier.engine import runner as runner_module
from jaxtier.engine import sizing
from jaxtier.engine.args import EngineArgs
from jaxtier.kernels.cpu import library as cpu_kernels
from jaxtier.offload import placement
from jaxtier.tools import export, hlo
from conftest import DEFAULT_MODEL, fixture_path

TINY = fixture_path("tiny_llama")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = 2  # bytes: "auto" resolves to bfloat16 on gpu and tpu


def layer_bytes(config) -> int:
  return config.layer_param_count * BF16


def block_bytes(config, block_size: int = 16) -> int:
  """K and V of one block over every layer, bfloat16."""
  return 2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * BF16


@pytest.fixture(scope="module")
def tiny_config():
  return hf.read_config(TINY)


@pytest.fixture(scope="module")
def cuda_offloaded():
  return export.export_programs(TINY, "cuda", offload_tail_layers=2, max_num_seqs=4)


@pytest.fixture(scope="module")
def cuda_resident():
  return export.export_programs(TINY, "cuda", max_num_seqs=4)


STEPS = ("decode", "prefill")  # the programs that attend


def check_accelerator_facts(result: dict, config, offloaded: int, attention: str) -> None:
  """What a GPU or TPU program of the engine must be: see the assertions. `attention`: the path
  the steps take ("pallas": the GPU kernel, one custom call in the scanned layers' body)."""
  programs = result["programs"]
  assert set(programs) == set(export.PROGRAMS)
  for name, facts in programs.items():
    assert facts["ok"] and facts["error"] is None, (name, facts["error"])
    assert facts["cpu_custom_calls"] == 0, name
    assert facts["host_compute_ops"] == 0, (name, facts["host_compute"])
    assert facts["attention"] == (attention if name in STEPS else None), name
    kernel = name in STEPS and attention.startswith("pallas")
    assert facts["pallas_kernels"] >= 1 if kernel else facts["pallas_kernels"] == 0, name
  out = programs["swap_out"]

  host = offloaded * layer_bytes(config)
  assert result["host_weight_bytes"] == host
  decode, prefill = programs["decode"], programs["prefill"]
  assert decode["key"][2] == 1 and prefill["key"][2] > 1
  assert (decode["h2d_bytes"], decode["d2h_bytes"]) == (host, 0)
  assert (prefill["h2d_bytes"], prefill["d2h_bytes"]) == (host, 0)
  sampler = programs["sample_transformed"]
  assert sampler["key"][1] == decode["key"][1]  # the decode call's rows, from its logits
  assert (sampler["h2d_bytes"], sampler["d2h_bytes"]) == (0, 0)

  blocks = out["key"][2]
  assert out["key"] == ["swap", "out", blocks] and programs["swap_in"]["key"] == ["swap", "in",
                                                                                 blocks]
  assert (out["h2d_bytes"], out["d2h_bytes"]) == (0, blocks * block_bytes(config))
  swap_in = programs["swap_in"]
  assert (swap_in["h2d_bytes"], swap_in["d2h_bytes"]) == (blocks * block_bytes(config), 0)


def test_cuda_plan_resolves_every_auto_for_the_platform(cuda_offloaded):
  plan = cuda_offloaded["plan"]
  assert cuda_offloaded["platform"] == "cuda"
  # attention "auto": the cache resolves it for the platform (the GPU kernel, see the programs)
  assert (plan["dtype"], plan["kv_cache_dtype"], plan["kernels"], plan["layer_execution"],
          plan["attention_impl"]) == ("bfloat16", "bfloat16", "portable", "scan", "auto")
  assert plan["offload_tail_layers"] == 2


def test_cuda_programs_offloaded(cuda_offloaded, tiny_config):
  check_accelerator_facts(cuda_offloaded, tiny_config, offloaded=2, attention="pallas")


def test_cuda_programs_resident_move_no_weights(cuda_resident, tiny_config):
  check_accelerator_facts(cuda_resident, tiny_config, offloaded=0, attention="pallas")
  assert cuda_resident["plan"]["offload_tail_layers"] == 0


def test_tpu_programs_offloaded(tiny_config):
  result = export.export_programs(TINY, "tpu", offload_tail_layers=1, max_num_seqs=4)
  assert result["platform"] == "tpu" and result["plan"]["kernels"] == "portable"
  # head_dim 12: the TPU kernel wants a multiple of 128, so both steps take the gathered XLA path
  check_accelerator_facts(result, tiny_config, offloaded=1, attention="xla_gathered")


def test_attention_paths_tell_the_implementations_apart():
  """The kernels by their custom calls, the XLA paths by their functions; JAX's TPU kernel is a
  function "paged_attention" too, not the chunked loop."""
  q = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((2, 12, 16, 128), jnp.bfloat16)
  rest = (jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32))

  def text(fn, platform):  # fn called from a program, as the model calls it
    return jax.export.export(jax.jit(lambda *a: fn(*a)), platforms=[platform])(
        q, pages, pages, *rest).mlir_module()

  assert export.attention_paths(text(kvcache.paged_attention_tpu, "tpu")) == "pallas_tpu"
  assert export.attention_paths(text(kvcache.paged_attention, "cpu")) == "xla"
  assert export.attention_paths(text(kvcache.paged_attention_gathered, "tpu")) == "xla_gathered"
  both = lambda *a: kvcache.paged_attention_tpu(*a) + kvcache.paged_attention_gathered(*a,
                                                                                     window=4)
  assert export.attention_paths(text(both, "tpu")) == "pallas_tpu+xla_gathered"
  assert export.attention_paths(text(lambda q, *a: q * 2, "tpu")) is None


def test_machine_for_another_platform_measures_nothing_here():
  args = EngineArgs(model=TINY, host_memory_gb=64)
  machine = sizing.detect_machine(args, "cuda")
  assert machine == sizing.Machine("gpu", 1, None, 64 * 10**9)
  assert sizing.detect_machine(args, "tpu").platform == "tpu"
  assert sizing.detect_machine(args, "cpu").platform == jax.devices()[0].platform
  assert sizing.resolved_kernels(args, machine) == "portable"
  with pytest.raises(ValueError, match="platform='metal'"):
    sizing.detect_machine(args, "metal")


def test_cpu_kernels_are_counted():
  """The counter counts: CPU programs with the C++ kernels (kernels="auto", unrolled layers)
  report them, the portable ones none."""
  if not cpu_kernels.available():
    pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
  auto = export.export_programs(TINY, "cpu", max_num_seqs=4)
  assert auto["plan"]["layer_execution"] == "unrolled"
  programs = auto["programs"]
  assert programs["decode"]["ok"] and programs["decode"]["cpu_custom_calls"] > 0
  assert programs["prefill"]["cpu_custom_calls"] > 0
  assert programs["sample_transformed"]["cpu_custom_calls"] > 0  # the argmax kernel
  portable = export.export_programs(TINY, "cpu", max_num_seqs=4, kernels="portable")
  assert all(f["ok"] and f["cpu_custom_calls"] == 0 for f in portable["programs"].values())


def test_a_program_that_fails_is_reported_and_the_others_export(monkeypatch):
  def broken(cache, src_x, places):
    raise RuntimeError("this swap cannot be traced")

  monkeypatch.setitem(runner_module._SWAPS, "out", jax.jit(broken, static_argnames="places"))  # pylint: disable=protected-access
  result = export.export_programs(TINY, "cuda", max_num_seqs=4)
  out = result["programs"]["swap_out"]
  assert not out["ok"] and "this swap cannot be traced" in out["error"]
  assert out["h2d_bytes"] is None and out["host_offload_compute_ops"] is None
  assert all(f["ok"] for name, f in result["programs"].items() if name != "swap_out")


def test_host_compute_counts_an_update_into_host_memory_not_data_movement():
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=placement.PINNED_HOST)
  pool = jax.device_put(jnp.zeros((8, 4), jnp.bfloat16), host)
  block = jnp.ones((1, 4), jnp.bfloat16)

  def write(pool, block, i):  # the swap's pattern: a block moved to the host, then written
    moved = jax.device_put(block, jax.memory.Space.Host)
    return jax.lax.dynamic_update_slice_in_dim(pool, moved, i, 0)

  def read(pool, i):  # slicing, a bitcast and the transfer: data movement only
    row = jax.lax.dynamic_slice_in_dim(pool, i, 1, 0)
    return jax.device_put(jax.lax.bitcast_convert_type(row, jnp.uint16), jax.memory.Space.Device)

  i = jnp.int32(3)
  written = hlo.placement_report(hlo.exported_text(jax.jit(write), pool, block, i))
  assert [op.split(" ")[0] for op in written.host_compute] == ["stablehlo.dynamic_update_slice"]
  assert written.transfer_bytes(to_device=False) == 4 * 2
  taken = hlo.placement_report(hlo.exported_text(jax.jit(read), pool, i))
  assert taken.host_compute == () and taken.transfer_bytes(to_device=True) == 4 * 2



def _one_device_shardings():
  mesh = jax.make_mesh((1,), ("tp",))
  return (jax.sharding.NamedSharding(mesh, P(), memory_kind=placement.PINNED_HOST),
          jax.sharding.NamedSharding(mesh, P(), memory_kind=placement.DEVICE))


def test_compute_on_the_host_is_offload_compute_and_its_result_moves_back():
  """An offloaded layer's experts computed where they live (`compute_on("device_host")`): the
  ops are host computation on purpose, the tokens moved to the host d2h, the result moved back
  h2d, once (jit's own annotation of the result moves nothing more)."""
  host, dev = _one_device_shardings()

  def experts(x, w, e, j):  # x: tokens, w: (layers, experts, hidden, ffn) on the host
    xh, eh, jh = jax.device_put((x, e, j), host)

    @compute_on("device_host")
    @jax.jit
    def run(xh, w, eh, jh):
      ws = w.reshape(12, 8, 16)[jh * 3 + eh]  # a gather of each token's expert of layer j
      return jnp.einsum("ph,phf->pf", xh, ws)

    return jax.device_put(run(xh, w, eh, jh), dev)

  args = (jax.ShapeDtypeStruct((5, 8), jnp.float32),
          jax.ShapeDtypeStruct((4, 3, 8, 16), jnp.float32, sharding=host),
          jax.ShapeDtypeStruct((5,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
  text = jax.export.export(jax.jit(experts, in_shardings=(dev, host, dev, dev)),
                           platforms=["cuda"])(*args).mlir_module()
  facts = export.program_facts(text)
  assert facts["host_compute_ops"] == 0, facts["host_compute"]
  assert facts["host_offload_compute_ops"] == len(facts["host_offload_compute"]) > 0
  ops = {op.split(" ")[0] for op in facts["host_offload_compute"]}
  assert {"stablehlo.gather", "stablehlo.dot_general"} <= ops
  assert not ops & (hlo.MOVES | {"stablehlo.constant", "func.call"})
  assert facts["d2h_bytes"] == 5 * 8 * 4 + 5 * 4 + 4  # x, e and j moved to the host
  assert facts["h2d_bytes"] == 5 * 16 * 4  # the result moved back
  report = hlo.placement_report(text)
  assert [t.sources for t in report.to_device()] == [(-1,)]


def test_host_compute_outside_compute_on_is_accidental():
  host, dev = _one_device_shardings()

  def doubled(x, w):  # the device computes on host memory: w * 2 placed on no side
    return x @ jax.device_put(w * 2, dev)

  text = jax.export.export(jax.jit(doubled, in_shardings=(dev, host)), platforms=["cuda"])(
      jax.ShapeDtypeStruct((5, 8), jnp.float32),
      jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=host)).mlir_module()
  facts = export.program_facts(text)
  assert facts["host_offload_compute_ops"] == 0 and facts["host_offload_compute"] == []
  assert [op.split(" ")[0] for op in facts["host_compute"]] == ["stablehlo.multiply"]
  assert facts["host_compute_ops"] == 1

def test_script_writes_the_json(tmp_path):
  path = tmp_path / "tpu.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "export_programs.py"), "--platform=tpu",
       f"--model={TINY}", "--offload_tail_layers=1", "--max_num_seqs=4", f"--json={path}"],
      capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(path.read_text())
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
  assert result["platform"] == "tpu" and result["host_weight_bytes"] > 0
  for name, facts in result["programs"].items():
    assert set(facts) >= {"ok", "error", "cpu_custom_calls", "host_compute_ops",
                          "host_offload_compute_ops", "h2d_bytes", "d2h_bytes", "pallas_kernels",
                          "attention"}
    assert facts["ok"]
    assert facts["attention"] == ("xla_gathered" if name in STEPS else None), name
  bad = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "export_programs.py"), "--platform=cuda",
       f"--model={TINY}", "--offload_tail_layers=99"],
      capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
  assert bad.returncode == 2 and "offload_tail_layers" in bad.stderr


@pytest.mark.slow
def test_default_model_offloaded_for_cuda():
  result = export.export_programs(DEFAULT_MODEL, "cuda", offload_tail_layers=10)
  programs = result["programs"]
  assert all(f["ok"] and f["cpu_custom_calls"] == 0 for f in programs.values())
  # 30 layers of hidden 576, MLP 1536, 9 / 3 heads of 64: 3,540,096 parameters a layer, of
  # which 1,152 in two norms (bfloat16); the Q4_1 projections stay 4-bit with a float32 scale and
  # minimum per 32: 0.75 bytes a weight (bfloat16 layers: 70,801,920 bytes)
  assert result["host_weight_bytes"] == 10 * ((3_540_096 - 1_152) * 3 // 4 + 1_152 * BF16)
  assert programs["decode"]["h2d_bytes"] == result["host_weight_bytes"]
  assert all(f["host_compute_ops"] == 0 for f in programs.values())
  assert programs["swap_out"]["d2h_bytes"] == programs["swap_in"]["h2d_bytes"] > 0
