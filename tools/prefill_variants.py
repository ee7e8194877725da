"""Which role of the fused prefill kernel sets the pace: time variants that leave one role's work out
(text substitutions of csrc/prefill_fused.cu, built under their own names), on the tuner's shape (16k
context, one 512-token chunk, 32 q / 8 KV heads, k4v2_g128, D=128 unless a D<head_dim> argument says
otherwise). The variants' outputs are wrong by design; the shipped one is checked against the torch path.
Run on a GPU: python3 tools/prefill_variants.py [D256] [only=VARIANT,...] [CONFIG ...]   (config names, default:
the tuned one; a VARIANT NAME=PATH is the whole kernel source from PATH, e.g. an earlier commit's). Every variant
is loaded first, then timed in interleaved rounds over rotating input sets larger than the L2, each against the
shipped kernel of the same round.
(through tools/gpu_check.sh: GPU_PREFILL_VARIANTS="D256 r16c8n32wg r16c4n32", several runs separated by ";")
Besides the role variants, A/B forms of the stage hand-off (outputs exact): ``mbar_every_config`` and
``named_every_config`` (mbarriers or named barriers whatever the producer groups; shipped: mbarriers with two
groups), ``mbar_hint`` (the mbarrier waits with CUTLASS's suspend-time hint) and ``mbar_every_config_hint``; and
the dequantization changes of the twentieth session, each turned back: ``k_plain_order`` (a K code word's tokens
staged in token order with byte permutes, not in the order its nibbles come out: K_WORD_INTERLEAVED),
``v_rows_from_index`` (dequant_v's stage rows computed from each item's index), and ``previous`` (both);
``whole_record_fetch`` (one record slot: the whole record copied after a tile's last block, not in two
parts: FETCH_HALVES); ``shipped_again`` (the shipped kernel built again under another name: the noise of a
same-kernel A/B)."""
import math, statistics, sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))  # the checkout's package
import kvarn_cutlass as kc
import kvarn_cutlass.ops.prefill as OP
from kvarn_cutlass.bench.timing import elapsed_ms, interleaved_samples, paired_ratios
from prefill_phases import SHIPPED_SOURCE, use_source  # tools/ is the script's sys.path[0]

