"""Where the e2e bench's time goes: GPU time per kernel group, and GPU-busy time against wall time, both caches.

At batch 1, chunk 512 the e2e TTFT was KVarN 1607.7 ms against fp16 1237.4 ms, where the one-layer prefill bench
predicts ~92 ms of attention difference plus ~60-90 ms of appends over 36 layers (~190 ms unexplained), and the
KVarN decode step took 9.2 ms where the weights (16.4 GB) need ~3.5-4 ms at copy bandwidth. This tool splits those
times. It builds the bench's Qwen3-8B-shaped model (``kvarn_cutlass.bench.e2e``'s helpers), warms every path up, and
for each cache times, once unprofiled (CUDA events) and once under ``torch.profiler`` (CUDA activity only):

* ``prefill``: KVarN: ``StaticGreedy.prefill`` (chunked prefill through the fused kernel with the appends and tile
  compression, the first argmax), as the bench's ``ttft_ms_kvarn``; fp16: ``e2e.fp16_prefill`` and the argmax (SDPA
  flash over the filled prefix), as ``ttft_ms_fp16_flash``;
* ``decode``: ``--steps`` graph-replayed decode steps continuing that prefill (KVarN: ``kvarn_step``; fp16: the
  FlashAttention-2 decode baseline, ``e2e.fp16_decode_attention``).

``--host-top N``: the prefill once more on a fresh cache under ``cProfile`` (host time: which Python functions the
GPU waits for when it idles), its N functions of most own time and of most cumulative time printed and written.

Per phase it prints the wall time, the GPU-busy time (the union of the kernels' intervals) and the idle gaps (the
GPU waiting for the host that launches it), and per kernel group (GEMM, KVarN prefill / append / decode / query
rotation, flash attention, elementwise, norms and reductions, copies and indexing, other) the GPU time and launch
count, then the top kernels. ``--json PATH`` writes the numbers.

GPU (one device command; the kernels are built first by tools/gpu_check.sh):
    GPU_TEST_GROUPS=none GPU_E2E_PROFILE=1 bash tools/gpu_check.sh
CPU dry run of the plumbing (eager steps, CPU ops in place of kernels, nested ops counted in each group: no
measurement): ``python3 tools/e2e_profile.py --device cpu --tiny --layers 2 --prompt 256 --chunk 128 --steps 2``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package

import torch  # noqa: E402

from kvarn_cutlass.bench import e2e  # noqa: E402

# a small shape for the CPU dry run (head_dim 128, as the library's presets take it)
TINY = {**e2e.QWEN3_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128}
# kernel (or CPU op) name -> group, first match wins
GROUPS = (("kvarn prefill", r"kvarn_prefill"), ("kvarn append/compress", r"kvarn_(append|compress|commit)"),
          ("kvarn decode", r"kvarn_decode"), ("kvarn rotation", r"kvarn_wht"), ("kvarn other", r"kvarn"),
          ("flash attention", r"flash_fwd|pytorch_flash|flash::"), ("other attention", r"fmha|attention|cudnn"),
          ("gemm", r"gemm|gemv|nvjet|xmma|cutlass|cublas|aten::(mm|addmm|bmm|matmul|linear)\b"),
          ("norm/reduce", r"reduce|norm|softmax|aten::(mean|sum|pow|rsqrt)\b"),
          ("copy/index", r"copy|index|cat|scatter|gather|fill|memcpy|memset|arange|aten::(to|clone|zeros|empty)"),
          ("elementwise", r"elementwise|vectorized|unrolled|pointwise|aten::(mul|add|neg|silu|sigmoid|where)\b"))


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if re.search(pattern, name)), "other")


def analyse(events: list[tuple[str, float, float]], wall_ms: float, per: int, top: int) -> dict:
    """Kernel events (name, start us, duration us) of a phase run ``per`` times: per group and per name the time
    (ms per run) and count, the busy time (union of the intervals), its idle gaps, against ``wall_ms`` per run."""
    groups: dict[str, list] = {}
    names: dict[str, list] = {}
    for name, _, dur in events:
        for table, key in ((groups, group_of(name)), (names, name)):
            acc = table.setdefault(key, [0.0, 0])
            acc[0] += dur / 1e3 / per
            acc[1] += 1
    busy, gaps, end = 0.0, [], None
    for _, start, dur in sorted(events, key=lambda e: e[1]):
        if end is not None and start > end:
            gaps.append(start - end)
        lo = start if end is None else max(start, end)
        busy += max(0.0, start + dur - lo)
        end = start + dur if end is None else max(end, start + dur)
    span = (end - min(e[1] for e in events)) / 1e3 / per if events else 0.0
    return {"wall_ms": round(wall_ms, 4), "profiled_span_ms": round(span, 4), "busy_ms": round(busy / 1e3 / per, 4),
            "busy_of_wall": round(busy / 1e3 / per / wall_ms, 4) if wall_ms else None, "launches": len(events) / per,
            "gaps_over_5us": sum(g > 5 for g in gaps) / per,
            "gap_ms_over_5us": round(sum(g for g in gaps if g > 5) / 1e3 / per, 4),
            "largest_gap_ms": round(max(gaps, default=0.0) / 1e3, 4),
            "groups": {g: {"ms": round(t, 4), "count": c / per}
                       for g, (t, c) in sorted(groups.items(), key=lambda x: -x[1][0])},
            "top": [{"name": n[:110], "ms": round(t, 4), "count": c / per}
                    for n, (t, c) in sorted(names.items(), key=lambda x: -x[1][0])[:top]]}


def profiled(fn, cuda: bool) -> list[tuple[str, float, float]]:
    """The kernel events (CPU op events off CUDA) of one call of ``fn``, from the profiler's exported trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    cats = {"kernel", "gpu_memcpy", "gpu_memset"} if cuda else {"cpu_op"}
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in cats]


