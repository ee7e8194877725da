#!/usr/bin/env bash
# GPU test workflow, run ON the GPU machine from the repository root (no network there):
#
#   tools/gpu_check.sh [SECTION ...]      SECTION: a bench section name, or "all"
#   from this machine: run(command="bash tools/gpu_check.sh decode", carry=[".whl"])
#   (the device copy's .git can be stale: on 2026-12-01 it reported b877392 for every tree sent, so put
#    KVARN_GIT_COMMIT=<git rev-parse --short=12 HEAD here> in front of the command; the bench records it)
#   (the GPU machine has no network; fetch the wheels it lacks here first, into the ignored .whl/:
#    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#      --platform manylinux_2_17_x86_64 -d .whl nvidia-cutlass==4.2.0.0 pydot treelib platformdirs filelock tqdm \
#      pytest-xdist execnet)
#
# 1. installs the wheels carried in .whl/ into /tmp/site and puts it and the checkout on PYTHONPATH
# 2. prints nvidia-smi and the software versions
# 3. compiles every registered kernel for sm_90 on all CPU cores (kvarn-cutlass build --jobs; NVRTC)
# 3b. GPU_TUNE="BUCKET[,BUCKET]" (or "default"): times the fused prefill kernel's candidate configs of those
#    buckets (kvarn-cutlass tune; `tune --dry-run` lists them), writing gemm_configs/prefill_sm90.json
#    (copied to $OUT); GPU_TUNE_RUNS (default 10) timed runs per candidate
# 4. runs the GPU tests one group (test file family) at a time, each under its own time limit, so
#    that one hanging or slow group cannot eat the device budget of the others
# 5. runs the given `kvarn-cutlass bench` sections, which merge into docs/benchmarks/<gpu>.json
# 5b. GPU_BASELINE_TREE=DIR (a carried tree of another revision): the same sections from there too
#    -> $OUT/baseline-<gpu>.json (see the step)
# 6. copies that record to $OUT (at once, and again at the end)
# 6b. GPU_NCU=1: Nsight Compute reports (counters; --clock-control none) of the compress, decode
#    partials and fused prefill kernels in their bench shapes -> $OUT/ncu.txt (GPU_NCU_STALLS=1: stall
#    reasons too; GPU_NCU_TARGETS picks the kernels: compress decode decode_b1_16k decode_b1_128k prefill
#    prefill_c2048 prefill_d256;
#    GPU_NCU_SOURCE=1: per-SASS-instruction stall samples as CSV -> $OUT/ncu_source.tgz)
# 6b0. GPU_PREFILL_PHASES=1 (or CONFIG): tools/prefill_phases.py, the fused prefill kernel's tile and exact phases
#    per query-key pair against SDPA flash -> $OUT/prefill_phases.json
# 6b'''. GPU_E2E_PROFILE=1: tools/e2e_profile.py (the e2e bench's time per kernel group, both caches)
#    -> $OUT/e2e_profile.json (GPU_E2E_PROFILE_ARGS: more arguments)
# 6b''''. GPU_DECODE_VARIANTS=1 (or "VARIANT ..."): tools/decode_variants.py, the decode kernel's occupancy
#    variants on the four bar shapes against the shipped kernel -> $OUT/decode_variants.json
#    (GPU_DECODE_VARIANTS_NCU=1: ncu of the default and the fastest variant -> $OUT/ncu_decode_variants.txt;
#    GPU_DECODE_PDL=1: the shipped kernel launched plainly and with programmatic dependent launch too;
#    GPU_DECODE_VARIANTS_SHAPES="1x16384 1x32768": those shapes instead of the bar shapes)
# 6b''''x. GPU_DECODE_TIMING=1 (or its shapes, "16x32768 1x131072"): tools/decode_timing_check.py, the decode layer
#    and graphed cuDNN timed both ways the bench and the variant tool time a replay -> $OUT/decode_timing.json
# 6b''''t. GPU_DECODE_TRACE=1 (or its shapes, "1x131072 16x32768"): tools/decode_trace.py, a decode layer's blocks'
#    timeline (the trace variant: entry, first records, tile loop, ticket, merge) -> $OUT/decode_trace.json;
#    GPU_DECODE_TRACE_VARIANT="plan merge_group=8" traces each of those variants ("plan": each shape's plan's own;
#    the default when unset)
# 6b'''''. GPU_HOST_OVERHEAD="ARGS": tools/host_overhead.py ARGS (e.g. "--prompt --profile 30") -> the log
# 6b5. GPU_COMPRESS_VARIANTS=1 (or the tool's arguments, e.g. "--warps 8 --cta-warps 32"): tools/compress_variants.py,
#    the compression kernels' warps per cluster CTA (8 shipped, 4, 16) and per lone CTA (32 shipped, 16): bytes
#    against the shipped kernel, layer graph_us, the prompt's appends by form (b1, and b16 for the one-CTA
#    widths), back to back and after GEMMs -> $OUT/compress_variants.json
# 7. GPU_PPL=1: the perplexity rows of docs/accuracy.md on CUDA, one JSON line each in $OUT/ppl.jsonl
#    (GPU_PPL_ROWS=REGEX: only the rows whose step name matches, e.g. w128)
#    (needs the reference model: .carry/shared/{models,data} carried, or $KVARN_SHARED_DIR)
# 8. GPU_GENERATE=1: the greedy-agreement rows of docs/accuracy.md on CUDA -> $OUT/generate.jsonl
# Device time is scarce (30 minutes a session): GPU_TEST_LIMIT (default 120 s per group) and
# GPU_BENCH_LIMIT (default 300 s) bound the steps; GPU_BENCH_QUICK=1 passes --quick to the bench;
# GPU_BENCH_PARTS="PART ..." passes --part PART for each to the e2e section, in a bench run of its own after the
# other sections' (the section that runs in parts:
# `kvarn-cutlass bench --section e2e --list-parts` names them and groups them into commands);
# GPU_BENCH_OUT=DIR passes --out DIR (results.json, results.md, plots) and packs DIR into
# $OUT/bench-results.tgz (one file: the tool returns at most 8);
# GPU_TEST_GROUPS (default: all; "none": no tests) picks the test groups; GPU_TEST_K=EXPR passes -k EXPR
# to each group; GPU_TEST_ARGS="ARG ..." passes more pytest arguments (e.g. "-rs --durations=15": the slow
# tests; -v adds nothing beside the -q here); GPU_TEST_PARALLEL=1 runs the groups at once.
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

