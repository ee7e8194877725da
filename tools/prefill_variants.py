"""Which role of the fused prefill kernel sets the pace: time variants that leave one role's work out
(text substitutions of csrc/prefill_fused.cu, built under their own names), on the tuner's shape (16k
context, one 512-token chunk, 32 q / 8 KV heads, k4v2_g128, D=128 unless a D<head_dim> argument says
otherwise). The variants' outputs are wrong by design; the shipped one is checked against the torch path.
Run on a GPU: python3 tools/prefill_variants.py [D256] [only=VARIANT,...] [CONFIG ...]   (config names, default:
the tuned one)
(through tools/gpu_check.sh: GPU_PREFILL_VARIANTS="D256 r16c8n32wg r16c4n32")
Besides the role variants, A/B forms of the stage hand-off (outputs exact): ``mbar_every_config`` and
``named_every_config`` (mbarriers or named barriers whatever the producer groups; shipped: mbarriers with two
groups), ``mbar_hint`` (the mbarrier waits with CUTLASS's suspend-time hint) and ``mbar_every_config_hint``."""
import statistics, sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))  # the checkout's package
import kvarn_cutlass as kc
import kvarn_cutlass.ops.prefill as OP
from prefill_phases import use_source  # tools/ is the script's sys.path[0]

ATTEND = "attend_block<true>(sQw, stg, stg + ST_KD, fk, kf, lsc, rescale, st, acc, lane, 0, 0, 0, false);"
DQK = "dequant_k(rec, P, sLut, st, t0, gtid);"
DQV = "dequant_v(rec, P, sLut, st + ST_KD, t0, gtid);"
PARAMS = "tile_params(rec, f, P, gtid);"
FACTORS = "const TileFactors f = tile_factors(P.red);"
# wgmma consumers: a tile block's turn, softmax and pending P.V, and the P.V flushed after the last tile
WG_TILE = """            if (pending() == 1) {
                turn(K1{}, K1{}, bi);
                softmax_scores<true>(s, fk, kf, lsc, rescale, st, lane, 0, 0, 0, false, a_acc);
                finish_pv();
            } else {
                turn(K1{}, K0{}, bi);
                softmax_scores<true>(s, fk, kf, lsc, rescale, st, lane, 0, 0, 0, false, a_acc);
            }
            rescale_acc(acc, a_acc);
            pack_p<false>(s[0], pa);
            pv_bi = bi;
"""
WG_FLUSH = "                turn(K0{}, K1{}, 0);\n"
NO_MATH = [(ATTEND, "if (kf < -1.f) " + ATTEND),  # mma.sync
           (WG_TILE, "            turn(K0{}, K0{}, 0);\n            release(bi);\n"),  # wgmma
           (WG_FLUSH, "                turn(K0{}, K0{}, 0);\n")]
NO_DEQUANT = [(DQK, "if (t0 < 0) " + DQK), (DQV, "if (t0 < 0) " + DQV)]
# the stage hand-off's form (csrc/prefill_fused.cu, "synchronization"), and its sm_90 wait with the suspend-time
# hint CUTLASS's ClusterBarrier::wait passes (0x989680)
MBAR_RULE = "constexpr bool MBAR_HANDOFF = NG == 2;"
MBAR_RULE_ALL = (MBAR_RULE, "constexpr bool MBAR_HANDOFF = true;")
MBAR_HINT = ("mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;",
             "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, 0x989680;")
