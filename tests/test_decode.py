"""CPU tests of decode: every shipped kernel variant compiles (NVRTC, sm_90 and sm_80), the host
mirror of the kernel's record layout matches kvarn_cutlass.format, argument validation."""

from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import decode
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, QUANTIZERS, SCALE_DTYPES, TileSpec, codebook
from kvarn_cutlass.runtime import build
from kvarn_cutlass.runtime.registry import families


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("spec", decode.decode_specs(), ids=lambda s: s.name)
def test_variant_compiles(spec, arch):
    mod = build(spec, arch)
    for name in spec.kernel_names:
        assert name in mod.resources
    part = mod.resources[spec.kernel_names[0]]
    # 128 threads x launch bounds: no heavy spilling (a few bytes tolerated for D=256, V 4-bit)
    assert part.spill_store_bytes <= 64, part


def test_registered_family():
    fams = families()
    assert "decode" in fams
    assert len(fams["decode"]) == len(PRESETS) * len(HEAD_DIMS) * len(SCALE_DTYPES) * len(QUANTIZERS)
    names = {s.name for s in fams["decode"]}
    assert "decode_d128_t128_v2_s2" in names and "decode_d128_t128_v2_s2_lm" in names


def test_spec_per_quantizer():
    """The quantizer is part of the module (kernel names, defines): uniform keeps its names and defines."""
    u = decode.decode_spec(TileSpec(preset="k4v4_g64", head_dim=64))
    lm = decode.decode_spec(TileSpec(preset="k4v4_g64", head_dim=64, quantizer="lloyd_max"))
    assert u.kernel_names == ("kvarn_decode_partials_d64_t64_v4_s2", "kvarn_decode_combine_d64_t64_v4_s2")
    assert lm.kernel_names == tuple(n + "_lm" for n in u.kernel_names)
    assert dict(u.defines) == {"KVD_D": "64", "KVD_T": "64", "KVD_VB": "4", "KVD_SB": "2"}
    assert dict(lm.defines)["KVD_QZ"] == "1" and u != lm


