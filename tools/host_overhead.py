"""Host cost of the one-token ``KVarNCache.append`` (issue 16's ``host_us``) and of its parts.

The case of ``kvarn-cutlass bench --section append``: one layer, 8 KV heads, head_dim 128, k4v2_g128,
window 256, float16, one token per call, no tile completing, every call inside ``deferred_checks``
(no synchronization). Per call, medians over rounds of 127 calls (the T - 1 appends between two
compressions; between rounds the window is truncated back, or the round's last append completes a tile):

* ``append``: ``cache.append(0, k, v)``, the bench's ``host_us`` measure;
* ``completing``: the 128th append of a round, which completes a tile (two launches), and
  ``amortized``: the round's 128 appends per call (the bench's ``amortized_host_us``);
* ``appender``: ``DeviceAppender.append`` alone (argument writes and the launch);
* ``launch``: ``PreparedLaunch.launch`` of the commit kernel alone;
* ``checks``: ``append - appender`` (argument checks, the plan, length bookkeeping);
* CUDA only: ``refresh``, ``DecodePlan.refresh(0)``; ``decode_launch``, ``DecodePlan.launch`` of a
  fresh q per call (32 query heads; its fast path); ``decode_ragged``, the same launch through
  ``decode_attention_ragged`` with the full checks (what ``DecodePlan.launch`` ran on every call before,
  here with its prepared-launch dict hitting every time).

``--prompt``: instead, the host time of each of the 32 appends of a 16k prompt in 512-token chunks (``--chunk``
sets another length: 2048 takes the one-CTA compression form at batch 1) to a fresh
cache inside one ``deferred_checks`` block (the bench's ``prefill_compress``, whose ``host_ms`` was 2.2 ms on an
H200 host against 1.4 ms of GPU work): ``construct_us`` (the fresh cache's constructor, which on CUDA builds the
appender and prepares its launches), ``prompt_first_us`` (the cache's first append: the layer's backups and
buffers), ``prompt_rest_us`` (the median of the other 31), ``prompt_total_us``, medians
over ``--rounds`` fresh caches (after one warm-up cache); ``prompt_first_parts_us``: in as many more fresh
caches, the first append's wall time inside each of its parts (inclusive, so they overlap: ``cache_append`` is
the whole call, ``device_append`` holds the prepares and launches, ``prepare_*`` hold ``pack``; medians);
``prompt_rest_launch_us``: in as many more, the wall time of each ``PreparedLaunch.launch`` of the later appends
by kernel (the driver's ``cuLaunchKernelEx`` and the binding around it; medians); ``--profile N`` also prints the N most
expensive functions of one fresh cache's 32 appends (cProfile, cumulative).

On a CUDA machine everything is real (``python3 tools/host_overhead.py``; add ``--bench`` for the
bench's own append rows). Without one (``--device cpu``, the default there) the cache lives on the
CPU and its device path runs on stand-in kernels that take tensors as addresses, with the CUDA
driver replaced by a stub library compiled here with ``cc`` (its entry points return success at
once): that times every Python-side cost, the cuda-bindings calls included, but not the driver's own
launch work, which only a GPU machine shows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package

_STUB_DRIVER = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
static void *current = (void *)0x1000;
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { return 0; }
CUresult cuGetProcAddress_v2(const char *sym, void **fn, int version, uint64_t flags, int *status) {
  static const struct { const char *name; void *fn; } table[] = {
    {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent}, {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx}, {"cuGetProcAddress", (void *)cuGetProcAddress_v2}};
  for (unsigned i = 0; i < sizeof table / sizeof table[0]; ++i)
    if (!strcmp(sym, table[i].name)) { *fn = table[i].fn; if (status) *status = 0; return 0; }
  *fn = 0;
  if (status) *status = 1;
  return 500; /* CUDA_ERROR_NOT_FOUND */
}
CUresult cuGetProcAddress(const char *sym, void **fn, int version, uint64_t flags) {
  return cuGetProcAddress_v2(sym, fn, version, flags, 0);
}
"""