# the producers' per-tile setup as the eighteenth session shipped it (a shuffle butterfly per scale maximum, one
# scale per load and store): the A/B of the nineteenth session's redux and pair form (outputs exact)
TILE_SETUP_NEW = ("// scales 2i and 2i + 1 of the record array at p, in one shared-memory load (the record's sections start\n// 16-byte aligned)\n__device__ __forceinline__ float2 scale_pair_at(const u8* p, int i) {\n#if SCALE_F32\n    return reinterpret_cast<const float2*>(p)[i];\n#else\n    return __half22float2(reinterpret_cast<const __half2*>(p)[i]);\n#endif\n}\n__device__ __forceinline__ float abs_max(float2 v) { return fmaxf(fabsf(v.x), fabsf(v.y)); }\n// The maximum over the warp of a value >= 0 (not NaN), in one redux: such floats order as their bits do.\n// (A butterfly of shuffles was 5 dependent round trips a value, and the producers' per-tile setup, which\n// the consumers wait for at D=256, stalled mostly on them: docs/perf-notes.md, nineteenth session.)\n__device__ __forceinline__ float warp_max_nonneg(float x) {\n    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(x)));\n}\n\n// this thread's channel and token pairs, reduced over its warp into red[warp][0..5]; then a group barrier\n__device__ __forceinline__ void tile_partial_max(const u8* rec, float* red, int gtid) {\n    float m[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // |chan_min|, |chan_step|, col_scale, |tok_min|, |tok_step|, row_scale\n    for (int i = gtid; i < D / 2; i += GT) {\n        m[0] = fmaxf(m[0], abs_max(scale_pair_at(rec + OFF_CHAN_MIN, i)));\n        m[1] = fmaxf(m[1], abs_max(scale_pair_at(rec + OFF_CHAN_STEP, i)));\n        m[2] = fmaxf(m[2], abs_max(scale_pair_at(rec + OFF_COL_SCALE, i)));  // (positive)\n    }\n    for (int i = gtid; i < T / 2; i += GT) {\n        m[3] = fmaxf(m[3], abs_max(scale_pair_at(rec + OFF_TOK_MIN, i)));\n        m[4] = fmaxf(m[4], abs_max(scale_pair_at(rec + OFF_TOK_STEP, i)));\n        m[5] = fmaxf(m[5], abs_max(scale_pair_at(rec + OFF_ROW_SCALE, i)));  // (positive)\n    }\n#pragma unroll\n    for (int k = 0; k < 6; ++k) m[k] = warp_max_nonneg(m[k]);\n    if ((gtid & 31) == 0)\n#pragma unroll\n        for (int k = 0; k < 6; ++k) red[(gtid >> 5) * 8 + k] = m[k];\n}\n",
                  '__device__ __forceinline__ void tile_params(const u8* rec, const TileFactors& f, const Params& P, int ptid) {\n    const float kmul = exp2i(-f.ek), vmul = exp2i(-f.ev), rmul = exp2i(-f.er), cinv = exp2i(-f.ec);\n    // channel and token pairs (2i, 2i + 1): one load per scale array and one store per parameter array a pair\n    for (int i = ptid; i < D / 2; i += GT) {\n        const float2 step = scale_pair_at(rec + OFF_CHAN_STEP, i), mn = scale_pair_at(rec + OFF_CHAN_MIN, i);\n        const float2 ratio = scale_pair_at(rec + OFF_COL_SCALE, i);\n#if SCALE_F32\n        reinterpret_cast<uint4*>(P.kp)[i] = make_uint4(f2u(step.x * kmul), f2u(mn.x * kmul), f2u(step.y * kmul),\n                                                       f2u(mn.y * kmul));\n        reinterpret_cast<float2*>(P.cr)[i] = make_float2(ratio.x * cinv, ratio.y * cinv);\n#else\n        reinterpret_cast<uint4*>(P.kp)[i] = make_uint4(h2u(bcast(step.x * kmul)), h2u(bcast(mn.x * kmul)),\n                                                       h2u(bcast(step.y * kmul)), h2u(bcast(mn.y * kmul)));\n        reinterpret_cast<__half2*>(P.cr)[i] = __floats2half2_rn(ratio.x * cinv, ratio.y * cinv);\n#endif\n    }\n    for (int i = ptid; i < T / 2; i += GT) {\n        const float2 step = scale_pair_at(rec + OFF_TOK_STEP, i), mn = scale_pair_at(rec + OFF_TOK_MIN, i);\n        const float2 rs = scale_pair_at(rec + OFF_ROW_SCALE, i);\n#if SCALE_F32\n        reinterpret_cast<uint4*>(P.vp)[i] = make_uint4(f2u(step.x * vmul), f2u(mn.x * vmul), f2u(step.y * vmul),\n                                                       f2u(mn.y * vmul));\n        reinterpret_cast<float2*>(P.rs)[i] = make_float2(rs.x * rmul, rs.y * rmul);\n#else\n        reinterpret_cast<uint4*>(P.vp)[i] = make_uint4(h2u(bcast(step.x * vmul)), h2u(bcast(mn.x * vmul)),\n                                                       h2u(bcast(step.y * vmul)), h2u(bcast(mn.y * vmul)));\n        reinterpret_cast<__half2*>(P.rs)[i] = __floats2half2_rn(rs.x * rmul, rs.y * rmul);\n#endif\n    }\n}\n\n')