ATTEND = "attend_block<true>(sQw, stg, stg + ST_KD, fk, kf, lsc, rescale, st, acc, lane, 0, 0, 0, false);"
DQK = "dequant_k(rec, P, sLut, st, t0, gtid);"
DQV = "dequant_v(rec, P, sLut, st + ST_KD, t0, gtid);"
PARAMS = "tile_params(rec, f, P, gtid);"
FACTORS = "const TileFactors f = tile_factors(m);"
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
# a K word's tokens staged in the order they are extracted (shipped), or in token order
K_ORDER_RULE = "constexpr bool K_WORD_INTERLEAVED = !LLOYD_MAX && !K_INT8;"
# dequant_v's items addressed from a base row a batch and compile-time offsets (shipped), or from each item's index
# (its divisions); outputs exact
V_ROWS_FROM_INDEX = """    // the stage rows of a thread's items (v_token) and their record tokens (stage_token)
#pragma unroll 1
    for (int i0 = 0; i0 < NI; i0 += NB) {
        u32 w[NB];
        uint2 vp[NB];
        const int wi = v_word(ptid);  // the word of the thread's items i with i % VW == 0
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int tr = t0 + stage_token(v_token(ptid + (i0 + i) * GT));
            w[i] = *reinterpret_cast<const u32*>(rec + OFF_V_CODES + tr * ROWB + (wi + (i % VW) * VW_STEP) * 4);
            vp[i] = P.vp[tr];
        }
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int tt = v_token(ptid + (i0 + i) * GT), c0 = (wi + (i % VW) * VW_STEP) * CPW;
"""
V_ROWS_LINEAR = """    // item n of the thread (ptid + n * GT) is word wi + (n % VW) * VW_STEP of stage row tt0 + (n / VW) * TT_STEP:
    // a batch's rows are a base and compile-time offsets (computed from each item's index they cost ~15
    // instructions an item)
    constexpr int TT_STEP = VW == 1 ? GT / (V_LANES * WPT) * V_LANES : V_LANES;
    const int tt0 = v_token(ptid), wi = v_word(ptid);
    // rows TT_STEP apart, TT_STEP a multiple of 8, share their place in their 8 rows: one shift (stage_token's)
    // serves them all
    constexpr bool ROW_PHASE_FIXED = TT_STEP % 8 == 0;
    const int tshift = stage_token(tt0) - tt0;
#pragma unroll 1
    for (int i0 = 0; i0 < NI; i0 += NB) {
        u32 w[NB];
        uint2 vp[NB];
        const int tb = tt0 + (i0 / VW) * TT_STEP;
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int tt = tb + (i / VW) * TT_STEP;
            const int tr = t0 + (ROW_PHASE_FIXED ? tt + tshift : stage_token(tt));  // the record token of row tt
            w[i] = *reinterpret_cast<const u32*>(rec + OFF_V_CODES + tr * ROWB + (wi + (i % VW) * VW_STEP) * 4);
            vp[i] = P.vp[tr];
        }
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int tt = tb + (i / VW) * TT_STEP, c0 = (wi + (i % VW) * VW_STEP) * CPW;
"""
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
    # the twentieth session's two dequantization changes, each turned back (outputs exact but for k_plain_order's
    # rounding), and both (the kernel before them)
    "k_plain_order": [(K_ORDER_RULE, "constexpr bool K_WORD_INTERLEAVED = false;")],
    "v_rows_from_index": [(V_ROWS_LINEAR, V_ROWS_FROM_INDEX)],
    # one record slot: the whole record copied after the tile's last block, not in two parts (FETCH_HALVES)
    "whole_record_fetch": [("constexpr bool FETCH_HALVES = RSLOTS == 1 && BPT == 2 && !K_INT8;",
                            "constexpr bool FETCH_HALVES = false;")],
}
VARIANTS["previous"] = VARIANTS["k_plain_order"] + VARIANTS["v_rows_from_index"]
# the shipped kernel built a second time under another name: its ratio's spread is the timing's noise
VARIANTS["shipped_again"] = [(K_ORDER_RULE, K_ORDER_RULE + "  // (shipped_again)")]


def whole_source_variant(path: str) -> list[tuple[str, str]]:
    """A variant that replaces the whole shipped source with the file at ``path`` (e.g. an earlier version's
    prefill_fused.cu from ``git show REV:kvarn_cutlass/csrc/prefill_fused.cu``, carried to the GPU machine)."""
    return [(SHIPPED_SOURCE.read_text(), Path(path).read_text())]


def timed_rounds(runs: list, sets: list, rounds: int, calls: int) -> list[list[float]]:
    """ms per call of each of ``runs`` (pairs of a setup, run before a sample's events, and a callable taking an
    input set) in each of ``rounds`` rounds (``bench.timing.interleaved_samples``: every run once a round, in a
    Williams order): a run's sample is ``calls`` calls back to back (so the host enqueues ahead; a call timed
    alone would add its host time: tools/prefill_host.py) over the input sets in turn."""
    def timed(setup, run):
        def calls_back_to_back() -> None:
            for c in range(calls):
                run(sets[c % len(sets)])

        def sample() -> float:
            setup()
            return elapsed_ms(calls_back_to_back) / calls
        return sample

    return interleaved_samples([timed(setup, run) for setup, run in runs], rounds)