def _load_stub_driver() -> None:
    """Compile the stub and load it under libcuda's soname, before cuda-bindings looks for the driver
    (its dlopen of libcuda.so.1 then finds the loaded stub)."""
    with tempfile.TemporaryDirectory(prefix="kvarn_stub_cuda_") as tmp:  # (a loaded library needs no file)
        src, lib = Path(tmp) / "stub.c", Path(tmp) / "libcuda.so.1"
        src.write_text(_STUB_DRIVER)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", str(src), "-o", str(lib)],
                       check=True)
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _stand_in_kernels(spec_signatures):
    """Kernels of a fake module on the stub driver: prepare() takes tensors as their addresses."""
    import torch
    from cuda.bindings import driver

    from kvarn_cutlass.runtime.module import Kernel, _parse_signature

    class _Module:
        device_index = 0
        _ctx = driver.cuCtxGetCurrent()[1]

    class HostKernel(Kernel):
        def __init__(self, name, signature):
            super().__init__(_Module(), name, _parse_signature(name, signature), driver.CUfunction(0x10))
            self._current_stream = lambda index: 0  # the CPU torch has no CUDA stream to ask for

        def prepare(self, grid, block, args, shared_mem=0, cluster=None, programmatic=False):
            args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
            return super().prepare(grid, block, args, 0, cluster, programmatic)  # no shared-memory opt-in on the stub

    return tuple(HostKernel(name, sig) for name, sig in spec_signatures)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--bench", action="store_true", help="also run the bench's append rows (CUDA)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--prompt", action="store_true", help="time a fresh cache's prompt appends instead (docstring)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="with --prompt: cProfile's top N functions")
    ap.add_argument("--chunk", type=int, default=512, help="with --prompt: tokens per append (a divisor of 16384)")
    args = ap.parse_args(argv)

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cpu":
        _load_stub_driver()
    import kvarn_cutlass as kc
    from kvarn_cutlass.ops import append as A

    if args.prompt:
        return prompt_appends(args, device, kc, A)
    B, H, D, T, W, P = args.batch, 8, 128, 128, 256, 1000
    cache = kc.KVarNCache(1, B, H, D, window=W, dtype=torch.float16, device=device,
                          max_seq_len=P + (args.rounds + 4) * T)
    if device == "cpu":
        cache._writer = _stand_in_appender(cache, A)
    g = torch.Generator(device=device).manual_seed(B)
    kv = lambda n: tuple(torch.randn(B, H, n, D, device=device, generator=g).half() for _ in range(2))  # noqa: E731
    cache.append(0, *kv(P))
    while cache.positions(0)["window"][1] - cache.positions(0)["window"][0] != W - T + 1:
        cache.append(0, *kv(1))  # just after a compression: the next T - 1 appends complete no tile
    toks = [kv(1) for _ in range(T)]
    st, writer = cache._layers[0], cache._writer

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, last=None) -> tuple[float, float]:
        """Medians over the rounds of the wall time per call of fn(0) .. fn(T - 2) inside a deferred_checks
        block and of last() after them (0 without it: the window is rewound instead); round 0 warms up
        (first launches, caches)."""
        start = cache.seq_len(0)
        times, lasts = [], []
        for r in range(args.rounds + 1):
            with cache.deferred_checks():
                t0 = time.perf_counter()
                for i in range(T - 1):
                    fn(i)
                t1 = time.perf_counter()
                if last is not None:
                    last()
                t2 = time.perf_counter()
            sync()
            if last is None:
                cache.truncate(0, start)
            if r:
                times.append((t1 - t0) * 1e6 / (T - 1))
                lasts.append((t2 - t1) * 1e6)
        return statistics.median(times), statistics.median(lasts)

    res = {"device": device, "batch": B, "kv_heads": H, "head_dim": D, "window": W, "calls_per_round": T - 1,
           "rounds": args.rounds}
    res["append_us"], res["completing_us"] = timed(lambda i: cache.append(0, *toks[i]),
                                                   lambda: cache.append(0, *toks[T - 1]))
    res["amortized_us"] = ((T - 1) * res["append_us"] + res["completing_us"]) / T
    res["appender_us"] = timed(lambda i: writer.append(st, toks[i][0], toks[i][1], 1, 0, None))[0]
    commit = writer._commit_launch.launch
    res["launch_us"] = timed(lambda i: commit.launch())[0]
    res["checks_us"] = res["append_us"] - res["appender_us"]
    if device == "cuda":
        from kvarn_cutlass.decode import DecodePlan

        from kvarn_cutlass.decode import decode_attention_ragged

        plan = DecodePlan(cache)
        res["refresh_us"] = timed(lambda i: plan.refresh(0))[0]
        qs = [torch.randn(B, 32, 1, D, device=device, generator=g).half() for _ in range(T - 1)]
        out = torch.empty_like(qs[0])
        res["decode_launch_us"] = timed(lambda i: plan.launch(qs[i], 0, out))[0]
        buf, lens, ws, prepared = cache.buffers(0), cache.device_lengths(), plan.workspace(32 // H), {}
        res["decode_ragged_us"] = timed(lambda i: decode_attention_ragged(
            qs[0], cache.tile_pool(0), buf["window_k"], buf["window_v"], buf["sink_k"], buf["sink_v"], lens[0, 0],
            lens[0, 1], lens[0, 2], cache.spec, out=out, workspace=ws, tile_table=cache.tile_table(0),
            _prepared=prepared))[0]
        if args.bench:
            from kvarn_cutlass.bench import BenchOptions
            from kvarn_cutlass.bench.compress import run_append

            res["bench_append"] = run_append(BenchOptions())
    res = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:>16}: {v}")


def _stand_in_appender(cache, A):
    return A.DeviceAppender(cache, kernels=_stand_in_kernels(
        [("append_compress", A.APPEND_COMPRESS_SIGNATURE), ("append_commit", A.APPEND_COMMIT_SIGNATURE),
         ("append_snapshot", A.SNAPSHOT_SIGNATURE)]))


