"""The expert cost model: stream an offloaded MoE layer's experts, or compute them on the host.

The hand-computed cases spell their arithmetic out, so a broken formula fails against numbers
worked out here, not against the module's own expression.
"""

import json

import pytest
from hypothesis import given, settings, strategies as st

from jaxtier.model.config import ModelConfig
from jaxtier.offload import expert_cost as ec
from jaxtier.offload import hardware

MIXTRAL = ModelConfig(architecture="mixtral", vocab_size=32000, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=14336)
QWEN3_30B = ModelConfig(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048,
                        intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
                        head_dim=128, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768)
SHAPES = {"mixtral": ec.ExpertShape.of(MIXTRAL, "bfloat16"),
          "qwen3-30b-a3b": ec.ExpertShape.of(QWEN3_30B, "bfloat16")}
# The x86 host of the PCIe presets, and Grace.
PCIE = ec.ExpertRates(link_bytes_per_s=50e9, host_bytes_per_s=200e9, host_flops=1e12)
GRACE = ec.ExpertRates(link_bytes_per_s=375e9, host_bytes_per_s=400e9, host_flops=3e12)


def test_shape_of_config():
  mixtral = SHAPES["mixtral"]
  assert (mixtral.num_experts, mixtral.experts_per_tok, mixtral.hidden_size,
          mixtral.expert_width) == (8, 2, 4096, 14336)
  assert (mixtral.weight_itemsize, mixtral.activation_itemsize) == (2, 2)
  assert mixtral.expert_bytes == 352_321_536  # 3 * 4096 * 14336 * 2: ~352 MB an expert
  assert mixtral.layer_bytes == 2_818_572_288  # 8 of them: ~2.8 GB a layer
  qwen = SHAPES["qwen3-30b-a3b"]
  assert qwen.expert_bytes == 9_437_184 and qwen.layer_bytes == 1_207_959_552
  f32 = ec.ExpertShape.of(MIXTRAL, "float32")
  assert (f32.weight_itemsize, f32.activation_itemsize) == (4, 4)
  assert f32.layer_bytes == 2 * mixtral.layer_bytes
  assert ec.ExpertShape.of(MIXTRAL, "float16").weight_itemsize == 2
  assert ec.ExpertShape(8, 2, 4096, 14336, 2).activation_itemsize == 4  # the default


def test_mixtral_on_pcie_by_hand():
  shape = SHAPES["mixtral"]
  # The whole stack over the link: 2,818,572,288 B / 50e9 B/s.
  assert ec.stream_seconds(shape, PCIE) == pytest.approx(0.05637144576, rel=1e-12)
  # 1 token, gathered: 2 experts read (704,643,072 B / 200e9 = 3.523 ms) beat their FLOPs
  # (2 * 6 * 4096 * 14336 = 704,643,072 / 1e12 = 0.705 ms); the link carries x and out
  # (2 * 4096 * 2 B) and the router's pair (2 * 8 B): 16,400 B / 50e9 = 0.328 us; 30 us round trip.
  assert ec.host_seconds(shape, PCIE, 1) == pytest.approx(30e-6 + 0.328e-6 + 3.52321536e-3,
                                                          rel=1e-12)
  # 4 tokens, gathered: 8 pairs read 8 experts, 2,818,572,288 B / 200e9 = 14.09 ms.
  assert ec.host_seconds(shape, PCIE, 4) == pytest.approx(30e-6 + 4 * 0.328e-6 + 0.01409286144,
                                                          rel=1e-12)
  # 20 tokens, masked: 20 * 8 * 6 * 4096 * 14336 = 56,371,445,760 FLOPs / 1e12 = 56.37 ms beats
  # the 14.09 ms read; link 20 * 16,400 B / 50e9 = 6.56 us.
  assert ec.host_seconds(shape, PCIE, 20) == pytest.approx(30e-6 + 6.56e-6 + 0.05637144576,
                                                           rel=1e-12)
  # 19 tokens: 19 * 2.8186 ms = 53.55 ms + 36 us < 56.37 ms, the host; 20 tokens: the FLOPs alone
  # equal the stream, and the overhead tips it: stream.
  assert ec.host_seconds(shape, PCIE, 19) == pytest.approx(0.053589105472, rel=1e-12)
  assert ec.stream_from_tokens(shape, PCIE) == 20
  assert ec.choose(shape, PCIE, 19) == "host" and ec.choose(shape, PCIE, 20) == "stream"


