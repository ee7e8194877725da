#!/usr/bin/env python3
"""Time the decode kernel's occupancy variants on the four bar shapes and b16/16k against the shipped kernel (GPU).

``python3 tools/decode_variants.py [--variant TEXT ...] [--shape BxT ...] [--runs N] [--json PATH] [--ncu PATH]
[--pdl]``

Variants are ``decode.DecodeVariant`` text forms (default: :data:`CANDIDATES`, the A/B candidates of
docs/perf-notes.md "Decode occupancy"); the shipped kernel (``default``) is always timed first. Shapes: the
bars of ``kvarn_cutlass/bench/decode.py`` (Qwen3-8B heads: 8 KV heads, G = 4, D = 128, k4v2_g128, window
256, fp16 queries; b1/4k, b1/128k, b16/32k, b16/128k; and b16/16k, the e2e bench's decode context), each cache built once with layers rotated past L2 as
the bench does, every time a median of CUDA-graph replays of one launch per layer, per layer.

1. Before any CUDA call every variant is compiled for sm_90 (the ptxas report, with the spills, survives only
   a compile before CUDA starts: see :func:`resources`) and its registers, spills, stack frame, shared memory
   per block and resident blocks per SM (``decode.residency``) are printed.
2. Per shape and variant: the time at the default's split count S0 and the outputs of every layer there
   against the default's, bit for bit (expected equal: the variants change only occupancy, with the same
   operations in the same order and the same exact-part blocks E); the time at the variant's own plan (its
   S from ``choose_splits`` for the residency the driver reports) and its largest difference to the default
   (a different S changes the order of the split merge); on b1/128k, b16/32k and b16/128k a split sweep. The
   default is timed again after the variants (``default_again_us``: the run's drift). Then the A/B that drift
   cannot bias: the default and every variant at S0 in interleaved rounds (each a Williams order; a sample is
   20 replays of a graph of all rotated layers), each variant as the median and range of its ratio to the same
   round's default (``interleaved_vs_default``). cuDNN SDPA, graphed, on the two batch-1 shapes (their bars
   are ratios to it).
3. ``--ncu PATH``: Nsight Compute on b16/32k (``tools/ncu_targets.py decode``, its planned S) for the default
   and the variant fastest there at its own plan: per-SMSP instruction and issue counters (issue- vs
   latency-bound), warps per scheduler and the stall reasons per issued instruction -> PATH.

Prints a table; ``--json`` writes every number. Device time: ~1-1.5 min, ~1 min more with ``--ncu``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvarn_cutlass import decode  # noqa: E402
from kvarn_cutlass.bench import decode as bench  # noqa: E402
from kvarn_cutlass.bench.timing import (  # noqa: E402
    capture_graph, elapsed_ms, interleaved_samples, paired_ratios, time_cuda)
from kvarn_cutlass.format import TileSpec  # noqa: E402
from kvarn_cutlass.runtime import build  # noqa: E402

# The A/B candidates of docs/perf-notes.md "Decode occupancy" (d128 k4v2_g128, G = 4): ring 2 alone (one record
# in flight per block instead of two; 5 blocks by shared memory and registers since the final merge's rows moved
# to shared memory), 5 and 6 resident blocks by min_blocks.
CANDIDATES = ("ring=2", "ring=2,min_blocks=5", "ring=2,min_blocks=6")
SHAPES = ((1, 4096), (1, 131072), (16, 16384), (16, 32768), (16, 131072))
# Split counts swept per shape (every variant): the split cost model's choices (4 at b16 for 4 blocks, 5-6 for
# 5-6 blocks; 65 / 79 / 94 at b1/128k), at b1/128k also 58, the most whose split blocks and 8 exact blocks per
# (sequence, KV head) fit one wave of 4 x 132 (65 leaves 56 blocks to a second wave), and the shorter blocks of
# decode.MAX_TILES_PER_SPLIT's raise around its plans (b16: 9 at 16k, 17 at 32k, 65 at 128k) and beyond.
SWEEPS = {(1, 131072): (33, 58, 65, 79, 94, 130), (16, 16384): (4, 6, 9, 13, 17),
          (16, 32768): (4, 6, 8, 12, 17, 24, 33), (16, 131072): (4, 8, 16, 33, 65, 97)}
SDPA_SHAPES = ((1, 4096), (1, 131072))
NCU_SHAPE = (16, 32768)
NCU_TIMEOUT_S = 150
# Per-SMSP counters (docs/perf-notes.md, decode v2: max / avg of the instructions ~1.0 since the fold is spread)
# and the warps per scheduler; not yet run on this kernel, so a run that rejects them is repeated without them.
NCU_METRICS = ("smsp__inst_executed.avg", "smsp__inst_executed.max",
               "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "smsp__issue_active.max.pct_of_peak_sustained_active",
               "smsp__warps_active.avg.per_cycle_active", "smsp__warps_eligible.avg.per_cycle_active",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed", "gpu__time_duration.sum")
# The stall reasons of tools/gpu_check.sh GPU_NCU_STALLS (collected on the H200 before).
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "wait",
          "not_selected", "dispatch_stall", "lg_throttle", "membar", "branch_resolving", "no_instruction")


def parse_shape(text: str) -> tuple[int, int]:
    """``"BxT"`` -> (batch, context), both positive; argparse reports the error otherwise."""
    try:
        batch, ctx = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not BxT, e.g. 1x32768") from None
    if batch < 1 or ctx < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: batch and context must be positive")
    return batch, ctx


def resources(spec: TileSpec, variant: decode.DecodeVariant) -> dict:
    """Registers, spills, stack and residency of the G <= 4 kernel of ``variant`` (sm_90 build), plus TE.

    The spills come from the ptxas report, which NVRTC leaves empty when it compiles after CUDA started in the
    process (they are None then); the stack frame comes from the CUBIN, and a spill needs one, so a stack of 0
    says that nothing spilled."""
    ks = decode.decode_spec(spec, variant)
    res = build(ks, "sm_90").resources[ks.kernel_names[0]]
    occ = decode.residency(spec, variant)[0]
    return {"registers": res.registers, "spill_store_bytes": res.spill_store_bytes,
            "spill_load_bytes": res.spill_load_bytes, "stack_bytes": res.stack_bytes,
            "smem_per_block": occ.smem_bytes, "blocks_per_sm": occ.blocks, "blocks_by_registers": occ.by_registers,
            "blocks_by_smem": occ.by_smem, "exact_tokens": decode.kernel_layout(spec, None, variant).exact_tokens}


def ncu_command(ncu: str, per_smsp: bool = True) -> list[str]:
    """The Nsight Compute command line of one b16/32k decode launch (the 4th of tools/ncu_targets.py decode):
    sections, the stall reasons per issue and (``per_smsp``) :data:`NCU_METRICS`."""
    metrics = (NCU_METRICS if per_smsp else ()) + tuple(
        f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS)
    return [ncu, "--clock-control", "none", "--kernel-name", "regex:kvarn_decode_n", "--launch-skip", "3",
            "--launch-count", "1", "--section", "SpeedOfLight", "--section", "Occupancy", "--section",
            "SchedulerStats", "--section", "WarpStateStats", "--metrics", ",".join(metrics),
            sys.executable, str(ROOT / "tools" / "ncu_targets.py"), "decode"]


def fastest(rows: list[dict], shape: tuple[int, int]) -> str:
    """The variant (text form) with the least time at its own plan on ``shape``."""
    return min((r for r in rows if (r["batch"], r["context"]) == shape), key=lambda r: r["own_us"])["variant"]


def table(rows: list[dict]) -> str:
    """The per-(shape, variant) rows as a fixed-width text table."""
    head = ("shape", "variant", "blocks", "S0", "us@S0", "equal", "S", "us@S", "vs default", "interleaved @S0",
            "floor/us", "best sweep")
    lines = [" | ".join(head)]
    for r in rows:
        best = min(r["sweep_us"].items(), key=lambda kv: kv[1]) if r["sweep_us"] else None
        lines.append(" | ".join(str(x) for x in (
            f"b{r['batch']}/{r['context'] // 1024}k", r["variant"], r["blocks_per_sm"], r["default_splits"],
            r["at_default_splits_us"], r["equal_to_default"], r["splits"], r["own_us"],
            f"{r['own_us'] / r['default_us']:.3f}",
            "x{:.4f} [{:.4f}, {:.4f}]".format(*r["interleaved_vs_default"]) if "interleaved_vs_default" in r else "-",
            f"{r['floor_us'] / r['own_us']:.3f}",
            f"S={best[0]}: {best[1]}" if best else "-")))
    return "\n".join(lines)


# Interleaved A/B at the default's splits: rounds (at least INTERLEAVED_ROUNDS, two per kernel) in which the default
# and every variant each replay their graph of all rotated layers INTERLEAVED_REPLAYS times, in a Williams order.
INTERLEAVED_ROUNDS = 12
INTERLEAVED_REPLAYS = 20


def graph_sampler(plan, q, layers: int, replays: int):
    """A function that replays a graph of ``plan``'s launches over ``layers`` layers ``replays`` times and returns
    the us per layer (CUDA events around the replays)."""
    import torch

    outs = [torch.full_like(q, float("nan")) for _ in range(layers)]
    g = capture_graph(lambda i: plan.launch(q, i, outs[i]), list(range(layers)))

    def sample() -> float:
        return elapsed_ms(g.replay, repeats=replays) * 1000.0 / (replays * layers)

    sample.keep = (plan, outs, g)  # the graph writes into outs and runs the plan's workspace
    return sample


def _interleaved(cache, q, layers: int, variants: list, splits: int) -> list[tuple[float, float, float]]:
    """Each variant against the default (``variants[0]``), both at ``splits``, in interleaved rounds: the median,
    lowest and highest ratio of its sample to the same round's default sample (``bench.timing.paired_ratios``);
    the default's own entry is its samples' (median, fastest, slowest) us per layer."""
    import statistics

    samplers = [graph_sampler(decode.DecodePlan(cache, splits=splits, variant=v), q, layers, INTERLEAVED_REPLAYS)
                for v in variants]
    for sample in samplers:  # warm
        sample()
    samples = interleaved_samples(samplers, max(INTERLEAVED_ROUNDS, 2 * len(samplers)))
    ref = samples[0]
    return [(round(statistics.median(ref), 2), round(min(ref), 2), round(max(ref), 2))] + [
        tuple(round(x, 4) for x in paired_ratios(t, ref)) for t in samples[1:]]


def _time_shape(batch: int, ctx: int, variants: list[decode.DecodeVariant], runs: int,
                pdl: bool = False) -> tuple[list[dict], dict]:
    """Rows of one shape (see the module docstring) and its extras (cache build time, the default again)."""
    import torch

    spec = TileSpec(preset=bench.PRESET, head_dim=bench.D)
    layers = bench.rotated_layers(batch, ctx)
    t0 = time.perf_counter()
    cache = bench._build_cache(batch, ctx, layers)
    build_s = time.perf_counter() - t0
    floor_us = bench._kvarn_bytes(cache) / (bench.COPY_CEILING_GB_S * 1e9) * 1e6
    g = torch.Generator(device=cache.device).manual_seed(7)
    q = torch.randn(batch, bench.HQ, 1, bench.D, device=cache.device, dtype=torch.float16, generator=g)
    group = bench.HQ // bench.HKV

    def run(variant, splits=None):
        """(us per layer, outputs of every layer, splits) of a graph of the plan's launches."""
        plan = decode.DecodePlan(cache, splits=splits, variant=variant)
        outs = [torch.full_like(q, float("nan")) for _ in range(layers)]
        t = time_cuda(lambda i: plan.launch(q, i, outs[i]), list(range(layers)), warmup=5, runs=runs, graph=True)
        torch.cuda.synchronize()
        return round(t.median_us, 2), outs, plan.workspace(group).splits

    default = decode.DecodeVariant()
    d_us, d_outs, s0 = run(default)
    rows = []
    for v in [default] + variants:
        at_s0_us, outs, _ = (d_us, d_outs, s0) if v == default else run(v, s0)
        own_us, own_outs, s = (at_s0_us, outs, s0) if v == default else run(v)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(own_outs, d_outs))
        sweep = {str(k): run(v, k)[0] for k in SWEEPS.get((batch, ctx), ())}
        rows.append({"batch": batch, "context": ctx, "variant": str(v), "layers_rotated": layers,
                     "occupancy_driver": decode.occupancy(spec, cache.device, v), **resources(spec, v),
                     "default_splits": s0, "default_us": d_us, "at_default_splits_us": at_s0_us,
                     "equal_to_default": all(torch.equal(a, b) for a, b in zip(outs, d_outs)),
                     "splits": s, "own_us": own_us, "max_abs_diff_vs_default": diff, "sweep_us": sweep,
                     "floor_us": round(floor_us, 2),
                     "exact_blocks": decode.exact_blocks(spec, bench.WINDOW, 0, cache.device, v)})
        print(json.dumps(rows[-1]), flush=True)
    extras = {"batch": batch, "context": ctx, "cache_build_s": round(build_s, 1), "default_again_us": run(default)[0]}
    if variants:  # the A/B that drift cannot bias; a failure here is recorded and leaves the rows above standing
        try:
            inter = _interleaved(cache, q, layers, [default] + variants, s0)
        except RuntimeError as e:
            extras["interleaved_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            extras["interleaved_default_us"] = list(inter[0])
            for row, ratio in zip(rows[1:], inter[1:]):
                row["interleaved_vs_default"] = list(ratio)
                print(json.dumps({"variant": row["variant"], "batch": batch, "context": ctx,
                                  "interleaved_vs_default": row["interleaved_vs_default"]}), flush=True)
    if pdl:  # the shipped kernel launched plainly and programmatically, at the default's splits: times, same outputs
        for mode, key in (("0", "plain"), ("1", "pdl")):
            os.environ[decode.PDL_ENV] = mode
            try:
                us, outs, _ = run(default, s0)
            finally:
                os.environ.pop(decode.PDL_ENV)
            extras.update({f"{key}_us": us,
                           f"{key}_equal_to_default": all(torch.equal(a, b) for a, b in zip(outs, d_outs))})
    return rows, extras


def run_ncu(variants: list[str], path: Path) -> list[dict]:
    """Nsight Compute reports of the b16/32k launch for each variant, appended to ``path``."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    out = []
    for v in variants:
        for per_smsp in (True, False):
            with path.open("a") as f:
                f.write(f"\n==== {decode.VARIANT_ENV}={v} (per-SMSP counters: {per_smsp})\n")
            t0 = time.perf_counter()
            with path.open("a") as f:
                try:
                    rc = subprocess.run(ncu_command(ncu, per_smsp), env={**os.environ, decode.VARIANT_ENV: v},
                                        stdout=f, stderr=subprocess.STDOUT, timeout=NCU_TIMEOUT_S,
                                        check=False).returncode
                except (subprocess.TimeoutExpired, OSError) as e:  # recorded; the timing results are written
                    rc = f"{type(e).__name__}: {e}"
            out.append({"variant": v, "per_smsp": per_smsp, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps({"ncu": out[-1]}), flush=True)
            if rc == 0 or not isinstance(rc, int):  # done, or out of time: no second run
                break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", type=decode.DecodeVariant.parse,
                    help="a kernel variant (decode.DecodeVariant text form); repeatable; default: the candidates")
    ap.add_argument("--shape", action="append", type=parse_shape, metavar="BxT",
                    help="a batch x context shape to time instead of the default ones (e.g. 1x32768); repeatable")
    ap.add_argument("--runs", type=int, default=100, help="timed graph replays per measurement")
    ap.add_argument("--json", type=Path, help="write the rows and extras here")
    ap.add_argument("--ncu", type=Path, help="Nsight Compute reports of the default and the fastest variant here")
    ap.add_argument("--pdl", action="store_true",
                    help="also time the shipped kernel launched plainly and with programmatic dependent launch "
                         "($KVARN_DECODE_PDL=0 and 1)")
    args = ap.parse_args(argv)
    variants = [v for v in (args.variant or [decode.DecodeVariant.parse(t) for t in CANDIDATES])
                if v != decode.DecodeVariant()]
    spec = TileSpec(preset=bench.PRESET, head_dim=bench.D)
    for v in [decode.DecodeVariant()] + variants:  # before CUDA starts: the compile log has the spills
        print(json.dumps({"variant": str(v), **resources(spec, v)}), flush=True)

    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        print(f"warning: the variants were compiled for sm_90; this is {torch.cuda.get_device_name()}", flush=True)
    t0 = time.perf_counter()
    rows, extras = [], []
    for batch, ctx in args.shape or SHAPES:
        r, e = _time_shape(batch, ctx, variants, args.runs, args.pdl)
        torch.cuda.empty_cache()  # the shape's cache is gone
        if (batch, ctx) in SDPA_SHAPES:
            e.update(bench._time_sdpa(batch, ctx, bench.BenchOptions(quick=args.runs < 100)))
        rows += r
        extras.append(e)
        print(json.dumps(e), flush=True)
    result = {"rows": rows, "extras": extras, "seconds": round(time.perf_counter() - t0, 1),
              "git_commit": os.environ.get("KVARN_GIT_COMMIT")}
    print(table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.ncu:
        best = fastest(rows, NCU_SHAPE)
        result["ncu"] = run_ncu(["default"] + ([best] if best != "default" else []), args.ncu)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
