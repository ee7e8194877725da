"""``kvarn-cutlass tune``: offline sweep of tile x cluster x schedule per bucket -> gemm_configs/sm90.json.

* a usable sm_90 GPU is checked first (one line and exit status 1 without one; ``--dry-run`` needs none);
* candidates: :func:`sweep` (valid configs for the bucket's problem, via the validators);
* compile: all candidates in parallel (process pool; nvcc is the bottleneck), disk-cached;
* time: CUDA events, warm-up, median over runs, inputs rotating over several sets (L2 cold);
* resumable: every successful (bucket, config) measurement is appended to a state file (JSON lines)
  and skipped on restart (failed ones are retried);
* output: the best measured config per bucket with its TOPS-equivalent and provenance, ``status:
  tuned``; buckets without a successful measurement keep their entry, and the file is not written
  at all when no bucket was measured.
``--dry-run`` lists the sweep without a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..cli.argtypes import positive_int, regex
from .config import GemmConfig, validate_for_problem
from .configs import (BUCKET_FORMAT, D_BUCKETS, M_BUCKETS, OUT_BUCKETS, T_BUCKETS, config_dir, gemm_depth,
                      parse_bucket, untuned_table)

TILES_M = {"pingpong": (64,), "cooperative": (128, 256), "streamk": (128, 256)}
TILES_N = (64, 128, 256)
TILES_K = (64, 128, 256)
CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))
L_TUNE = 128  # tiles per bucket measurement (one KV head, 16k tokens at T=128)


def all_buckets() -> list[str]:
    return [f"M{m}_T{t}_D{d}_{o}" for m in M_BUCKETS for t in T_BUCKETS for d in D_BUCKETS for o in OUT_BUCKETS]


def sweep(bucket: str) -> list[GemmConfig]:
    M, T, D, out = parse_bucket(bucket)
    K = gemm_depth(D)
    cands = []
    for ks, tms in TILES_M.items():
        for tm, tn, tk, (cm, cn) in itertools.product(tms, TILES_N, TILES_K, CLUSTERS):
            cfg = GemmConfig(tile_m=tm, tile_n=tn, tile_k=tk, cluster_m=cm, cluster_n=cn, kernel_schedule=ks,
                             out_dtype=out)
            if validate_for_problem(cfg, M, T, K, L_TUNE)[0]:
                cands.append(cfg)
    return sorted(set(cands))


def _compile_one(cfg_dict: dict) -> tuple[dict, str]:
    from .compile import build_gemm

    try:
        build_gemm(GemmConfig.from_dict(cfg_dict), 90)
        return cfg_dict, ""
    except Exception as e:  # report and skip this candidate
        return cfg_dict, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def _provenance() -> dict[str, Any]:
    import torch

    try:
        from importlib.metadata import version

        cutlass_v = version("nvidia-cutlass")
    except Exception:
        cutlass_v = "unknown"
    from cuda.bindings import driver

    err, drv = driver.cuDriverGetVersion()
    return {"gpu": torch.cuda.get_device_name(), "driver": f"{drv // 1000}.{drv % 1000 // 10}",
            "cuda": torch.version.cuda, "nvidia_cutlass": cutlass_v, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "tool": "kvarn-cutlass tune"}


def _measure(cfg: GemmConfig, bucket: str, runs: int) -> dict[str, Any]:
    import torch

    from ..bench.timing import rotation_count, time_cuda
    from .launcher import KScoreGemm

    M, T, D, out = parse_bucket(bucket)
    L = L_TUNE
    K = gemm_depth(D)
    dev = torch.device("cuda", torch.cuda.current_device())
    ot = {"f16": torch.float16, "f32": torch.float32}[out]
    per = L * (M * K + T * K + M * T * (2 if out == "f16" else 4))
    sets = []
    for _ in range(min(rotation_count(per), 4)):
        hi_lo = torch.cat((torch.randint(-127, 128, (L, M, D), dtype=torch.int8, device=dev),
                           torch.randint(-8, 9, (L, M, D), dtype=torch.int8, device=dev)), -1)
        c = torch.randint(-8, 8, (L, T, D), dtype=torch.int8, device=dev)
        sets.append((hi_lo, torch.cat((c * 16, c), -1),
                     torch.rand(L, M, device=dev), torch.randn(L, M, device=dev), torch.rand(L, T, device=dev),
                     torch.empty(L, M, T, dtype=ot, device=dev)))
    g = KScoreGemm(M, T, K, L, out, config=cfg, device=dev)
    t = time_cuda(lambda s: g.run(s[0], s[1], s[2], s[3], s[4], 0.1, s[5]), sets, warmup=10, runs=runs)
    # TOPS-equivalent of the attention-score GEMM it replaces (2*M*T*D), as the bars are stated.
    return {"time_us": t.median_us, "tops": 2 * M * T * D * L / (t.median_us * 1e-6) / 1e12, "timing": t.to_dict()}


DEFAULT_JOBS = max(1, (os.cpu_count() or 2) // 2)
DEFAULT_RUNS = 50
DESCRIPTION = (
    "Sweep the CUTLASS K-score GEMM's tile x cluster x schedule candidates for each shape bucket on an sm_90 "
    "GPU (compile all candidates with nvcc in parallel, then time each with CUDA events, median of --runs) "
    "and write the fastest config per bucket into gemm_configs/sm90.json (with its TOPS and provenance). "
    "Checks for the GPU before compiling anything; resumable through --state; --dry-run lists the sweep "
    "without a GPU."
)


def bucket_arg(text: str) -> str:
    """argparse type of --buckets: a key of the GEMM config table (see :func:`kvarn_cutlass.gemm.configs.parse_bucket`)
    or of the fused prefill kernel's (``D128_T128_V2``; :func:`kvarn_cutlass.ops.prefill_tune.parse_bucket`)."""
    if text.startswith("D"):
        from ..ops.prefill_tune import parse_bucket as parse_prefill_bucket

        try:
            parse_prefill_bucket(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    try:
        parse_bucket(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="sweep K-score GEMM configs per shape bucket (GPU) -> gemm_configs/sm90.json",
                              description=DESCRIPTION)
    p.add_argument("--buckets", nargs="+", type=bucket_arg, metavar="BUCKET",
                   help=f"bucket keys {BUCKET_FORMAT}, e.g. M4096_T128_D128_f16 "
                        f"(default: all {len(all_buckets())} buckets)")
    p.add_argument("--filter", type=regex, default=None, metavar="REGEX",
                   help="only candidates whose config name matches REGEX (re.search), e.g. a shortlist "
                        "(default: every candidate)")
    p.add_argument("--kernel", choices=("gemm", "prefill"), default="gemm",
                   help="gemm: the CUTLASS K-score GEMM (gemm_configs/sm90.json); prefill: the fused prefill "
                        "kernel's configs (gemm_configs/prefill_sm90.json; buckets like D128_T128_V2; times one "
                        "512-token chunk over a 16k context per candidate, checked against the torch path) "
                        "(default: gemm)")
    p.add_argument("--dry-run", action="store_true", help="list the sweep, no compile, no GPU")
    p.add_argument("--jobs", type=positive_int, default=DEFAULT_JOBS, metavar="N",
                   help=f"parallel nvcc compiles (default {DEFAULT_JOBS}: half the CPU cores)")
    p.add_argument("--runs", type=positive_int, default=DEFAULT_RUNS, metavar="N",
                   help=f"timed runs per candidate (default {DEFAULT_RUNS})")
    p.add_argument("--state", default=None, metavar="FILE",
                   help="state file of finished measurements (default: <kernel cache>/tune_sm90_state.jsonl)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="output JSON (default: gemm_configs/sm90.json of the checkout)")
    return p


def require_sm90_gpu() -> str:
    """The name of the current CUDA device once it has answered an allocation and is sm_90.

    Raises RuntimeError saying what is missing (no CUDA device, another architecture, a device that
    fails its first allocation)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("tune measures on an sm_90 GPU and torch sees no CUDA device "
                           "(--dry-run lists the sweep without one)")
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise RuntimeError(f"tune measures the sm_90a K-score GEMM; this GPU ({name}) is sm_{major}{minor}")
    try:
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as e:  # a busy, broken or MIG-less device: say it now, not after hours of nvcc
        raise RuntimeError(f"the GPU {name} does not answer an allocation: {type(e).__name__}: {e}") from None
    return name


def compile_all(configs: list[GemmConfig], jobs: int) -> dict[str, str]:
    """Build every config (nvcc, disk-cached) in ``jobs`` processes; returns {config name: error} of the
    failures, with a progress line per config on stderr."""
    failed: dict[str, str] = {}
    print(f"compiling {len(configs)} kernels with {jobs} jobs", file=sys.stderr)
    from ..cli.workers import worker_pool

    with worker_pool(jobs) as ex:
        for i, (cd, err) in enumerate(ex.map(_compile_one, [c.to_dict() for c in configs]), 1):
            name = GemmConfig.from_dict(cd).name
            if err:
                failed[name] = err
            print(f"[{i}/{len(configs)}] {name} {'FAILED ' + err if err else 'ok'}", file=sys.stderr, flush=True)
    return failed


def _write_json_atomic(path: Path, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run(args: argparse.Namespace) -> int:
    if args.kernel == "prefill":
        return _run_prefill(args)
    if args.buckets and any(b.startswith("D") for b in args.buckets):
        raise SystemExit(f"error: --buckets {' '.join(b for b in args.buckets if b.startswith('D'))}: prefill buckets "
                         "need --kernel prefill")
    buckets = args.buckets or all_buckets()
    plan = {b: sweep(b) for b in buckets}
    if args.filter:
        plan = {b: [c for c in cands if args.filter.search(c.name)] for b, cands in plan.items()}
    if args.dry_run:
        total = 0
        for b, cands in plan.items():
            print(f"{b}: {len(cands)} configs")
            for c in cands:
                print(f"  {c.name}")
            total += len(cands)
        uniq = len({c for cs in plan.values() for c in cs})
        print(f"total: {total} measurements over {len(plan)} buckets, {uniq} distinct kernels to compile")
        return 0
    require_sm90_gpu()
    from ..runtime import cache_root

    out_path = Path(args.output) if args.output else config_dir() / "sm90.json"
    table = json.loads(out_path.read_text()) if out_path.is_file() else untuned_table(90)  # unreadable: fail now
    state_path = Path(args.state) if args.state else cache_root() / "tune_sm90_state.jsonl"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[str, str], dict] = {}
    if state_path.is_file():
        for line in state_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if "tops" in r:  # earlier versions also logged failures; those are retried
                    done[(r["bucket"], r["config_name"])] = r
    # 1. compile every distinct candidate in parallel
    uniq = sorted({c for cs in plan.values() for c in cs})
    todo = [c for c in uniq if any((b, c.name) not in done for b, cs in plan.items() if c in cs)]
    failed = compile_all(todo, args.jobs)
    # 2. time
    errors = 0
    with state_path.open("a") as st:
        n = sum(len(cs) for cs in plan.values())
        i = 0
        for b, cands in plan.items():
            for c in cands:
                i += 1
                if (b, c.name) in done or c.name in failed:
                    continue
                try:
                    r = _measure(c, b, args.runs)
                except Exception as e:  # report and skip this candidate; never a table entry
                    errors += 1
                    print(f"[{i}/{n}] {b} {c.name} FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                          file=sys.stderr, flush=True)
                    continue
                rec = {"bucket": b, "config_name": c.name, "config": c.to_dict(), **r}
                done[(b, c.name)] = rec
                st.write(json.dumps(rec) + "\n")
                st.flush()
                print(f"[{i}/{n}] {b} {c.name} {r['tops']:.1f} TOPS", file=sys.stderr, flush=True)
    # 3. the table: only buckets with a successful measurement change
    prov = None
    tuned = []
    for b in plan:
        recs = [r for (bb, _), r in done.items() if bb == b]
        if not recs:
            continue
        prov = prov or _provenance()
        best = max(recs, key=lambda r: r["tops"])
        table["buckets"][b] = {"config": best["config"], "status": "tuned", "tops": round(best["tops"], 2),
                               "time_us": round(best["time_us"], 2), "candidates": len(recs),
                               "filter": args.filter.pattern if args.filter else None, "provenance": prov}
        tuned.append(b)
    summary = f"{len(failed)} candidate(s) failed to compile, {errors} measurement(s) failed"
    if not tuned:
        print(f"kvarn-cutlass tune: no bucket has a successful measurement ({summary}); {out_path} is unchanged",
              file=sys.stderr)
        return 1
    _write_json_atomic(out_path, table)
    print(f"wrote {out_path}: {len(tuned)} of {len(plan)} bucket(s) tuned; {summary}", file=sys.stderr)
    return 0


def _run_prefill(args: argparse.Namespace) -> int:
    from ..ops.prefill import CANDIDATES, FusedConfig
    from ..ops.prefill_tune import DEFAULT_BUCKETS, parse_bucket as parse_prefill_bucket, run_tune

    buckets = args.buckets or list(DEFAULT_BUCKETS)
    wrong = [b for b in buckets if not b.startswith("D")]
    if wrong:
        raise SystemExit(f"error: --buckets {' '.join(wrong)}: GEMM buckets; --kernel prefill takes D<d>_T<t>_V<v>[_lm]")
    if args.dry_run:
        for b in buckets:
            spec = parse_prefill_bucket(b)
            cands = [c.name for c in CANDIDATES if c.fits(spec.head_dim, spec.tile_tokens)
                     and (not args.filter or args.filter.search(c.name))]
            print(f"{b}: {len(cands)} configs")
            for c in cands:
                print(f"  {c}")
        return 0
    require_sm90_gpu()
    return run_tune(buckets, reps=args.runs, output=args.output)