# --- the kernel's codebook lookup (lut16 / lut4 in csrc/decode.cu), mirrored on the host ---------------
def _byte_perm(x: int, y: int, s: int) -> int:
    """CUDA __byte_perm: result byte n = byte (s >> 4n) & 7 of the 8 bytes [x (bytes 0-3), y (bytes 4-7)]."""
    src = x | (y << 32)
    return sum(((src >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _lut16(sel, lo_w, hi_w):
    s7 = sel & 0x7777
    m = _byte_perm(0x0000FF00, 0, (sel >> 3) & 0x1111)
    la, lb = _byte_perm(lo_w[0], lo_w[1], s7), _byte_perm(lo_w[2], lo_w[3], s7)
    ha, hb = _byte_perm(hi_w[0], hi_w[1], s7), _byte_perm(hi_w[2], hi_w[3], s7)
    lo, hi = (la & ~m) | (lb & m), (ha & ~m) | (hb & m)
    return _byte_perm(lo, hi, 0x6240), _byte_perm(lo, hi, 0x7351)


def _lut4(sel, lo_w, hi_w):
    lo, hi = _byte_perm(lo_w, 0, sel), _byte_perm(hi_w, 0, sel)
    return _byte_perm(lo, hi, 0x6240), _byte_perm(lo, hi, 0x7351)


def _half2(word: int) -> tuple[float, float]:
    h = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
    return float(h[0]), float(h[1])


def test_codebook_lookup_mirror():
    """The byte-plane tables (decode.codebook_planes) and the PRMT lookup steps of lut16 / lut4 give
    f16(codebook[code]) for every code in every position: all 16^4 selectors for the 4-bit book (both
    K and V use it), all 4^4 for the 2-bit book, with garbage in the selector bits the kernel ignores."""
    f16 = lambda v: float(torch.tensor(v, dtype=torch.float32).to(torch.float16))  # noqa: E731
    book4 = [f16(v) for v in codebook("lloyd_max", 4)]
    lo_w, hi_w = decode.codebook_planes(codebook("lloyd_max", 4))
    gen = torch.Generator().manual_seed(0)
    junk = torch.randint(0, 1 << 16, (1 << 16,), generator=gen).tolist()
    for sel in range(1 << 16):
        n = [(sel >> (4 * k)) & 15 for k in range(4)]
        r0, r1 = _lut16(sel | (junk[sel] << 16), lo_w, hi_w)  # the upper half of the selector is ignored
        assert _half2(r0) == (book4[n[0]], book4[n[2]]) and _half2(r1) == (book4[n[1]], book4[n[3]]), sel
    book2 = [f16(v) for v in codebook("lloyd_max", 2)]
    lo2, hi2 = decode.codebook_planes(codebook("lloyd_max", 2))
    assert lo2[1:] == hi2[1:] == (0, 0, 0)
    for sel in range(1 << 8):
        n = [(sel >> (2 * k)) & 3 for k in range(4)]
        packed = sum(c << (4 * k) for k, c in enumerate(n))  # one code per nibble, as the kernel's masks leave them
        r0, r1 = _lut4(packed, lo2[0], hi2[0])
        assert _half2(r0) == (book2[n[0]], book2[n[2]]) and _half2(r1) == (book2[n[1]], book2[n[3]]), sel


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_layout_matches_format(preset, head_dim, scale_dtype):
    ts = TileSpec(preset=preset, head_dim=head_dim, scale_dtype=scale_dtype)
    lay = decode.kernel_layout(ts)
    assert lay.record_bytes == ts.tile_nbytes
    for name in ts.section_names():
        assert lay.offsets[name] == ts.offset(name), name
    assert lay.smem_bytes <= 227 * 1024
    assert 2 <= lay.stages <= 4


def _cpu_cache(**kw):
    args = dict(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=64)
    args.update(kw)
    c = kc.KVarNCache(**args)
    c.append(0, torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64))
    return c


def test_q_type_and_dtype_errors():
    c = _cpu_cache()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        decode.decode_attention([1.0], c, 0)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        decode.decode_attention(torch.zeros(2, 4, 1, 64), c, 0)


@pytest.mark.parametrize(
    "shape", [(2, 4, 64), (1, 4, 1, 64), (2, 3, 1, 64), (2, 4, 2, 64), (2, 4, 1, 128), (2, 18, 1, 64)]
)
def test_q_shape_errors(shape):
    c = _cpu_cache()
    with pytest.raises(ValueError, match=r"q must have shape \[batch=2"):
        decode.decode_attention(torch.zeros(*shape, dtype=torch.float16), c, 0)


def test_q_device_and_cache_errors():
    c = _cpu_cache()
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        decode.decode_attention(torch.zeros(2, 4, 1, 64, dtype=torch.float16), c, 0)
    with pytest.raises(TypeError, match="cache must be a KVarNCache"):
        decode.decode_attention(torch.zeros(2, 4, 1, 64, dtype=torch.float16), "cache", 0)


def test_graph_needs_max_seq_len_and_cuda():
    with pytest.raises(ValueError, match="max_seq_len"):
        decode.DecodeGraph(_cpu_cache(), 0, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        decode.DecodeGraph(_cpu_cache(max_seq_len=4096), 0, 4)


def test_plan_needs_cuda_cache():
    with pytest.raises(ValueError, match="cache must be on a CUDA device"):
        decode.DecodePlan(_cpu_cache())


def test_ragged_argument_errors():
    ts = TileSpec(preset="k4v2_g64", head_dim=64)
    tiles = torch.zeros(2, 4, 2, ts.tile_nbytes, dtype=torch.uint8)
    win = torch.zeros(2, 2, 64, 64, dtype=torch.float16)
    sink = torch.zeros(2, 2, 0, 64, dtype=torch.float16)
    lens = torch.zeros(2, dtype=torch.int32)
    q = torch.zeros(2, 4, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="tiles must be a contiguous uint8"):
        decode.decode_attention_ragged(q, tiles[..., :-16], win, win, sink, sink, lens, lens, lens, ts)
    with pytest.raises(TypeError, match="spec must be a TileSpec"):
        decode.decode_attention_ragged(q, tiles, win, win, sink, sink, lens, lens, lens, "k4v2_g64")
    with pytest.raises(ValueError, match="tiles must be on a CUDA device"):
        decode.decode_attention_ragged(q, tiles, win, win, sink, sink, lens, lens, lens, ts)


def test_scale_validation():
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        decode._check_scale(-1.0, 64)
    assert decode._check_scale(None, 64) == 0.125


def test_exact_blocks_and_layout():
    ts = TileSpec(preset="k4v2_g128", head_dim=128)
    lay = decode.kernel_layout(ts)
    assert lay.exact_tokens == 64
    assert decode.exact_blocks(ts, 256, 0) == 4
    assert decode.exact_blocks(ts, 256, 100) == 6
    assert decode.exact_blocks(ts, 0, 0) == 1
    assert decode.kernel_layout(TileSpec(preset="k4v2_g128", head_dim=256)).exact_tokens == 32


def test_split_cost_model():
    """The split choice model: batch 1 / 4k spreads to 2 tiles per split; batch 16 / 32k fills one wave of
    4 resident blocks per SM (measured best, S = 4: a 3-block wave or a partial second wave is slower)."""
    def best(pairs, cap, occ=4, min_tps=2):
        cands = range(1, min(4 * 132 * occ // pairs, -(-cap // min_tps)) + 1)
        return min(cands, key=lambda s: (decode.split_cost(s, pairs, cap, 132, occ, min_tps), s))

    assert best(8, 33) == 17
    assert best(128, 257) == 4
    assert decode.split_cost(5, 128, 257, 132, 4, 2) > decode.split_cost(8, 128, 257, 132, 4, 2)
    assert 33 <= best(8, 1025) <= 66


def test_min_tps_env(monkeypatch):
    monkeypatch.setenv("KVARN_DECODE_MIN_TPS", "3")
    assert decode.min_tiles_per_split() == 3
    monkeypatch.delenv("KVARN_DECODE_MIN_TPS")
    assert decode.min_tiles_per_split() == decode.MIN_TILES_PER_SPLIT


def _codes2(z: int, k: int, nb: int) -> tuple[int, int]:
    """The uniform kernel's codes2<K, NB>(z): bits [K, K+NB) of bytes 0 and 2 of z (low half, high half)."""
    m = (1 << nb) - 1
    return (z >> k) & m, (z >> (16 + k)) & m


def test_codebook_operands_mirror_the_uniform_operands():
    """Operand by operand, the lloyd_max selectors of the K loop and of the V loop (4- and 2-bit) give
    codebook[c] where the uniform kernel's codes2 gives c: same tokens, channels and MMA slots."""
    f16 = lambda v: float(torch.tensor(v, dtype=torch.float32).to(torch.float16))  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(0, 1 << 32, (200, 4), generator=gen, dtype=torch.int64).tolist()
    b4 = [f16(v) for v in codebook("lloyd_max", 4)]
    lo4, hi4 = decode.codebook_planes(codebook("lloyd_max", 4))
    b2 = [f16(v) for v in codebook("lloyd_max", 2)]
    lo2, hi2 = decode.codebook_planes(codebook("lloyd_max", 2))
    for x in words:
        for m in range(4):  # byte m (K: m < MB; V: bi & 3)
            usel = m | ((4 + m) << 8)
            z01, z23 = _byte_perm(x[0], x[1], usel), _byte_perm(x[2], x[3], usel)
            lsel = m | ((4 + m) << 4)
            y01, y23 = _byte_perm(x[0], x[1], lsel), _byte_perm(x[2], x[3], lsel)
            # 4-bit (K loop and V loop with VB = 4)
            a0, a1 = _lut16(y01, lo4, hi4)
            a2, a3 = _lut16(y23, lo4, hi4)
            want = [_codes2(z01, 0, 4), _codes2(z01, 4, 4), _codes2(z23, 0, 4), _codes2(z23, 4, 4)]
            for got, w in zip((a0, a1, a2, a3), want):
                assert _half2(got) == (b4[w[0]], b4[w[1]])
            # 2-bit V: first MMA fields 0, 1; second MMA fields 2, 3
            e01, o01 = _lut4(y01 & 0x3333, lo2[0], hi2[0]), _lut4((y01 >> 2) & 0x3333, lo2[0], hi2[0])
            e23, o23 = _lut4(y23 & 0x3333, lo2[0], hi2[0]), _lut4((y23 >> 2) & 0x3333, lo2[0], hi2[0])
            for hf, (k0, k1) in enumerate(((0, 2), (4, 6))):
                got = (e01[hf], o01[hf], e23[hf], o23[hf])
                want = [_codes2(z01, k0, 2), _codes2(z01, k1, 2), _codes2(z23, k0, 2), _codes2(z23, k1, 2)]
                for g_, w in zip(got, want):
                    assert _half2(g_) == (b2[w[0]], b2[w[1]])
