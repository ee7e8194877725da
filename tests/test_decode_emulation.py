"""CPU mirror of the decode kernel's arithmetic (``csrc/decode.cu``), checked against the float64 reference.

``emulate`` replays what the kernel computes, in its decomposition: splits of ``tps`` tiles, per
iteration the fold of every (tile, head) (f32 products, the two int8 levels hi = rint(x), lo =
rint((x - hi) * 254) of x = q_rot * chan_step * 127 / max|.|, the centering sums), exact integer MMAs
(int64 here, with the int32 range of every accumulator asserted), the int -> f32 conversion of
``254 * acc_hi + acc_lo``, per warp (32 tokens of a tile) the online softmax with the lazy running max
(moved only when a tile exceeds it by TAU = 8, for every head of the warp when one head does), P' in
two int8 levels against max(p~ * tok_step), the V MMA on the codes with their in-place factors
(4^j / 16^j), then the merge of the four warps, of the splits and of the exact (window + sink) blocks,
the inverse WHT and the normalization. lloyd_max: the K codes and 4-bit V codes through the two-level
int8 centroid tables of ``decode.lm_tables``, 2-bit V as ``c[0] + a0 k + g1 bit1(k)``.

Not mirrored: the order of f32 sums inside reductions and the MUFU approximations (ex2, rcp: within
2^-22 relative), which move the result by ~1e-7; what the tests establish is that the int8 design meets
the kernel's accuracy target (1e-3 norm-wise against ``reference.attention``) on the GPU tests' kinds of
inputs, including peaked attention at large logits and deep contexts. The fragment layouts (which lane
holds which token and channel) are checked separately in tests/test_decode.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import codec, decode, reference
from kvarn_cutlass.format import TileSpec

from _helpers import realistic_kv

f32, f64 = torch.float32, torch.float64
LF = 254      # the kernel's LFOLD
TAU = 8.0     # the kernel's lazy-rescale threshold (log2 units)
INT32 = 2**31


def _rint(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # ties to even, as the magic-number rounding


def _two_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) int64 of f32 x in [-127, 127]: rint(x) and rint((x - rint(x)) * 254), the FMA's one rounding."""
    hi = _rint(x)
    lo = _rint((x.to(f64) - hi.to(f64)) * LF)
    assert hi.abs().max() <= 127 and lo.abs().max() <= 127
    return hi.to(torch.int64), lo.to(torch.int64)


def _comb(acc_hi: torch.Tensor, acc_lo: torch.Tensor) -> torch.Tensor:
    """254 * acc_hi + acc_lo in int32 (asserted), converted to f32 as the kernel's I2F."""
    c = acc_hi * LF + acc_lo
    assert acc_hi.abs().max() < INT32 and c.abs().max() < INT32, "int32 overflow"
    return c.to(f64).to(f32)


def _exact_part(q, cache, layer, scale, G):
    """Per (b, h, head): (m, l, o) of sink ++ window in f32, log2 domain (the exact blocks, merged)."""
    sk, sv = cache.sink_kv(layer)
    wk, wv = cache.window_kv(layer)
    k = torch.cat((sk, wk), 2).to(f32)  # [B, Hkv, n, D]
    v = torch.cat((sv, wv), 2).to(f32)
    B, Hkv, n, D = k.shape
    if n == 0:
        return None
    qs = q[:, :, 0].to(f32).view(B, Hkv, G, D) * (scale * math.log2(math.e))
    s = torch.einsum("bhgd,bhnd->bhgn", qs, k)
    m = s.amax(-1)
    p = torch.exp2(s - m[..., None])
    return m, p.sum(-1), torch.einsum("bhgn,bhnd->bhgd", p, v)


