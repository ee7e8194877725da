#!/usr/bin/env bash
# GPU test workflow, run ON the GPU machine from the repository root (no network there):
#
#   tools/gpu_check.sh [SECTION ...]      SECTION: a bench section name, or "all"
#
# 1. installs the wheels carried in .whl/ into /tmp/site and puts it and the checkout on PYTHONPATH
# 2. prints nvidia-smi and the software versions
# 3. compiles every registered kernel for sm_90 (kvarn-cutlass build)
# 4. runs the GPU tests (pytest -m gpu -x), then the full suite
# 5. runs the given `kvarn-cutlass bench` sections, which merge into docs/benchmarks/<gpu>.json
# 6. copies that record to $OUT
#
# Logs go to $OUT (default ./gpu_check_out) through tee, so they survive a failing or killed step.
# Every step runs even when an earlier one failed; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# A fresh compile cache outside the checkout, so this run compiles every kernel it uses.
export KVARN_CUTLASS_CACHE="${KVARN_CUTLASS_CACHE:-/tmp/kvarn-cutlass-cache}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=0

# step NAME CMD...: run CMD with output to the terminal and $OUT/NAME.log; record its status.
step() {
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$OUT/$name.log"
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=$?
  echo "$name: exit $rc" | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || failed=1
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee "$OUT/env.log" || { echo "wheel install failed" | tee -a "$SUMMARY"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels in .whl/; using the installed packages" | tee "$OUT/env.log"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step env nvidia-smi
step env python3 - <<'PY'
import platform, torch
from cuda.bindings import nvrtc, driver
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("nvrtc", nvrtc.nvrtcVersion()[1:], "driver API", driver.cuDriverGetVersion()[1])
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
from kvarn_cutlass.runtime import cache_root, compiler_version
print("compiler", compiler_version(), "cache", cache_root())
PY

step build python3 -m kvarn_cutlass.cli build --arch sm90
step pytest_gpu python3 -m pytest -m gpu -x -q -p no:cacheprovider
step pytest_all python3 -m pytest -q -p no:cacheprovider

if [ "$#" -gt 0 ]; then
  bench_args=()
  for s in "$@"; do
    [ "$s" = "all" ] || bench_args+=(--section "$s")
  done
  step bench python3 -m kvarn_cutlass.cli bench "${bench_args[@]}"
fi

for record in docs/benchmarks/*.json; do
  [ -f "$record" ] && cp "$record" "$OUT/"
done

cat "$SUMMARY"
exit "$failed"