def wall(fn, cuda: bool) -> float:
    """ms of one call of ``fn``: between CUDA events (one synchronization at the end), or host time off CUDA."""
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return e2e._elapsed_ms(fn)  # the bench's own timing of a TTFT


def prefilled(model, kind: str, ids, chunk: int, steps: int, cuda: bool):
    """(prefill, make_decode): the phase's prefill as a callable, and after it the StaticGreedy whose ``step()`` then
    replays the decode (its first call: the eager step and the capture)."""
    from transformers import StaticCache

    from kvarn_cutlass.hf.static_step import StaticGreedy

    n = ids.shape[1]
    if kind == "kvarn":
        run = StaticGreedy(model, ids, steps + 2, e2e._cache_for(model, "kvarn", n + steps + 2), chunk, graph=cuda)
        return run.prefill, lambda: run
    model.set_attn_implementation("sdpa")  # the fp16 cache's prefill attention (e2e._cache_for's)
    cache = StaticCache(config=model.config, max_cache_len=n + steps + 2)
    first = {}

    def prefill():
        first["token"] = e2e.fp16_prefill(model, ids, cache, chunk).argmax(-1, keepdim=True)

    def decode():
        run = StaticGreedy(model, first["token"], steps + 2, cache, 1, graph=cuda, decode_attn=e2e._decode_attn("fp16"))
        run.prefill()  # the prefill's first token into the cache (one sdpa forward, not timed)
        return run

    return prefill, decode