TILE_SETUP_OLD = ("// this thread's channels and tokens, reduced over its warp into red[warp][0..4]; then a group barrier\n__device__ __forceinline__ void tile_partial_max(const u8* rec, float* red, int gtid) {\n    float m[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // |chan_min|, |chan_step|, col_scale, |tok_min|, |tok_step|, row_scale\n    for (int c = gtid; c < D; c += GT) {\n        m[0] = fmaxf(m[0], fabsf(scale_at(rec + OFF_CHAN_MIN, c)));\n        m[1] = fmaxf(m[1], fabsf(scale_at(rec + OFF_CHAN_STEP, c)));\n        m[2] = fmaxf(m[2], scale_at(rec + OFF_COL_SCALE, c));\n    }\n    for (int t = gtid; t < T; t += GT) {\n        m[3] = fmaxf(m[3], fabsf(scale_at(rec + OFF_TOK_MIN, t)));\n        m[4] = fmaxf(m[4], fabsf(scale_at(rec + OFF_TOK_STEP, t)));\n        m[5] = fmaxf(m[5], scale_at(rec + OFF_ROW_SCALE, t));\n    }\n#pragma unroll\n    for (int k = 0; k < 6; ++k) m[k] = warp_max(m[k]);\n    if ((gtid & 31) == 0)\n#pragma unroll\n        for (int k = 0; k < 6; ++k) red[(gtid >> 5) * 8 + k] = m[k];\n}\n",
                  '__device__ __forceinline__ void tile_params(const u8* rec, const TileFactors& f, const Params& P, int ptid) {\n    const float kmul = exp2i(-f.ek), vmul = exp2i(-f.ev), rmul = exp2i(-f.er), cinv = exp2i(-f.ec);\n    for (int c = ptid; c < D; c += GT) {\n        const float step = scale_at(rec + OFF_CHAN_STEP, c) * kmul, mn = scale_at(rec + OFF_CHAN_MIN, c) * kmul;\n        const float ratio = scale_at(rec + OFF_COL_SCALE, c) * cinv;\n#if SCALE_F32\n        P.kp[c] = make_uint2(f2u(step), f2u(mn));\n        reinterpret_cast<float*>(P.cr)[c] = ratio;\n#else\n        P.kp[c] = make_uint2(h2u(bcast(step)), h2u(bcast(mn)));\n        reinterpret_cast<__half*>(P.cr)[c] = __float2half_rn(ratio);\n#endif\n    }\n    for (int t = ptid; t < T; t += GT) {\n        const float step = scale_at(rec + OFF_TOK_STEP, t) * vmul, mn = scale_at(rec + OFF_TOK_MIN, t) * vmul;\n#if SCALE_F32\n        P.vp[t] = make_uint2(f2u(step), f2u(mn));\n#else\n        P.vp[t] = make_uint2(h2u(bcast(step)), h2u(bcast(mn)));\n#endif\n        const float rs = scale_at(rec + OFF_ROW_SCALE, t) * rmul;\n#if SCALE_F32\n        reinterpret_cast<float*>(P.rs)[t] = rs;\n#else\n        reinterpret_cast<__half*>(P.rs)[t] = __float2half_rn(rs);\n#endif\n    }\n}\n\n')