# step NAME CMD...: run CMD with output to the terminal and $OUT/gpu_check.log; record its status.
step() {
  local name=$1
  shift
  # One log file for all steps: the device tool returns at most 8 files from $OUT.
  echo "== $name: $*" | tee -a "$OUT/gpu_check.log"
  "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
  local rc=$?
  echo "$name: exit $rc" | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || failed=1
}

# copy_records: the benchmark records to $OUT; right after the bench too, so that a later step which runs the
# call past its time limit (the command is killed, and what is under $OUT comes back) cannot lose them
copy_records() {
  for record in docs/benchmarks/*.json; do
    [ -f "$record" ] && cp "$record" "$OUT/"
  done
}

# append_row FILE ARGS...: append the JSON document on stdin to FILE as one line, tagged with ARGS.
append_row() {
  local file=$1
  shift
  python3 -c "import json, sys; print(json.dumps({'args': sys.argv[1:], **json.load(sys.stdin)}))" "$@" >>"$file"
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee -a "$OUT/gpu_check.log" || { echo "wheel install failed" | tee -a "$SUMMARY"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels in .whl/; using the installed packages" | tee -a "$OUT/gpu_check.log"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

SHARED_DIR="${KVARN_SHARED_DIR:-}"
if [ -z "$SHARED_DIR" ] && [ -d .carry/shared ]; then SHARED_DIR="$PWD/.carry/shared"; fi
[ -n "$SHARED_DIR" ] && export KVARN_SHARED_DIR="$SHARED_DIR"

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

# GPU_BUILD=0 skips it: kernels then compile on first use (cheaper when a run uses few of them).
# GPU_BUILD_FAMILIES="prefill_fused dequant ...": build only those kernel families.
build_args=()
for f in ${GPU_BUILD_FAMILIES:-}; do build_args+=(--family "$f"); done
[ "${GPU_BUILD:-1}" = 0 ] || step build python3 -m kvarn_cutlass.cli build --arch sm90 --jobs "$(nproc)" "${build_args[@]}"
if [ -n "${GPU_TUNE:-}" ]; then
  tune_args=(--runs "${GPU_TUNE_RUNS:-10}")
  [ "$GPU_TUNE" = default ] || tune_args+=(--buckets ${GPU_TUNE//,/ })
  step tune timeout "${GPU_TUNE_LIMIT:-240}" python3 -m kvarn_cutlass.cli tune "${tune_args[@]}"
  cp gemm_configs/prefill_sm90.json "$OUT/"
fi

limit=${GPU_TEST_LIMIT:-120}
# GPU_TEST_PARALLEL=1: the groups run at once (one process each; their logs are written whole, one
# group after another, once all have finished); the GPU has room for several test processes.
group_log="$OUT/groups"
[ -z "${GPU_TEST_PARALLEL:-}" ] || mkdir -p "$group_log"
for group in ${GPU_TEST_GROUPS:-runtime compress append rotate decode prefill hf e2e}; do
  files=$(ls tests/test_${group}*.py 2>/dev/null)
  [ -n "$files" ] || continue
  if [ -n "${GPU_TEST_PARALLEL:-}" ]; then
    (
      timeout "$limit" python3 -m pytest -m gpu -q --maxfail=10 -p no:cacheprovider ${GPU_TEST_ARGS:-} \
        ${GPU_TEST_K:+-k "$GPU_TEST_K"} $files >"$group_log/$group.log" 2>&1
      echo "gpu_$group: exit $?" >>"$SUMMARY"
    ) &
  else
    step "gpu_$group" timeout "$limit" python3 -m pytest -m gpu -q --maxfail=10 -p no:cacheprovider ${GPU_TEST_ARGS:-} \
      ${GPU_TEST_K:+-k "$GPU_TEST_K"} $files
  fi
done
if [ -n "${GPU_TEST_PARALLEL:-}" ]; then
  wait
  for f in "$group_log"/*.log; do
    echo "== $(basename "$f" .log) (parallel)" | tee -a "$OUT/gpu_check.log"
    tee -a "$OUT/gpu_check.log" <"$f"
  done
  rm -rf "$group_log"
  grep -q ": exit [1-9]" "$SUMMARY" && failed=1
fi

if [ "$#" -gt 0 ]; then
  bench_args=()
  [ -n "${GPU_BENCH_QUICK:-}" ] && bench_args+=(--quick)
  [ -n "${GPU_BENCH_OUT:-}" ] && bench_args+=(--out "$GPU_BENCH_OUT")
  # the bench takes --part with exactly one section: with GPU_BENCH_PARTS the parts go to the one section that
  # runs in parts (e2e), in a bench run of its own after the other sections' run
  sections=() parted=()
  for s in "$@"; do
    if [ -n "${GPU_BENCH_PARTS:-}" ] && [ "$s" = e2e ]; then
      parted=(--section e2e)
      for part in $GPU_BENCH_PARTS; do parted+=(--part "$part"); done
    elif [ "$s" != all ]; then
      sections+=(--section "$s")
    fi
  done
  if [ -n "${GPU_BENCH_PARTS:-}" ] && [ "${#parted[@]}" -eq 0 ]; then
    echo "gpu_check: GPU_BENCH_PARTS needs the e2e section among the bench sections" | tee -a "$OUT/gpu_check.log"
    echo "bench: exit 2" | tee -a "$SUMMARY"
    failed=1
  else
    if [ "${#sections[@]}" -gt 0 ] || [ "${#parted[@]}" -eq 0 ]; then
      step bench timeout "${GPU_BENCH_LIMIT:-300}" python3 -m kvarn_cutlass.cli bench "${bench_args[@]}" "${sections[@]}"
    fi
    [ "${#parted[@]}" -eq 0 ] || step bench_parts timeout "${GPU_BENCH_LIMIT:-300}" python3 -m kvarn_cutlass.cli bench \
      "${bench_args[@]}" "${parted[@]}"
  fi
  if [ -n "${GPU_BENCH_OUT:-}" ] && [ -d "$GPU_BENCH_OUT" ]; then
    tar czf "$OUT/bench-results.tgz" -C "$GPU_BENCH_OUT" .
  fi
  copy_records
  # 5b. GPU_BASELINE_TREE=DIR: the same bench sections from another revision's tree, right after this tree's on the
  #     same warm GPU (an A/B of two revisions in one call; each row has its own baseline, e.g. graphed cuDNN, from
  #     the same run) -> $OUT/baseline-<record>.json. DIR is carried: `git archive REV | tar -x -C .carry/base`
  #     here, carry=[".whl", ".carry"]; GPU_BASELINE_COMMIT=REV is what its record names as its commit.
  #     tools/decode_compare.py $OUT/baseline-<record>.json $OUT/<record>.json puts the decode rows side by side.
  if [ -n "${GPU_BASELINE_TREE:-}" ] && [ "${#sections[@]}" -gt 0 ]; then
    base_tree=$(cd "$GPU_BASELINE_TREE" && pwd)
    base_start="$OUT/.baseline_start"
    touch "$base_start"
    step bench_baseline env -C "$base_tree" PYTHONPATH="$base_tree:$PYTHONPATH" \
      KVARN_GIT_COMMIT="${GPU_BASELINE_COMMIT:-unknown}" KVARN_CUTLASS_CACHE="$KVARN_CUTLASS_CACHE-baseline" \
      timeout "${GPU_BENCH_LIMIT:-300}" python3 -m kvarn_cutlass.cli bench "${bench_args[@]}" "${sections[@]}"
    # only the record this run wrote: the tree's other records are that revision's old numbers
    for record in "$base_tree"/docs/benchmarks/*.json; do
      [ "$record" -nt "$base_start" ] && cp "$record" "$OUT/baseline-$(basename "$record")"
    done
    rm -f "$base_start"
  fi
fi

if [ -n "${GPU_NCU:-}" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # GPU_NCU_STALLS=1: also the average warps stalled per issue, by reason
  STALL_METRICS=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard \
    short_scoreboard mio_throttle math_pipe_throttle wait not_selected dispatch_stall lg_throttle membar \
    branch_resolving no_instruction)
  STALL_METRICS=${STALL_METRICS%,}
  # GPU_NCU_SOURCE=1: also per-SASS-instruction counters (SourceCounters: warp-stall samples, executed
  # instructions) of each target, printed from its report as CSV into $OUT/ncu_source.tgz
  src_dir="$OUT/ncu_source"
  [ -z "${GPU_NCU_SOURCE:-}" ] || mkdir -p "$src_dir"
  ncu_one() {  # TARGET KERNEL_REGEX
    local rep=()
    [ -z "${GPU_NCU_SOURCE:-}" ] || rep=(--section SourceCounters --export "$src_dir/$1" --force-overwrite)
    timeout "${GPU_NCU_LIMIT:-90}" "$NCU" --clock-control none --kernel-name "regex:$2" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis ${GPU_NCU_STALLS:+--metrics "$STALL_METRICS"} \
      "${rep[@]}" python3 tools/ncu_targets.py "$1" >>"$OUT/ncu.txt" 2>&1
    local rc=$?
    if [ -n "${GPU_NCU_SOURCE:-}" ] && [ -f "$src_dir/$1.ncu-rep" ]; then
      "$NCU" --import "$src_dir/$1.ncu-rep" --page details >>"$OUT/ncu.txt" 2>&1
      "$NCU" --import "$src_dir/$1.ncu-rep" --page source --csv --print-source sass >"$src_dir/$1.sass.csv" 2>&1
      rm -f "$src_dir/$1.ncu-rep"
    fi
    return $rc
  }
  for t in ${GPU_NCU_TARGETS:-compress decode prefill}; do
    case $t in
      compress) step ncu_compress ncu_one compress kvarn_compress ;;
      decode*) step "ncu_$t" ncu_one "$t" kvarn_decode_n ;;
      prefill*) step "ncu_$t" ncu_one "$t" kvarn_prefill_fused ;;
    esac
  done
  [ -z "${GPU_NCU_SOURCE:-}" ] || { tar czf "$OUT/ncu_source.tgz" -C "$src_dir" . && rm -rf "$src_dir"; }
fi

# 6b0. GPU_PREFILL_PHASES=1 (or a config name): the fused prefill kernel's per-pair time in its tile and exact
#     phases against SDPA flash (tools/prefill_phases.py) -> $OUT/prefill_phases.json
if [ -n "${GPU_PREFILL_PHASES:-}" ]; then
  phase_args=(--json "$OUT/prefill_phases.json")
  [ "$GPU_PREFILL_PHASES" = 1 ] || phase_args+=(--config "$GPU_PREFILL_PHASES")
  step prefill_phases timeout "${GPU_PREFILL_PHASES_LIMIT:-180}" python3 tools/prefill_phases.py "${phase_args[@]}"
fi

# 6b'. GPU_PREFILL_VARIANTS="ARG ..." (or "tuned"): which role of the fused prefill kernel sets its pace, and the
#     A/B forms (tools/prefill_variants.py's arguments: D<head_dim>, only=VARIANT,..., config names); several runs
#     separated by ";" (e.g. "D256 only=k_batch_4; only=k_batch_4": head_dim 256, then 128), each a step of its own
#     with the carried wheels on the path (a tool run after gpu_check.sh in the same command has no such path)
if [ -n "${GPU_PREFILL_VARIANTS:-}" ]; then
  IFS=';' read -ra variant_runs <<<"$GPU_PREFILL_VARIANTS"
  for variant_run in "${variant_runs[@]}"; do
    read -ra variant_args <<<"$variant_run"
    [ "${#variant_args[@]}" -gt 0 ] || continue
    [ "${variant_args[*]}" != tuned ] || variant_args=()
    step prefill_variants timeout "${GPU_PREFILL_VARIANTS_LIMIT:-240}" python3 tools/prefill_variants.py "${variant_args[@]}"
  done
fi

# 6b''. GPU_PREFILL_HOST=1: host time of prefill_attention and append against the fused kernel's GPU time,
#     and a cProfile of the calls (tools/prefill_host.py)
[ -z "${GPU_PREFILL_HOST:-}" ] || step prefill_host timeout 180 python3 tools/prefill_host.py

# 6b'''. GPU_E2E_PROFILE=1: where the e2e bench's prefill and decode time goes, both caches: GPU time per kernel
#     group, GPU-busy against wall time (tools/e2e_profile.py; GPU_E2E_PROFILE_ARGS adds arguments, e.g.
#     "--batch 16") -> $OUT/e2e_profile.json
[ -z "${GPU_E2E_PROFILE:-}" ] || step e2e_profile timeout "${GPU_E2E_PROFILE_LIMIT:-300}" python3 tools/e2e_profile.py \
  --json "$OUT/e2e_profile.json" ${GPU_E2E_PROFILE_ARGS:-}

# 6b'''''. GPU_HOST_OVERHEAD="ARGS": tools/host_overhead.py ARGS (host time of the cache's appends; e.g. "--prompt
#     --profile 30": a fresh cache's 32 prompt appends, first and rest, with cProfile's top functions) -> the log
[ -z "${GPU_HOST_OVERHEAD:-}" ] || step host_overhead timeout "${GPU_HOST_OVERHEAD_LIMIT:-120}" python3 tools/host_overhead.py \
  ${GPU_HOST_OVERHEAD}

# 6b''''. GPU_DECODE_VARIANTS=1 or "VARIANT ..." (decode.DecodeVariant text forms, e.g. ring=2,min_blocks=6):
#     the occupancy variants timed graph-replayed on b1/4k, b1/128k, b16/32k, b16/128k at the default's splits
#     (outputs compared bit for bit) and at their own plans, with split sweeps (tools/decode_variants.py; 1:
#     its candidates) -> $OUT/decode_variants.json; GPU_DECODE_VARIANTS_NCU=1 adds Nsight Compute on b16/32k
#     for the default and the fastest variant (per-SMSP counters, stall reasons) -> $OUT/ncu_decode_variants.txt
if [ -n "${GPU_DECODE_VARIANTS:-}" ]; then
  dv_args=(--json "$OUT/decode_variants.json")
  [ "$GPU_DECODE_VARIANTS" = 1 ] || for v in $GPU_DECODE_VARIANTS; do dv_args+=(--variant "$v"); done
  for s in ${GPU_DECODE_VARIANTS_SHAPES:-}; do dv_args+=(--shape "$s"); done
  [ -z "${GPU_DECODE_VARIANTS_NCU:-}" ] || dv_args+=(--ncu "$OUT/ncu_decode_variants.txt")
  [ -z "${GPU_DECODE_PDL:-}" ] || dv_args+=(--pdl)
  step decode_variants timeout "${GPU_DECODE_VARIANTS_LIMIT:-480}" python3 tools/decode_variants.py "${dv_args[@]}"
fi

if [ -n "${GPU_DECODE_TRACE:-}" ]; then
  tr_args=(--json "$OUT/decode_trace.json")
  [ "$GPU_DECODE_TRACE" = 1 ] || for s in $GPU_DECODE_TRACE; do tr_args+=(--shape "$s"); done
  for v in ${GPU_DECODE_TRACE_VARIANT:-}; do tr_args+=(--variant "$v"); done
  step decode_trace timeout "${GPU_DECODE_TRACE_LIMIT:-240}" python3 tools/decode_trace.py "${tr_args[@]}"
fi

if [ -n "${GPU_DECODE_TIMING:-}" ]; then
  dt_args=(--json "$OUT/decode_timing.json")
  [ "$GPU_DECODE_TIMING" = 1 ] || for s in $GPU_DECODE_TIMING; do dt_args+=(--shape "$s"); done
  step decode_timing timeout "${GPU_DECODE_TIMING_LIMIT:-300}" python3 tools/decode_timing_check.py "${dt_args[@]}"
fi

if [ -n "${GPU_COMPRESS_VARIANTS:-}" ]; then
  cv_args=()
  [ "$GPU_COMPRESS_VARIANTS" = 1 ] || cv_args=($GPU_COMPRESS_VARIANTS)
  step compress_variants timeout "${GPU_COMPRESS_VARIANTS_LIMIT:-300}" python3 tools/compress_variants.py \
    --json "$OUT/compress_variants.json" "${cv_args[@]}"
fi

# 6c. GPU_SANITIZE="TARGET ...": compute-sanitizer memcheck and racecheck over tools/ncu_targets.py TARGET
#     (small shapes, e.g. prefill_small) -> $OUT/sanitize.txt; GPU_SANITIZE_TOOLS="TOOL ..." picks the
#     tools instead (e.g. "racecheck synccheck" for the compression cluster's mbarrier exchange)
if [ -n "${GPU_SANITIZE:-}" ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for t in $GPU_SANITIZE; do
    for tool in ${GPU_SANITIZE_TOOLS:-memcheck racecheck}; do
      step "sanitize_${tool}_$t" timeout "${GPU_SANITIZE_LIMIT:-150}" "$SAN" --tool "$tool" --error-exitcode 3 \
        --report-api-errors no \
        --kernel-name kns=kvarn_ python3 tools/ncu_targets.py "$t"
    done
  done
fi

if [ -n "${GPU_PPL:-}" ] && [ -n "$SHARED_DIR" ]; then
  ppl() {  # one row of docs/accuracy.md: ARGS...
    timeout "${GPU_PPL_LIMIT:-150}" python3 -m kvarn_cutlass.cli perplexity --model "$SHARED_DIR/models/kvarn-ref-lm" \
      --text "$SHARED_DIR/data/code_eval.txt" --ctx 2048 --windows 6 --device cuda --batch 6 --no-progress --json "$@" \
      | append_row "$OUT/ppl.jsonl" "$@"
  }
  ppl_row() {  # NAME ARGS...: one perplexity step, skipped unless NAME matches GPU_PPL_ROWS
    [[ "$1" =~ ${GPU_PPL_ROWS:-.} ]] && step "$1" ppl "${@:2}"
  }
  ppl_row ppl_k4v2_w256 --preset k4v2_g128 --window 256
  ppl_row ppl_k4v2_w256_prefill --preset k4v2_g128 --window 256 --method prefill --chunk 512
  ppl_row ppl_k4v4_w256 --preset k4v4_g128 --window 256
  ppl_row ppl_k4v2_w128 --preset k4v2_g128 --window 128
  ppl_row ppl_k4v4_w128 --preset k4v4_g128 --window 128
  ppl_row ppl_k4v2_none --preset k4v2_g128 --window 0 --method sim
  ppl_row ppl_k4v4_none --preset k4v4_g128 --window 0 --method sim
  ppl_row ppl_k4v2_none_prefill --preset k4v2_g128 --window 0 --view prefill --method sim
  ppl_row ppl_k4v4_none_prefill --preset k4v4_g128 --window 0 --view prefill --method sim
  ppl_row ppl_k4v2_w256_lm --preset k4v2_g128 --window 256 --quantizer lloyd_max
  ppl_row ppl_k4v4_w256_lm --preset k4v4_g128 --window 256 --quantizer lloyd_max
fi

if [ -n "${GPU_GENERATE:-}" ] && [ -n "$SHARED_DIR" ]; then
  gen() {  # one greedy-agreement row: ARGS...
    timeout "${GPU_GENERATE_LIMIT:-120}" python3 -m kvarn_cutlass.cli generate --model "$SHARED_DIR/models/kvarn-ref-lm" \
      --prompts-from "$SHARED_DIR/data/code_eval.txt" --num-prompts 8 --prompt-tokens 1024 --max-new-tokens 256 \
      --window 256 --device cuda --teacher-forced --json "$@" \
      | append_row "$OUT/generate.jsonl" "$@"
  }
  step generate_k4v4 gen --preset k4v4_g128
  step generate_k4v2 gen --preset k4v2_g128
fi

copy_records
cat "$SUMMARY"
exit "$failed"