def main() -> None:
    variants = dict(VARIANTS)
    args = sys.argv[1:]
    D = next((int(a[1:]) for a in args if a[:1] == "D" and a[1:].isdigit()), 128)
    # only=NAME[,NAME...]: time only those variants (shipped is always timed, as the reference); NAME=PATH: the
    # whole kernel source from the file at PATH, under NAME
    only = next((a[5:].split(",") for a in args if a.startswith("only=")), None)
    args = [a for a in args if not a.startswith("only=")]
    if only is not None:
        for entry in [e for e in only if "=" in e]:
            name, path = entry.split("=", 1)
            variants[name] = whole_source_variant(path)
        only = [e.split("=", 1)[0] for e in only]
        unknown = set(only) - set(variants)
        if unknown:
            sys.exit(f"unknown variants {sorted(unknown)}; choose from {list(variants)} or NAME=PATH")
        variants = {k: v for k, v in variants.items() if k == "shipped" or k in only}
    configs = [OP.FusedConfig.from_name(a) for a in args if not (a[:1] == "D" and a[1:].isdigit())] or [None]
    g = torch.Generator(device="cuda").manual_seed(0)
    ctx, n = 16384, 512
    # input sets in turn, more bytes of records than the L2 holds (50 MiB on an H100 or H200), so the calls read
    # their tiles from device memory as a prompt's layers do
    record_bytes = 8 * ctx * kc.TileSpec(head_dim=D).bytes_per_token
    sets = []
    for _ in range(max(2, math.ceil(120 * 2**20 / record_bytes))):
        cache = kc.KVarNCache(1, 1, 8, D, window=256, device="cuda", max_seq_len=ctx + n)
        k = torch.randn(1, 8, ctx, D, device="cuda", dtype=torch.float16, generator=g)
        cache.append(0, k, torch.randn_like(k))
        q = torch.randn(1, 32, n, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
        kn = torch.randn(1, 8, n, D, device="cuda", dtype=torch.float16, generator=g)
        sets.append((q, kn, torch.randn_like(kn), cache, torch.empty_like(q)))
    q, kn, vn, cache, _ = sets[0]
    want = kc.prefill_attention(q, kn, vn, cache, 0, append=False, impl="torch").float()
    # every variant built and loaded first; a run swaps its variant's loaded kernels in (OP._kernels)
    loaded, errors = {}, {}
    for name, subs in variants.items():
        use_source(name, subs)
        for cfg in configs:
            out = kc.prefill_attention(q, kn, vn, cache, 0, append=False, config=cfg)
            errors[cfg, name] = ((out.float() - want).norm() / want.norm()).item()
        loaded[name] = dict(OP._kernels)
    use_source("shipped", [])

    def run_of(cfg, name):
        """(setup: the variant's loaded kernels swapped in, once a sample; a call on an input set)"""
        def setup():
            OP._kernels.clear()
            OP._kernels.update(loaded[name])

        def run(s):
            kc.prefill_attention(s[0], s[1], s[2], s[3], 0, append=False, out=s[4], config=cfg)
        return setup, run

    keys = [(cfg, name) for cfg in configs for name in variants]
    runs = [run_of(*key) for key in keys]
    for setup, run in runs:  # warm-up: every kernel on every set
        setup()
        for s in sets:
            run(s)
    n_rounds = max(12, 2 * len(runs))
    times = dict(zip(keys, timed_rounds(runs, sets, n_rounds, calls=12)))
    OP._kernels.clear()
    print(f"D={D}: ms per call, median over {n_rounds} rounds [fastest, slowest]; against shipped: the median of "
          f"the rounds' ratios [lowest, highest]")
    for cfg, name in keys:
        t, ref = times[cfg, name], times[cfg, "shipped"]
        ratio, lo, hi = paired_ratios(t, ref)
        print(f"D={D} {cfg.name if cfg else 'tuned':16s} {name:24s} {statistics.median(t):.4f} ms "
              f"[{min(t):.4f}, {max(t):.4f}]  x{ratio:.4f} [{lo:.4f}, {hi:.4f}]  "
              f"error vs torch path {errors[cfg, name]:.2e}")


if __name__ == "__main__":
    main()