VARIANTS = {
    "shipped": [],
    "no_consumer_tile_math": NO_MATH,
    "no_dequant": NO_DEQUANT,
    "neither": NO_MATH + NO_DEQUANT,
    "no_tile_setup": [(PARAMS, "if (t0 < 0) " + PARAMS), (FACTORS, "const TileFactors f{0, 0, 0, 0, 1.f, 0};")],
    # wgmma: each turn waits for its P . V with the scores (the softmax no longer overlaps it); outputs exact
    "pv_serial": [("cute::warpgroup_wait<1>();", "cute::warpgroup_wait<0>();")],
    # dequant_k's loads in batches of 4 items at every head_dim (D=256 ships 8); outputs exact
    "k_batch_4": [("NB = NI < 4 ? NI : (D == 256 && !SCALE_F32 ? 8 : 4);", "NB = NI < 4 ? NI : 4;")],
    "mbar_every_config": [MBAR_RULE_ALL],
    "named_every_config": [(MBAR_RULE, "constexpr bool MBAR_HANDOFF = false;")],
    "mbar_hint": [MBAR_HINT],
    "mbar_every_config_hint": [MBAR_RULE_ALL, MBAR_HINT],
    "tile_setup_shuffles": list(zip(TILE_SETUP_NEW, TILE_SETUP_OLD)),
}


def main() -> None:
    variants = VARIANTS
    args = sys.argv[1:]
    D = next((int(a[1:]) for a in args if a[:1] == "D" and a[1:].isdigit()), 128)
    # only=NAME[,NAME...]: time only those variants (shipped is always timed first)
    only = next((a[5:].split(",") for a in args if a.startswith("only=")), None)
    args = [a for a in args if not a.startswith("only=")]
    if only is not None:
        unknown = set(only) - set(variants)
        if unknown:
            sys.exit(f"unknown variants {sorted(unknown)}; choose from {list(variants)}")
        variants = {k: v for k, v in variants.items() if k == "shipped" or k in only}
    configs = [OP.FusedConfig.from_name(a) for a in args if not (a[:1] == "D" and a[1:].isdigit())] or [None]
    g = torch.Generator(device="cuda").manual_seed(0)
    ctx, n = 16384, 512
    cache = kc.KVarNCache(1, 1, 8, D, window=256, device="cuda", max_seq_len=ctx + n)
    k = torch.randn(1, 8, ctx, D, device="cuda", dtype=torch.float16, generator=g)
    cache.append(0, k, torch.randn_like(k))
    q = torch.randn(1, 32, n, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
    kn = torch.randn(1, 8, n, D, device="cuda", dtype=torch.float16, generator=g)
    vn = torch.randn_like(kn)
    want = kc.prefill_attention(q, kn, vn, cache, 0, append=False, impl="torch").float()
    for cfg, (name, subs) in ((c, v) for c in configs for v in variants.items()):
        use_source(name, subs)
        out = kc.prefill_attention(q, kn, vn, cache, 0, append=False, config=cfg)
        err = ((out.float() - want).norm() / want.norm()).item()
        # GPU time: rounds of 10 calls back to back, so the host enqueues ahead (a call timed alone would
        # add its host time: tools/prefill_host.py)
        ts = []
        for _ in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10):
                kc.prefill_attention(q, kn, vn, cache, 0, append=False, out=out, config=cfg)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 10)
        print(f"D={D} {cfg.name if cfg else 'tuned':16s} {name:24s} {statistics.median(ts[1:]):.4f} ms  "
              f"error vs torch path {err:.2e}")
    use_source("shipped", [])


if __name__ == "__main__":
    main()