def test_qwen3_on_grace_by_hand():
  shape = SHAPES["qwen3-30b-a3b"]
  # 1,207,959,552 B / 375e9 B/s = 3.221 ms.
  assert ec.stream_seconds(shape, GRACE) == pytest.approx(0.003221225472, rel=1e-12)
  # 16 tokens: 128 pairs, gathered, every expert read once: 1,207,959,552 / 400e9 = 3.020 ms
  # (> 128 * 6 * 2048 * 768 / 3e12 = 0.403 ms); link (16 * 2 * 2048 * 2 + 16 * 8 * 8) B / 375e9.
  assert ec.host_form(shape, 16) == "gathered"
  assert ec.host_seconds(shape, GRACE, 16) == pytest.approx(
      30e-6 + 132_096 / 375e9 + 0.00301989888, rel=1e-12)
  # 17 tokens: masked, 17 * 128 * 6 * 2048 * 768 = 20,535,312,384 FLOPs / 3e12 = 6.845 ms.
  assert ec.host_form(shape, 17) == "masked"
  assert ec.host_seconds(shape, GRACE, 17) == pytest.approx(
      30e-6 + 140_352 / 375e9 + 0.006845104128, rel=1e-12)
  assert ec.stream_from_tokens(shape, GRACE) == 17


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("preset", ["h100-pcie", "gh200"])
def test_presets_host_at_batch_one_stream_at_large_batches(shape_name, preset):
  shape, rates = SHAPES[shape_name], ec.rates_of(hardware.preset(preset))
  assert ec.choose(shape, rates, 1) == "host"
  assert ec.choose(shape, rates, 256) == "stream" and ec.choose(shape, rates, 1024) == "stream"
  n = ec.stream_from_tokens(shape, rates)
  assert n is not None and 1 < n <= 256
  assert ec.choose(shape, rates, n - 1) == "host" and ec.choose(shape, rates, n) == "stream"
  assert all(ec.choose(shape, rates, tokens) == "stream" for tokens in range(n, n + 200))


@pytest.mark.parametrize("shape_name, pcie, gh200", [("mixtral", 20, 8),
                                                     ("qwen3-30b-a3b", 20, 17)])
def test_faster_link_streams_sooner(shape_name, pcie, gh200):
  shape = SHAPES[shape_name]
  on = {name: ec.stream_from_tokens(shape, ec.rates_of(hardware.preset(name)))
        for name in ("h100-pcie", "gh200")}
  assert on == {"h100-pcie": pcie, "gh200": gh200}
  assert on["gh200"] < on["h100-pcie"]


def test_rates_of_hardware():
  rates = ec.rates_of(hardware.preset("gh200"))
  assert rates == ec.ExpertRates(375e9, 400e9, 3e12, 30e-6)
  assert ec.rates_of(hardware.preset("h100-pcie"), round_trip_s=1e-4) == ec.ExpertRates(
      50e9, 200e9, 1e12, 1e-4)


def test_forced_modes_override():
  shape = SHAPES["mixtral"]
  assert ec.choose(shape, PCIE, 1, "stream") == "stream"
  assert ec.choose(shape, PCIE, 4096, "host") == "host"
  assert ec.choose(shape, PCIE, 1, "auto") == "host"
  assert ec.stream_from_tokens(shape, PCIE, "stream") == 1
  assert ec.stream_from_tokens(shape, PCIE, "host") is None
  assert ec.stream_from_tokens(shape, PCIE, "auto", limit=19) is None  # host up to the limit
  assert ec.stream_from_tokens(shape, PCIE, "auto", limit=20) == 20


def test_tie_streams():
  # 2 experts of 1 x 1 float32 (12 B each; powers of two keep the sums exact): stream 24 B / 32 B/s
  # = 0.75 s; host, 1 token: round trip 0.0625 s + link (2 * 4 + 8) B / 32 B/s = 0.5 s + one expert
  # read, 12 B / 64 B/s = 0.1875 s: 0.75 s too.
  shape = ec.ExpertShape(2, 1, 1, 1, 4, activation_itemsize=4)
  rates = ec.ExpertRates(link_bytes_per_s=32.0, host_bytes_per_s=64.0, host_flops=1e9,
                         round_trip_s=0.0625)
  assert ec.stream_seconds(shape, rates) == ec.host_seconds(shape, rates, 1) == 0.75
  assert ec.choose(shape, rates, 1) == "stream"
  assert ec.stream_from_tokens(shape, rates) == 1


