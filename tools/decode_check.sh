#!/usr/bin/env bash
# Quick decode check on a GPU machine (~40 s): build the decode kernels, run the decode GPU tests, and
# time the default plans graph-replayed at batch 1 / 4k, 16k, 128k and batch 16 / 32k (no SDPA; the
# full comparison is `kvarn-cutlass bench --section decode`).
#   from this machine: run(command="bash tools/decode_check.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} KVARN_CUTLASS_CACHE=${KVARN_CUTLASS_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
python3 -m kvarn_cutlass.cli build --arch sm90 --family decode --jobs "$(nproc)" >/dev/null || exit 1
timeout 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_decode_gpu.py 2>&1 | tail -3
timeout 90 python3 -W ignore - <<'PY'
import json
from kvarn_cutlass.bench import BenchOptions
from kvarn_cutlass.bench.decode import _time_kvarn
o = BenchOptions(quick=True)
for b, c in ((1, 4096), (1, 16384), (1, 131072), (16, 32768)):
    r = _time_kvarn(b, c, o)
    print(json.dumps({k: r[k] for k in ("batch", "context", "splits", "graph_us", "eager_us", "gb_per_s_graph")}), flush=True)
PY