def prompt_appends(args, device: str, kc, A) -> None:
    """The ``--prompt`` mode (module docstring)."""
    import cProfile
    import io
    import pstats

    import torch

    B, H, D, P, C = args.batch, 8, 128, 16384, args.chunk
    g = torch.Generator(device=device).manual_seed(P + C)
    k = torch.randn(B, H, P, D, device=device, generator=g).half()
    v = torch.randn(B, H, P, D, device=device, generator=g).half()

    constructed: list[float] = []

    def fresh():
        t0 = time.perf_counter()
        cache = kc.KVarNCache(1, B, H, D, window=256, dtype=torch.float16, device=device, max_seq_len=P)
        if device == "cpu":  # what a CUDA cache's constructor does, with stand-in kernels
            cache._writer = _stand_in_appender(cache, A)
            cache._writer.prepare_launches(cache._layers[0])
        constructed.append((time.perf_counter() - t0) * 1e6)
        return cache

    from kvarn_cutlass.runtime.module import Kernel, PreparedLaunch

    parts = {"cache_append": (kc.KVarNCache, "append"), "check_pair": (kc.KVarNCache, "_check_pair"),
             "appender_init": (A.DeviceAppender, "__init__"), "backup": (kc.KVarNCache, "_backup"),
             "prepare_commit": (A.DeviceAppender, "_prepare_commit"),
             "prepare_compress": (A.DeviceAppender, "_prepare_compress"), "pack": (Kernel, "_pack"),
             "launch": (PreparedLaunch, "launch"), "device_append": (A.DeviceAppender, "append")}
    first_parts: dict[str, list[float]] = {name: [] for name in parts}

    def timed_parts(call) -> None:
        """call() with the wall time of each of ``parts`` (inclusive) added to first_parts."""
        spent = dict.fromkeys(parts, 0.0)
        saved = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}

        def wrap(name, fn):
            def timed(*a, **kw):
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    spent[name] += (time.perf_counter() - t) * 1e6
            return timed

        for name, (owner, attr) in parts.items():
            setattr(owner, attr, wrap(name, saved[name]))
        try:
            call()
        finally:
            for name, (owner, attr) in parts.items():
                setattr(owner, attr, saved[name])
        for name, us in spent.items():
            first_parts[name].append(us)

    launch_us: dict[str, list[float]] = {}  # kernel name -> wall time of each PreparedLaunch.launch call

    def timed_launches(call) -> None:
        """call() with the wall time of every kernel launch in it added to launch_us, by kernel name."""
        saved = PreparedLaunch.launch

        def launch(self, stream=None):
            t = time.perf_counter()
            try:
                return saved(self, stream)
            finally:
                launch_us.setdefault(self.kernel.name, []).append((time.perf_counter() - t) * 1e6)

        PreparedLaunch.launch = launch
        try:
            call()
        finally:
            PreparedLaunch.launch = saved

    def one_prompt(profile=None, breakdown=False, launches=False) -> list[float]:
        cache, per = fresh(), []
        with cache.deferred_checks():
            if profile is not None:
                profile.enable()
            for s in range(0, P, C):
                call = lambda: cache.append(0, k[:, :, s:s + C], v[:, :, s:s + C])  # noqa: E731
                if breakdown and not s:
                    timed_parts(call)
                    continue
                if launches:
                    if s:  # the later appends' launches (the first append's are in prompt_first_parts_us)
                        timed_launches(call)
                    else:
                        call()
                    continue
                t0 = time.perf_counter()
                call()
                per.append((time.perf_counter() - t0) * 1e6)
            if profile is not None:
                profile.disable()
        if device == "cuda":
            torch.cuda.synchronize()
        return per

    one_prompt()  # warm-up: modules and kernel lookups of the first cache in a process
    runs = [one_prompt() for _ in range(args.rounds)]
    for _ in range(args.rounds):
        one_prompt(breakdown=True)
    for _ in range(args.rounds):
        one_prompt(launches=True)
    res = {"device": device, "batch": B, "kv_heads": H, "head_dim": D, "prompt_tokens": P, "chunk_tokens": C,
           "rounds": args.rounds,
           "construct_us": round(statistics.median(constructed[1:]), 1),
           "prompt_first_us": round(statistics.median(r[0] for r in runs), 1),
           "prompt_rest_us": round(statistics.median(statistics.median(r[1:]) for r in runs), 1),
           "prompt_total_us": round(statistics.median(sum(r) for r in runs), 1),
           "prompt_first_parts_us": {name: round(statistics.median(us), 1) for name, us in first_parts.items()},
           "prompt_rest_launch_us": {name: round(statistics.median(us), 1) for name, us in launch_us.items()}}
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for key, val in res.items():
            print(f"{key:>16}: {val}")
    if args.profile:
        prof = cProfile.Profile()
        one_prompt(prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.profile)
        print(out.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    main()
