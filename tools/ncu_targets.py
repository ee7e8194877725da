#!/usr/bin/env python
"""Launch one kernel family in its benchmark shape, for Nsight Compute (hardware counters).

``ncu --clock-control none --kernel-name regex:NAME --launch-skip 3 --launch-count 1 \\
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
      python tools/ncu_targets.py TARGET``

Targets (each launches its kernel 5 times: warm-up launches first, so ``--launch-skip 3`` profiles a
steady-state launch):

* ``compress``: one layer, 8 KV heads, D=128, one 128-token tile each, k4v2_g128 (kvarn_compress_*);
* ``decode``: batch 16, 32k context, 32 q / 8 KV heads (kvarn_decode_n1_*: one kernel per step);
  ``decode_b1_16k`` / ``decode_b1_128k``: batch 1 at 16k / 128k (one wave of 2- / 16-tile split blocks: the
  step's fixed cost against its tile loop);
* ``prefill``: one 512-token chunk at the end of a 16k prompt (kvarn_prefill_fused_*); ``prefill_c2048``:
  a 2048-token chunk there; ``prefill_d256``: the 512-token chunk at head_dim 256.
* ``prefill_small`` / ``append_small``: small shapes for compute-sanitizer (``GPU_SANITIZE``).

``tools/gpu_check.sh`` runs them when GPU_NCU=1 and writes the reports to $OUT/ncu.txt.
"""
import contextlib
import sys
from pathlib import Path

# Run from a checkout without installing: the package is the repository root's kvarn_cutlass/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvarn_cutlass as kc  # noqa: E402

REPEATS = 5


def compress() -> None:
    from kvarn_cutlass.ops.compress import compress_layer

    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, 8, 128, 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(1, 8, 128, 128, device="cuda", dtype=torch.float16, generator=g)
    spec = kc.TileSpec(preset="k4v2_g128", head_dim=128)
    for _ in range(REPEATS):
        compress_layer(k, v, spec)
    torch.cuda.synchronize()


def decode(B: int = 16, ctx: int = 32768) -> None:
    Hq, Hkv, D = 32, 8, 128
    cache = kc.KVarNCache(1, B, Hkv, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=ctx)
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in range(0, ctx, 4096):
        k = torch.randn(B, Hkv, 4096, D, device="cuda", dtype=torch.float16, generator=g)
        cache.append(0, k, torch.randn_like(k))
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16, generator=g)
    for _ in range(REPEATS):
        kc.decode_attention(q, cache, 0)
    torch.cuda.synchronize()


