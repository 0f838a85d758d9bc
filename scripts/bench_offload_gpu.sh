#!/usr/bin/env bash
# Weight offload on a GPU, in one go: numerics, link bandwidth, step time against the bound.
#
#   scripts/bench_offload_gpu.sh [out_dir]        # default: $OUT, else ./bench_offload_gpu_out
#
# 1. The prefetch-scan equivalence tests on the GPU (offloaded == resident, tight tolerance).
# 2. `scripts/bench_offload.py --mode=device` for each run in RUNS: pinned host -> device bandwidth
#    of device_put by size, then a Llama-8B-sized synthetic model (16 layers of ~436 MB in bf16) for
#    a decode and a prefill step: resident, and 8 tail layers offloaded at each depth in DEPTHS,
#    each against max(N t_c, n L / link) with the link measured in the same run.
# RUNS lists flag-set:fetch-order pairs. Flag sets: "default" (XLA out of the box), "lhs" (the
# latency-hiding scheduler, which lets async host copies overlap compute), "lhs_pipelined" (plus
# pipelined host offloading, which moves host copies across loop iterations). Fetch orders of the
# prefetch scan: "none" (index from the loop counter only) or "data" (tied to the previous layer's
# output, what CPU uses to avoid carry copies).
# Budget: roughly 3 minutes per run on an H100/H200 (estimate, not yet measured); shrink RUNS,
# DEPTHS or ROUNDS to go faster. BENCH_ARGS adds flags to bench_offload.py (e.g. a smaller
# synthetic model: BENCH_ARGS="--synthetic_layers=8 --synthetic_hidden=256").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-bench_offload_gpu_out}}"
ROUNDS="${ROUNDS:-5}"
DEPTHS="${DEPTHS:-1,2,4}"
RUNS="${RUNS:-default:none lhs_pipelined:none default:data}"
mkdir -p "$OUT_DIR"

{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv || true; python -c "import jax; print(jax.__version__, jax.devices())"; } \
  | tee "$OUT_DIR/device.txt"

timeout 180 python -m pytest tests/test_offload.py -q -x -p no:cacheprovider \
  -k "equals or streams_exactly" 2>&1 | tail -5 | tee "$OUT_DIR/tests.txt" || true

declare -A FLAG_SETS=(
  [default]=""
  [lhs]="--xla_gpu_enable_latency_hiding_scheduler=true"
  [lhs_pipelined]="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_pipelined_host_offloading=true"
)
for run in $RUNS; do
  name="${run%%:*}"; order="${run##*:}"
  echo "== flags=$name order=$order" >&2
  XLA_FLAGS="${FLAG_SETS[$name]}" timeout 300 python scripts/bench_offload.py --mode=device \
    --offloaded=0,8 --depths="$DEPTHS" --rounds="$ROUNDS" --order="$order" ${BENCH_ARGS:-} \
    > "$OUT_DIR/bench_${name}_${order}.json" 2> "$OUT_DIR/bench_${name}_${order}.log" \
    || echo "flags=$name order=$order failed: see $OUT_DIR/bench_${name}_${order}.log" >&2
done
python - "$OUT_DIR" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "bench_*.json"))):
  try:
    r = json.load(open(path))
  except ValueError:
    continue
  print(os.path.basename(path), "link GB/s", {k: round(v, 1) for k, v in r["link_gbps_by_mib"].items()})
  for step in ("decode", "prefill"):
    for row in r[step]:
      print(f"  {step:7s} n={row['offloaded']} d={row['depth']} step={row['step_ms']:.2f} ms "
            f"bound={row['bound_ms']:.2f} predicted={row['predicted_ms']:.2f} "
            f"x_bound={row['ratio_to_bound']:.2f}")
PY
