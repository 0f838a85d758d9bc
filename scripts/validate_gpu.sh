#!/usr/bin/env bash
# Checks the accelerator path on a GPU (or TPU) machine that has JAX but maybe not jaxtier's other
# dependencies, and writes one JSON object (see scripts/validate_gpu.py for what it checks).
#
#   scripts/validate_gpu.sh OUT.json [validate_gpu.py flags]
#
# Python packages the machine lacks are installed from wheels in .whl/ (if that folder exists)
# into a private directory with --no-deps, never over the machine's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-validate_gpu.json}"
shift || true
PYTHON="${PYTHON:-python3}"
site="${TMPDIR:-/tmp}/jaxtier-validate-site"
missing=()
for pair in gguf:gguf rpds:rpds_py ml_collections:ml_collections flax:flax; do
  module="${pair%%:*}"; wheel="${pair##*:}"
  if ! "$PYTHON" -c "import $module" 2>/dev/null; then
    missing+=("$wheel")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  wheels=()
  for name in "${missing[@]}"; do
    wheels+=($(ls .whl/"$name"-*.whl 2>/dev/null || true))
  done
  if [ "${#wheels[@]}" -gt 0 ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/validate_gpu.py --out="$out" "$@"
