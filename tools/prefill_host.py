"""Host cost of chunked prefill: is a prompt GPU-bound or host-bound?

The shape of ``kvarn-cutlass bench --section prefill``'s first point (one layer, 32 q / 8 KV heads,
head_dim 128, k4v2_g128, window 256, float16, a 16384-token prompt in 512-token chunks). Prints, per
call, the host time of ``prefill_attention(..., append=False)`` and of ``cache.append`` while the GPU
is kept busy by a sleep kernel queued in front (so no call waits for the GPU), the GPU time of one
chunk's fused kernel at the end of the prompt, and a cProfile of the prefill calls (what the host
time is spent on).

Run on a GPU: python3 tools/prefill_host.py
"""
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package
import kvarn_cutlass as kc
from kvarn_cutlass.bench.timing import elapsed_ms

HQ, HKV, D, P, C = 32, 8, 128, 16384, 512


def host_us(fn, calls: int) -> float:
    """Median host wall time of ``fn()`` over ``calls`` calls, the GPU busy behind a sleep kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: every call below only enqueues
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = kc.KVarNCache(1, 1, HKV, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=P + 64 * C)
    k = torch.randn(1, HKV, P, D, device="cuda", dtype=torch.float16, generator=g)
    cache.append(0, k, torch.randn_like(k))
    q = torch.randn(1, HQ, C, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
    kn = torch.randn(1, HKV, C, D, device="cuda", dtype=torch.float16, generator=g)
    vn = torch.randn_like(kn)
    out = torch.empty_like(q)

    def attend():
        kc.prefill_attention(q, kn, vn, cache, 0, out=out, append=False)

    attend()  # compile and load
    with cache.deferred_checks():
        print(f"prefill_attention(append=False) host: {host_us(attend, 32):.1f} us per call")
        one = kn[:, :, :C]
        print(f"cache.append of {C} tokens host: {host_us(lambda: cache.append(0, one, one), 16):.1f} us per call")
    torch.cuda.synchronize()
    for _ in range(3):
        attend()
    print(f"fused kernel at context {cache.seq_len(0)}: {elapsed_ms(attend, repeats=20) / 20 * 1e3:.1f} us per call "
          "(20 back to back)")

    prof = cProfile.Profile()
    torch.cuda._sleep(2_000_000_000)
    prof.enable()
    for _ in range(32):
        attend()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    print(s.getvalue())


if __name__ == "__main__":
    main()