def host_profile(fn, cuda: bool, top: int) -> dict:
    """``fn`` once under cProfile (one synchronization at the end): its wall ms and the ``top`` functions by own time
    and by cumulative time, each [function, calls, own ms, cumulative ms]."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    fn()
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    wall_ms = (time.perf_counter() - t) * 1e3
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def rows(key):
        best = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [[f"{Path(f).name}:{line}({name})", calls, round(own * 1e3, 3), round(cum * 1e3, 3)]
                for (f, line, name), (_, calls, own, cum, _) in best]

    return {"wall_ms": round(wall_ms, 3), "by_own": rows(2), "by_cumulative": rows(3)}


def phases(model, kind: str, ids, chunk: int, steps: int, cuda: bool, top: int, host_top: int = 0) -> dict:
    """{"prefill": ..., "decode": ...} of the cache ``kind``, each :func:`analyse`'s dict: the wall time from an
    unprofiled run, the kernels from a profiled one on a fresh cache (the decode: per step); with ``host_top``,
    "prefill_host": :func:`host_profile` of the prefill on a third fresh cache."""
    out = {}
    if host_top:
        e2e._release()
        prefill, _ = prefilled(model, kind, ids, chunk, steps, cuda)
        out["prefill_host"] = host_profile(prefill, cuda, host_top)
        prefill = None
    for mode in ("wall", "profile"):
        e2e._release()
        prefill, make_decode = prefilled(model, kind, ids, chunk, steps, cuda)
        if mode == "wall":
            times = {"prefill": wall(prefill, cuda)}
        else:
            out["prefill"] = analyse(profiled(prefill, cuda), times["prefill"], 1, top)
        run = make_decode()
        run.step()  # eager, and the capture on CUDA
        replays = lambda r=run: [r.step() for _ in range(steps)]  # noqa: E731
        if mode == "wall":
            times["decode"] = wall(replays, cuda) / steps
        else:
            out["decode"] = analyse(profiled(replays, cuda), times["decode"], steps, top)
        run.finish()
        run = replays = prefill = make_decode = None  # the cache and the graph freed before the next one allocates
    e2e._release()
    return out


def report(kind: str, phase: str, r: dict, cuda: bool) -> str:
    busy, launches = ("GPU busy", "launches") if cuda else ("CPU ops busy", "ops")
    lines = [f"== {kind} {phase}: wall {r['wall_ms']:.3f} ms (unprofiled), {busy} {r['busy_ms']:.3f} ms "
             f"({100 * (r['busy_of_wall'] or 0):.0f}% of wall), profiled span {r['profiled_span_ms']:.3f} ms, "
             f"{r['launches']:.0f} {launches}, idle gaps > 5 us: {r['gaps_over_5us']:.0f} summing "
             f"{r['gap_ms_over_5us']:.3f} ms (largest {r['largest_gap_ms']:.3f} ms)"]
    lines += [f"  {g:<24} {v['ms']:10.3f} ms {v['count']:8.0f} x" for g, v in r["groups"].items()]
    lines += ["  top:"] + [f"    {t['ms']:9.3f} ms {t['count']:7.0f} x  {t['name']}" for t in r["top"]]
    return "\n".join(lines)


def host_report(kind: str, r: dict) -> str:
    lines = [f"== {kind} prefill host (cProfile): wall {r['wall_ms']:.3f} ms"]
    for title, key in (("own time", "by_own"), ("cumulative", "by_cumulative")):
        lines += [f"  by {title}: calls, own ms, cumulative ms"]
        lines += [f"    {c:8d} {o:10.3f} {cum:10.3f}  {f}" for f, c, o, cum in r[key]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16384, help="prompt tokens (random ids)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--steps", type=int, default=16, help="graph-replayed decode steps timed (after the captured one)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a small shape (hidden 256, 8 q / 2 KV heads) for a dry run")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per phase")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--host-top", type=int, default=0,
                    help="also profile each prefill's host time (cProfile) and list this many functions")
    args = ap.parse_args(argv)
    if args.host_top < 0:
        ap.error("--host-top must be >= 0")
    for name in ("layers", "batch", "prompt", "chunk", "steps", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be positive")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    shape = TINY if args.tiny else e2e.QWEN3_8B
    t = time.perf_counter()
    model = e2e._build_model(args.layers, args.device, shape)
    if cuda:
        e2e._warm_up(model, (args.chunk,))  # every kernel loaded and compiled before anything is timed
    print(f"e2e_profile: {args.layers} layers ({'tiny' if args.tiny else 'Qwen3-8B'} shape), batch {args.batch}, "
          f"prompt {args.prompt}, chunk {args.chunk}, {args.steps} decode steps on {args.device}; setup "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    g = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.prompt), generator=g, device=args.device)
    results = {"args": vars(args), "torch": torch.__version__}
    for kind in e2e.KINDS:
        results[kind] = phases(model, kind, ids, args.chunk, args.steps, cuda, args.top, args.host_top)
        for phase, r in results[kind].items():
            print(host_report(kind, r) if phase == "prefill_host" else report(kind, phase, r, cuda), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