def emulate(q: torch.Tensor, cache: kc.KVarNCache, layer: int = 0, splits: int = 3, min_tps: int = 1,
            scale: float | None = None) -> torch.Tensor:
    """The kernel's output [B, Hq, 1, D] (float32) for ``q`` over ``layer`` of ``cache``."""
    spec = cache.spec
    B, Hq, _, D = q.shape
    Hkv = cache.num_kv_heads
    G = Hq // Hkv
    T = spec.tile_tokens
    lm = spec.quantizer == "lloyd_max"
    scale = D**-0.5 if scale is None else scale
    kscale = torch.tensor(scale * math.log2(math.e), dtype=f32) * torch.tensor(D**-0.5, dtype=f32)
    kfac = kscale * torch.tensor(1.0 / (127 * LF), dtype=f32)
    if lm:
        ksc, kth, ktl = decode.lm_tables(spec.k_codebook)
        kfac = kfac * torch.tensor(1.0 / ksc, dtype=f32)
    rec = cache.tile_bytes(layer)
    nt = rec.shape[1]
    parts = []  # (m, l, o) per split, [B, Hkv, G(, D)]
    if nt:
        f = codec.unpack_fields(rec, spec)
        per = lambda x: x.transpose(1, 2)  # noqa: E731  [B, nt, Hkv, ...] -> [B, Hkv, nt, ...]
        cs, cm, rs = per(f.chan_step), per(f.chan_min), per(f.row_scale)
        ts, tm, col = per(f.tok_step), per(f.tok_min), per(f.col_scale)
        kcode = per(f.k_codes).to(torch.int64)  # [B, Hkv, nt, D, T]
        vcode = per(f.v_codes).to(torch.int64)  # [B, Hkv, nt, T, D]
        qrot = codec.wht(q[:, :, 0].to(f32)) * torch.tensor(math.sqrt(D), dtype=f32)  # unnormalized
        qrot = qrot.view(B, Hkv, 1, G, D)
        # ---- fold (per tile and head) ----
        qf = qrot * cs[:, :, :, None]  # [B, Hkv, nt, G, D]
        amax = qf.abs().amax(-1)
        inv = torch.where(amax > 0, (1.0 / amax) * 127.0, torch.zeros_like(amax))
        hi, lo = _two_levels(qf * inv[..., None])
        bias = (qrot * (cm if lm else cm + 8 * cs)[:, :, :, None]).sum(-1)
        A = amax * kfac
        # ---- scores [B, Hkv, nt, G, T] ----
        if lm:
            th = torch.tensor(kth)[kcode]
            tl = torch.tensor(ktl)[kcode]
            dot = lambda a, c: torch.einsum("bhngd,bhndt->bhngt", a, c)  # noqa: E731
            ch, cl = _comb(dot(hi, th), dot(lo, th)), _comb(dot(hi, tl), dot(lo, tl))
            e = (cl * (A / LF)[..., None] + ch * A[..., None])
        else:
            cen = kcode - 8
            acc_h = torch.einsum("bhngd,bhndt->bhngt", hi, cen)
            acc_l = torch.einsum("bhngd,bhndt->bhngt", lo, cen)
            _comb(acc_h * 16, acc_l * 16)  # the odd tokens' 16 x codes: int32 range
            e = _comb(acc_h, acc_l) * A[..., None]
        s = (e + (bias * kscale)[..., None]) * rs[:, :, :, None]
        s = s.to(f32)
        # ---- per warp chunk (32 tokens) ----
        C = T // 32
        s = s.view(B, Hkv, nt, G, C, 32)
        mt = s.amax(-1)  # [B, Hkv, nt, G, C]
        pt = torch.exp2(s - mt[..., None])
        tsc = ts.view(B, Hkv, nt, 1, C, 32)
        tmn = tm.view(B, Hkv, nt, 1, C, 32)
        if lm and spec.v_bits == 2:
            c = spec.v_codebook
            tmn = tmn + tsc * c[0]
        w = pt * tsc
        wmax = w.amax(-1)
        rw = torch.where(wmax > 0, (1.0 / wmax) * 127.0, torch.zeros_like(wmax))
        ph, plo = _two_levels(w * rw[..., None])
        vc = vcode.view(B, Hkv, nt, C, 32, D)
        vdot = lambda P, V: torch.einsum("bhngct,bhnctd->bhngcd", P, V)  # noqa: E731
        if lm and spec.v_bits == 4:
            vsc, vth, vtl = decode.lm_tables(spec.v_codebook)
            Vh, Vl = torch.tensor(vth)[vc], torch.tensor(vtl)[vc]
            vsum = (_comb(vdot(ph, Vh), vdot(plo, Vh)) + _comb(vdot(ph, Vl), vdot(plo, Vl)) / LF) / vsc
        else:
            # the in-place code factors 4^j / 16^j enter the int32 range check
            pos = torch.arange(D) % (8 // spec.v_bits)
            fac = (1 << (spec.v_bits * pos))
            _comb(vdot(ph, vc * fac), vdot(plo, vc * fac))
            vsum = _comb(vdot(ph, vc), vdot(plo, vc))
            if lm:
                c = spec.v_codebook
                b1 = (vc >> 1) & 1
                vsum = vsum * (c[1] - c[0]) + _comb(vdot(ph, b1), vdot(plo, b1)) * (c[2] - 2 * c[1] + c[0])
        sp = (pt * tmn).sum(-1)  # [B, Hkv, nt, G, C]
        fv = wmax / (127.0 * LF)
        # tile part of each warp chunk, relative to its own max mt: o~ = col * (fv * vsum + sp)
        ot = col[:, :, :, None, None, :] * (fv[..., None] * vsum + sp[..., None])  # [B, Hkv, nt, G, C, D]
        lt = pt.sum(-1)
        # ---- splits, warps: lazy running max over the tiles a warp sees ----
        tps = max(min_tps, -(-nt // splits))
        TPI = 128 // T
        for j in range(splits):
            t0, t1 = j * tps, min(nt, j * tps + tps)
            if t0 >= t1:
                continue
            warp_states = []
            for wi in range(4):  # warp w: tiles it * TPI + w // (4 // TPI), chunk w % (4 // TPI)
                jw, kc_ = wi // (4 // TPI), wi % (4 // TPI)
                m = torch.full((B, Hkv, G), float("-inf"))
                l = torch.zeros(B, Hkv, G)
                o = torch.zeros(B, Hkv, G, D)
                for t in range(t0 + jw, t1, TPI):
                    mtt = mt[:, :, t, :, kc_]
                    grow = (mtt > m + TAU).any(-1, keepdim=True)  # the warp's vote, per (b, h)
                    mn = torch.where(grow, torch.maximum(m, mtt), m)
                    al = torch.exp2(m - mn)
                    o = torch.where(grow[..., None], o * al[..., None], o)
                    l = torch.where(grow, l * al, l)
                    m = mn
                    fm = torch.exp2(mtt - m)
                    assert (fm <= 2**TAU).all()
                    l = l + fm * lt[:, :, t, :, kc_]
                    o = o + fm[..., None] * ot[:, :, t, :, kc_]
                warp_states.append((m, l, o))
            M = torch.stack([ws[0] for ws in warp_states]).amax(0)
            wgt = [torch.exp2(ws[0] - M) for ws in warp_states]
            parts.append((M, sum(wg * ws[1] for wg, ws in zip(wgt, warp_states)),
                          sum(wg[..., None] * ws[2] for wg, ws in zip(wgt, warp_states))))

    def merge(ps):
        if not ps:
            return None
        M = torch.stack([p[0] for p in ps]).amax(0)
        wg = [torch.exp2(p[0] - M) for p in ps]
        return M, sum(w * p[1] for w, p in zip(wg, ps)), sum(w[..., None] * p[2] for w, p in zip(wg, ps))

    tile = merge(parts)
    exact = _exact_part(q, cache, layer, scale, G)
    zero = (torch.full((B, Hkv, G), float("-inf")), torch.zeros(B, Hkv, G), torch.zeros(B, Hkv, G, D))
    Mt, Lt, Ot = tile or zero
    Me, Le, Oe = exact or zero
    Ot = codec.wht(Ot)  # the deferred inverse WHT, normalized
    M = torch.maximum(Mt, Me)
    wt = torch.where(Mt == float("-inf"), 0.0, torch.exp2(Mt - M))
    we = torch.where(Me == float("-inf"), 0.0, torch.exp2(Me - M))
    out = (wt[..., None] * Ot + we[..., None] * Oe) / (wt * Lt + we * Le)[..., None]
    return out.reshape(B, Hq, 1, D)


def _cache(B, Hkv, D, preset, n, seed, quantizer="uniform", scale_dtype=torch.float16, sink=0, dtype=torch.float16):
    spec = TileSpec(preset=preset, head_dim=D)
    c = kc.KVarNCache(1, B, Hkv, D, preset=preset, window=2 * spec.tile_tokens, sink_tokens=sink, dtype=dtype,
                      scale_dtype=scale_dtype, quantizer=quantizer)
    gen = torch.Generator().manual_seed(seed)
    c.append(0, realistic_kv(B, Hkv, n, D, generator=gen), realistic_kv(B, Hkv, n, D, generator=gen))
    return c


def _rel(out, ref):
    return ((out.to(f64) - ref).norm() / ref.norm()).item()


CASES = [
    # preset, D, group, q scale, n, scale dtype, sink
    ("k4v2_g128", 128, 4, 2.0, 1500, torch.float16, 0),
    ("k4v2_g128", 128, 8, 1.0, 1300, torch.float32, 128),
    ("k4v4_g128", 128, 2, 2.0, 1100, torch.float16, 0),
    ("k4v4_g128", 64, 4, 1.0, 900, torch.float32, 0),
    ("k4v2_g128", 256, 3, 2.0, 1000, torch.float16, 0),
    ("k4v2_g64", 128, 5, 2.0, 1234, torch.float16, 64),
    ("k4v4_g64", 64, 8, 1.0, 777, torch.float16, 0),
    ("k4v4_g64", 256, 1, 2.0, 600, torch.float32, 0),
]


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("preset,D,G,qs,n,sd,sink", CASES)
def test_emulation_matches_reference(preset, D, G, qs, n, sd, sink, quantizer):
    seed = n + D + G
    c = _cache(2, 2, D, preset, n, seed, quantizer, sd, sink)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(2, 2 * G, 1, D, generator=gen) * qs).to(torch.float16)
    err = _rel(emulate(q, c, splits=3), reference.attention(q, c, 0))
    assert err < 5e-4, (err, seed)


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_emulation_large_logits(quantizer):
    """Peaked attention, logits ~100 (q x 12): the two-level query fold (1/508 of a level per channel)
    keeps the score error small enough; a single int8 level fails this by 10x."""
    c = _cache(1, 2, 128, "k4v2_g128", 3000, 5, quantizer)
    gen = torch.Generator().manual_seed(6)
    worst = 0.0
    for _ in range(8):
        q = (torch.randn(1, 8, 1, 128, generator=gen) * 12).to(torch.float16)
        worst = max(worst, _rel(emulate(q, c, splits=4), reference.attention(q, c, 0)))
    assert worst < 8e-4, worst


@pytest.mark.parametrize("n", [1024, 16384, 65536])
def test_emulation_error_flat_in_depth(n):
    """Spread attention over deep contexts: the P' levels are relative to each warp chunk's own max, so
    the error does not grow with the number of tiles."""
    c = _cache(1, 1, 128, "k4v2_g128", n, 7)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 1, 128, generator=gen).to(torch.float16)
    err = _rel(emulate(q, c, splits=max(1, n // 8192)), reference.attention(q, c, 0))
    assert err < 3e-4, err


def test_emulation_split_count_changes_little():
    """Splits change only summation order and the warps' running maxima."""
    c = _cache(1, 2, 128, "k4v2_g128", 3000, 9)
    q = torch.randn(1, 8, 1, 128, generator=torch.Generator().manual_seed(10)).to(torch.float16)
    a, b = emulate(q, c, splits=1), emulate(q, c, splits=7)
    assert _rel(a, b.to(f64)) < 1e-5


def test_single_level_fold_would_fail():
    """The reason for the second level: with lo = 0 the large-logit error exceeds the bar (guards against a
    mirror that cannot fail)."""
    c = _cache(1, 2, 128, "k4v2_g128", 3000, 5)
    q = (torch.randn(1, 8, 1, 128, generator=torch.Generator().manual_seed(6)) * 12).to(torch.float16)
    ref = reference.attention(q, c, 0)
    two = _rel(emulate(q, c, splits=4), ref)
    orig = _two_levels

    def one_level(x):
        hi, lo = orig(x)
        return hi, torch.zeros_like(lo)

    globals()["_two_levels"] = one_level
    try:
        one = _rel(emulate(q, c, splits=4), ref)
    finally:
        globals()["_two_levels"] = orig
    assert one > 10 * two and one > 1e-3, (one, two)


def test_single_level_lloyd_max_k_table_would_fail(monkeypatch):
    """The reason for the lloyd_max K table's second level (and so for its second MMA): with tl = 0 the
    centroids are rounded to 1/(2 SC) and the error exceeds the bar by 10x even at ordinary logits."""
    c = _cache(1, 2, 128, "k4v2_g128", 3000, 5, "lloyd_max")
    q = torch.randn(1, 8, 1, 128, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    ref = reference.attention(q, c, 0)
    two = _rel(emulate(q, c, splits=4), ref)
    orig = decode.lm_tables

    def k_one_level(book):
        sc, th, tl = orig(book)
        return (sc, th, [0] * len(tl)) if tuple(book) == tuple(c.spec.k_codebook) else (sc, th, tl)

    monkeypatch.setattr(decode, "lm_tables", k_one_level)
    one = _rel(emulate(q, c, splits=4), ref)
    assert two < 3e-4 and one > 10 * two and one > 3e-3, (one, two)