def test_host_form_switches_when_pairs_exceed_experts():
  mixtral, qwen = SHAPES["mixtral"], SHAPES["qwen3-30b-a3b"]
  assert [ec.host_form(mixtral, n) for n in (1, 4, 5, 64)] == ["gathered", "gathered", "masked",
                                                               "masked"]
  assert [ec.host_form(qwen, n) for n in (1, 16, 17)] == ["gathered", "gathered", "masked"]
  # The masked form reads all 8 experts once whatever the token count; FLOPs decide past that:
  # 5 tokens' masked FLOPs (5 * 8 * 6 * 4096 * 14336 / 1e12 = 14.09 ms) at 1e12 FLOP/s just
  # match the 14.09 ms read, and 64 tokens' (180.4 ms) dwarf it.
  rates = ec.ExpertRates(link_bytes_per_s=1e15, host_bytes_per_s=200e9, host_flops=1e12,
                         round_trip_s=1e-15)
  assert ec.host_seconds(mixtral, rates, 64) == pytest.approx(64 * 8 * 6 * 4096 * 14336 / 1e12)
  assert ec.host_seconds(mixtral, rates, 5) == pytest.approx(
      max(8 * 352_321_536 / 200e9, 5 * 8 * 6 * 4096 * 14336 / 1e12))