def prefill(D: int = 128, C: int = 512) -> None:
    Hq, Hkv, P = 32, 8, 16384
    cache = kc.KVarNCache(1, 1, Hkv, D, window=256, dtype=torch.float16, device="cuda", max_seq_len=P + C * REPEATS)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, Hkv, P, D, device="cuda", dtype=torch.float16, generator=g)
    cache.append(0, k, torch.randn_like(k))
    for _ in range(REPEATS):
        kn = torch.randn(1, Hkv, C, D, device="cuda", dtype=torch.float16, generator=g)
        q = torch.randn(1, Hq, C, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
        kc.prefill_attention(q, kn, torch.randn_like(kn), cache, 0)
    torch.cuda.synchronize()


def prefill_small() -> None:
    """Small shapes for compute-sanitizer: every phase of the fused kernel (tiles, sink, window, chunk),
    both cache dtypes, GQA 4, a chunk that straddles tiles, ragged row blocks; each chunk's append after the
    kernel (on sm_90 a programmatic dependent launch), eager (float16) and in a deferred block (bfloat16: the
    fused append)."""
    for dtype, D in ((torch.float16, 128), (torch.bfloat16, 64)):
        cache = kc.KVarNCache(1, 1, 2, D, window=128, sink_tokens=128, dtype=dtype, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        with cache.deferred_checks() if dtype == torch.bfloat16 else contextlib.nullcontext():
            for n in (300, 77, 1, 260):
                k = torch.randn(1, 2, n, D, device="cuda", dtype=dtype, generator=g)
                q = torch.randn(1, 8, n, D, device="cuda", dtype=dtype, generator=g) * 0.3
                kc.prefill_attention(q, k, torch.randn_like(k), cache, 0)
    torch.cuda.synchronize()


def append_small() -> None:
    """Small shapes for compute-sanitizer (racecheck: the in-place window rewrite in rounds): both cache
    dtypes, a sink, single tokens into a full 2-tile window (two rounds), a chunk completing several tiles,
    deferred (the fused form) and checked appends, a rejected token eager and in a block, and a step graph's
    kernels run eagerly."""
    from kvarn_cutlass.step_graph import StepAppends

    for dtype, D in ((torch.float16, 128), (torch.bfloat16, 64)):
        cache = kc.KVarNCache(2, 2, 2, D, window=256, sink_tokens=128, dtype=dtype, device="cuda", max_seq_len=2048)
        g = torch.Generator(device="cuda").manual_seed(2)
        kv = lambda n: [torch.randn(2, 2, n, D, device="cuda", dtype=dtype, generator=g) for _ in range(2)]  # noqa: E731
        with cache.deferred_checks():
            for n in (300, 77, 1, 1, 200):
                cache.append(0, *kv(n))
        for _ in range(400):  # past the sink, into a full window: tiles complete, the window is rewritten
            cache.append(1, *kv(1))
        bad = kv(3)
        bad[0][0, 0, 1, 0] = float("nan")
        try:
            cache.append(0, *bad)
        except ValueError:
            pass
        bad = kv(260)  # completes tiles: the fused form inside a block, its failure restored
        bad[1][1, 1, 200, 0] = float("nan")
        try:
            with cache.deferred_checks():
                cache.append(1, *kv(130))
                cache.append(0, *bad)
        except ValueError:
            pass
        k = torch.zeros(2, 2, 2, 1, D, device="cuda", dtype=dtype)
        steps = StepAppends(cache, k, torch.zeros_like(k))
        for _ in range(130):
            k.normal_()
            steps.enqueue_snapshot()
            for layer in range(2):
                steps.enqueue(layer)
            steps.advance()
        steps.check()
    torch.cuda.synchronize()


def decode_small() -> None:
    """Small shapes for compute-sanitizer: the one-kernel decode with several splits (the last block's
    merge through the ticket), both dtypes and quantizers, GQA 4 and 8, a sink, ragged via two calls; and the
    plans' other kernels (``decode.plan_variant``: ring 2 and the two-level merge) over 30 one-tile splits, so
    that the merge groups' tickets and rows run too."""
    for dtype, D, G, quantizer in ((torch.float16, 128, 4, "uniform"), (torch.bfloat16, 64, 8, "lloyd_max")):
        cache = kc.KVarNCache(1, 2, 2, D, window=256, sink_tokens=128, dtype=dtype, device="cuda",
                              quantizer=quantizer, max_seq_len=4096)
        g = torch.Generator(device="cuda").manual_seed(3)
        k = torch.randn(2, 2, 3000, D, device="cuda", dtype=dtype, generator=g)
        cache.append(0, k, torch.randn_like(k))
        for _ in range(2):
            q = torch.randn(2, 2 * G, 1, D, device="cuda", dtype=dtype, generator=g)
            kc.decode_attention(q, cache, 0)
            for variant in (kc.decode.RING2_VARIANT, kc.decode.MERGE_GROUP_VARIANT):
                kc.decode.DecodePlan(cache, splits=30, min_tps=1, variant=variant).launch(q, 0, torch.empty_like(q))
            k1 = torch.randn(2, 2, 1, D, device="cuda", dtype=dtype, generator=g)
            cache.append(0, k1, torch.randn_like(k1))
    torch.cuda.synchronize()


TARGETS = {"compress": compress, "decode": decode, "decode_b1_16k": lambda: decode(1, 16384),
           "decode_b1_128k": lambda: decode(1, 131072), "prefill": prefill,
           "prefill_c2048": lambda: prefill(C=2048), "prefill_d256": lambda: prefill(D=256),
           "prefill_small": prefill_small,
           "append_small": append_small, "decode_small": decode_small}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}}")
    TARGETS[sys.argv[1]]()