def test_experts_touched():
  assert ec.experts_touched(1, 8, 2) == pytest.approx(2.0)
  assert ec.experts_touched(1, 128, 8) == pytest.approx(8.0)
  assert ec.experts_touched(0, 128, 8) == 0.0
  assert ec.experts_touched(2, 8, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
  assert ec.experts_touched(10_000, 128, 8) == pytest.approx(128.0)
  assert ec.experts_touched(3, 8, 8) == 8.0
  values = [ec.experts_touched(n, 128, 8) for n in range(1, 200)]
  assert values == sorted(values) and all(8 <= v <= 128 for v in values)


def _shapes():
  return st.builds(lambda e, k_frac, h, f, w, a: ec.ExpertShape(e, max(1, int(e * k_frac)), h, f,
                                                                w, a),
                   st.integers(1, 256), st.floats(0.0, 1.0), st.integers(1, 8192),
                   st.integers(1, 16384), st.sampled_from([1, 2, 4]), st.sampled_from([2, 4]))


def _rates():
  return st.builds(ec.ExpertRates, st.floats(1e9, 1e12), st.floats(1e10, 1e12),
                   st.floats(1e11, 1e14), st.floats(1e-7, 1e-3))


@settings(max_examples=60, deadline=None)
@given(shape=_shapes(), rates=_rates())
def test_host_cost_never_falls_and_the_search_is_exact(shape, rates):
  limit = 300
  costs = [ec.host_seconds(shape, rates, n) for n in range(1, limit + 1)]
  assert all(a <= b for a, b in zip(costs, costs[1:]))
  modes = [ec.choose(shape, rates, n) for n in range(1, limit + 1)]
  expected = next((n for n in range(1, limit + 1) if modes[n - 1:] == ["stream"] * (limit - n + 1)),
                  None)
  assert ec.stream_from_tokens(shape, rates, limit=limit) == expected


@pytest.mark.parametrize("preset", sorted(hardware.PRESETS))
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_every_preset_switches_once(preset, shape_name):
  shape, rates = SHAPES[shape_name], ec.rates_of(hardware.preset(preset))
  n = ec.stream_from_tokens(shape, rates)
  modes = [ec.choose(shape, rates, t) for t in range(1, 2049)]
  assert modes == ["host"] * (n - 1) + ["stream"] * (2048 - n + 1)


def test_report_is_json_and_covers_layers():
  shape, rates = SHAPES["mixtral"], PCIE
  out = ec.report(shape, rates, layers=range(28, 32))
  assert json.loads(json.dumps(out)) == out
  assert out["forced"] == "auto" and out["stream_from_tokens"] == 20
  assert out["stream_s"] == pytest.approx(0.05637144576)
  assert set(out["by_batch"]) == {"1", "8", "32", "64", "256"}
  assert out["by_batch"]["1"]["mode"] == "host" and out["by_batch"]["32"]["mode"] == "stream"
  assert out["by_batch"]["1"]["experts_touched"] == pytest.approx(2.0)
  assert out["by_batch"]["1"]["host_s"] == pytest.approx(ec.host_seconds(shape, rates, 1))
  assert out["by_batch"]["8"]["host_form"] == "masked"
  assert out["layers"] == {"28": 20, "29": 20, "30": 20, "31": 20}
  forced = ec.report(shape, rates, layers=[3], forced="host", batches=(1, 1024))
  assert forced["stream_from_tokens"] is None and forced["layers"] == {"3": None}
  assert {b["mode"] for b in forced["by_batch"].values()} == {"host"}
  assert json.dumps(forced)


@pytest.mark.parametrize("make, match", [
    (lambda: ec.ExpertRates(0, 1e9, 1e12), "link_bytes_per_s=0"),
    (lambda: ec.ExpertRates(1e9, -1.0, 1e12), "host_bytes_per_s=-1.0"),
    (lambda: ec.ExpertRates(1e9, 1e9, float("nan")), "host_flops=nan"),
    (lambda: ec.ExpertRates(1e9, 1e9, 1e12, round_trip_s=0), "round_trip_s=0"),
    (lambda: ec.ExpertRates(True, 1e9, 1e12), "link_bytes_per_s=True"),
    (lambda: ec.ExpertShape(0, 1, 8, 8, 2), "num_experts=0"),
    (lambda: ec.ExpertShape(8, 9, 8, 8, 2), "experts_per_tok=9: expected at most"),
    (lambda: ec.ExpertShape(8, 2, 8.0, 8, 2), "hidden_size=8.0"),
    (lambda: ec.ExpertShape(8, 2, 8, 8, 2, activation_itemsize=0), "activation_itemsize=0"),
    (lambda: ec.ExpertShape.of(MIXTRAL, "int8"), "dtype='int8'"),
    (lambda: ec.ExpertShape.of(ModelConfig("llama", 10, 8, 16, 1, 2, 2, 4), "float32"),
     "no experts"),
    (lambda: ec.host_seconds(SHAPES["mixtral"], PCIE, 0), "tokens=0"),
    (lambda: ec.host_form(SHAPES["mixtral"], 1.5), "tokens=1.5"),
    (lambda: ec.choose(SHAPES["mixtral"], PCIE, 1, "gpu"), "forced='gpu'"),
    (lambda: ec.stream_from_tokens(SHAPES["mixtral"], PCIE, "cpu"), "forced='cpu'"),
    (lambda: ec.stream_from_tokens(SHAPES["mixtral"], PCIE, limit=0), "limit=0"),
    (lambda: ec.experts_touched(-1, 8, 2), "tokens=-1"),
    (lambda: ec.experts_touched(1, 8, 9), "k=9"),
    (lambda: ec.report(SHAPES["mixtral"], PCIE, layers=[-1]), "layer=-1"),
    (lambda: ec.report(SHAPES["mixtral"], PCIE, layers=[0], forced="x"), "forced='x'"),
])
def test_invalid_inputs_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_hardware_host_figures():
  h100 = hardware.preset("h100-pcie")
  assert (h100.device_memory_bytes, h100.hbm_bytes_per_s, h100.peak_flops,
          h100.link_bytes_per_s) == (81559 * 2**20, 2.0e12, 756e12, 50e9)
  for name, want in {"h100-80gb-pcie4": (200e9, 1e12), "h100-80gb-pcie5": (200e9, 1e12),
                     "h100-pcie": (200e9, 1e12), "h200-141gb": (200e9, 1e12),
                     "gh200": (400e9, 3e12)}.items():
    hw = hardware.preset(name)
    assert (hw.host_bytes_per_s, hw.host_flops) == want
    assert "host" in hw.note
  # The old constructor still works, with the defaults.
  old = hardware.Hardware("x", 1, 1.0, 1.0, 1.0)
  assert (old.host_bytes_per_s, old.host_flops) == (200e9, 1e12)
  for field in ("host_bytes_per_s", "host_flops"):
    with pytest.raises(ValueError, match=f"{field}=0"):
      hardware.Hardware("x", 1, 1.0, 1.0, 1.0, **{field: 0})
