"""The int8 K-operand variant of the fused prefill kernel (``FusedConfig(k_operand="int8")``,
``csrc/prefill_int8.cuh``): its torch mirror against the float64 reference on the CPU cases of
tests/test_prefill.py that it supports (uniform quantizer), its builds for sm_80 and sm_90, and on the GPU
the kernel against the reference and against the mirror. Tolerance: 5e-3 norm-wise relative, as for f16.
"""

from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass.ops.prefill import DEFAULT_CONFIGS, FusedConfig
from kvarn_cutlass.prefill import prefill_attention

from test_prefill import ADVERSARIAL, CASES, GPU_CASES, HAS_CUDA, TOL, capture_qkv, check_constant_tiles, \
    kernel_and_mirror_errors, make_chunk, outliers, rel, run_chunks

gpu = pytest.mark.gpu
I8 = FusedConfig(16, 64, k_operand="int8")
I8_D256 = FusedConfig(16, 32, k_operand="int8")


def i8_config(D: int, tile_tokens: int = 128) -> FusedConfig:
    cfg = I8_D256 if D == 256 else I8
    assert cfg.fits(D, tile_tokens)
    return cfg


def _supported(kw, gpu=False) -> bool:
    return kw.get("quantizer", "uniform") == "uniform"


INT8_CASES = [c for c in CASES if _supported(c[1])]
INT8_GPU_CASES = [c for c in GPU_CASES if _supported(c[1], gpu=True)]


# ---------------------------------------------------------------------------------------------
# config
def test_config_name_and_validity():
    assert I8.name == "r16c4n64i8" and FusedConfig.from_name("r16c4n64i8") == I8
    assert FusedConfig.from_name("r16c8n32g2i8") == FusedConfig(16, 32, 8, 2, k_operand="int8")
    assert FusedConfig.from_name("r32c4n64").k_operand == "f16"
    with pytest.raises(ValueError, match="k_operand"):
        FusedConfig(k_operand="int4")
    assert not FusedConfig(32, 64, k_operand="int8").fits(128, 128)       # one m16 tile per warp
    assert not FusedConfig(16, 64, 8, k_operand="int8").fits(128, 128)    # 168 registers: spills
    assert I8_D256.fits(256, 128) and not I8.fits(256, 128) and I8.fits(64, 64)
    assert FusedConfig(16, 32, 4, 2, k_operand="int8").fits(128, 64)
    assert not FusedConfig(16, 64, mma="wgmma", k_operand="int8").fits(128, 128)
    assert I8.supports(kc.TileSpec("k4v2_g128", 128))
    assert not I8.supports(kc.TileSpec("k4v2_g128", 128, quantizer="lloyd_max"))
    # selectable only: never the default nor a tuner candidate
    from kvarn_cutlass.ops.prefill import CANDIDATES

    assert all(c.k_operand == "f16" for c in (*CANDIDATES, *DEFAULT_CONFIGS.values()))


def test_torch_path_refuses_lloyd_max():
    cache = kc.KVarNCache(1, 1, 1, 64, window=128, dtype=torch.float16, quantizer="lloyd_max")
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_chunk(gen, 1, 1, 2, 8, 64, torch.float16, outliers(gen, 64), 0.3)
    with pytest.raises(ValueError, match="uniform"):
        prefill_attention(q, k, v, cache, 0, impl="torch", config=I8)


# ---------------------------------------------------------------------------------------------
# the mirror against the float64 reference
@pytest.mark.parametrize("chunks,kw", INT8_CASES)
def test_cpu_int8_mirror(chunks, kw):
    errs = run_chunks(chunks, config=i8_config(kw.get("D", 128)), **kw)
    for n, nt, e in errs:
        assert e < TOL, (chunks, kw, n, nt, e)
    if sum(chunks) > 384:
        assert any(nt > 0 for _, nt, _ in errs)


def test_cpu_int8_mirror_close_to_f16_path():
    """The two K operands differ by far less than either's error: the two-level fold (error <= 1/508 of a
    query level per channel) against f16 operands (2^-11 relative)."""
    a = run_chunks([700, 300], config=I8, seed=3)
    b = run_chunks([700, 300], seed=3)
    for (n, nt, ea), (_, _, eb) in zip(a, b):
        assert abs(ea - eb) < 0.25 * max(ea, eb) + 1e-4, (n, nt, ea, eb)


def test_cpu_int8_largest_chunk():
    for n, nt, e in run_chunks([4096, 8192], D=64, Hkv=1, group=1, preset="k4v2_g64", window=128, seed=4,
                               config=I8):
        assert e < TOL, (n, nt, e)


@pytest.mark.parametrize("case", [*ADVERSARIAL, "constant_tiles"])
def test_cpu_int8_adversarial(case):
    kw = ADVERSARIAL.get(case, {})
    if case == "constant_tiles":
        check_constant_tiles(impl="torch", config=I8)
        return
    for n, nt, e, e_out in run_chunks([600, 200], seed=8, floor=True, config=I8, **kw):
        assert e < TOL + e_out, (case, n, nt, e, e_out)


def test_cpu_int8_extreme_logits_stay_finite():
    for kw in (dict(q_scale=2e3), dict(scale=1e4)):
        for n, nt, e in run_chunks([600, 300], seed=13, config=I8, **kw):
            assert e < 0.05, (kw, n, nt, e)


def test_cpu_int8_real_model_qkv():
    layers, cfg = capture_qkv(640)
    errs = []
    for li in (0, len(layers) - 1):
        q, k, v = (x.half() for x in layers[li])
        cache = kc.KVarNCache(1, 1, cfg.num_key_value_heads, cfg.head_dim, window=256, dtype=torch.float16)
        start = 0
        for n in (300, 340):
            sl = slice(start, start + n)
            ref = kc.reference.attention(q[:, :, sl], cache, 0, k=k[:, :, sl], v=v[:, :, sl])
            out = prefill_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], cache, 0, impl="torch",
                                    config=i8_config(cfg.head_dim))
            errs.append((li, n, rel(out, ref)))
            start += n
    assert max(e for *_, e in errs) < TOL, errs


# ---------------------------------------------------------------------------------------------
# builds: sm_90 and sm_80, no more spills than the f16 configs of the same shape
I8_BUILDS = [
    (kc.TileSpec("k4v2_g128", 128), torch.float16, I8),
    (kc.TileSpec("k4v2_g128", 128), torch.bfloat16, FusedConfig(16, 32, k_operand="int8")),
    (kc.TileSpec("k4v2_g128", 128), torch.float16, FusedConfig(16, 64, 4, 2, k_operand="int8")),
    (kc.TileSpec("k4v4_g64", 64, torch.float32), torch.float16, I8),
    (kc.TileSpec("k4v2_g128", 64), torch.bfloat16, FusedConfig(16, 32, k_operand="int8")),  # 2 units, 4 warps
    (kc.TileSpec("k4v4_g64", 128, torch.float32), torch.bfloat16, FusedConfig(16, 32, 4, 2, k_operand="int8")),
    (kc.TileSpec("k4v2_g64", 256), torch.float16, I8_D256),
    (kc.TileSpec("k4v4_g128", 256, torch.float32), torch.bfloat16, I8_D256),
]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_int8_variant_compiles(arch):
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.ops.prefill import MAX_SMEM_PER_BLOCK, fused_spec, smem_bytes
    from kvarn_cutlass.runtime.spec import build

    for spec, dt, cfg in I8_BUILDS:
        ks = fused_spec(spec, dt, dt, cfg)
        assert ks.name.endswith("i8") and dict(ks.defines)["K_INT8"] == "1"
        m = build(ks, arch)
        res = m.resources["kvarn_prefill_fused"]
        f16 = build(fused_spec(spec, dt, dt, FusedConfig(cfg.rows_per_warp, cfg.block_n, cfg.consumer_warps,
                                                           cfg.producer_groups)), arch).resources["kvarn_prefill_fused"]
        # sm_90 (the measured target): no more than the f16 config (none), except head_dim 256, where the
        # consumers hold the int8 query fold (68 registers) beside the 128 of the accumulator at 255: ptxas
        # spills two loop-invariant ints of the exact phase there (8 bytes, one LDL each per exact block);
        # sm_80 builds, never run, may spill a few words, as test_prefill.py allows the f16 ones
        slack = (8 if spec.head_dim == 256 else 0) if arch == "sm_90" else 16
        assert (res.spill_store_bytes or 0) <= (f16.spill_store_bytes or 0) + slack, (ks.name, arch, res, f16)
        assert res.stack_bytes <= f16.stack_bytes + slack, (ks.name, arch, res, f16)
        smem = smem_bytes(m.cubin)
        assert 0 < smem <= MAX_SMEM_PER_BLOCK, (ks.name, smem)


def test_int8_refuses_lloyd_max_build():
    from kvarn_cutlass.ops.prefill import fused_spec

    with pytest.raises(ValueError, match="uniform"):
        fused_spec(kc.TileSpec("k4v2_g128", 128, quantizer="lloyd_max"), torch.float16, torch.float16, I8)


# ---------------------------------------------------------------------------------------------
# GPU: the int8 kernel against the reference and its mirror
def _gpu_skip():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")


@gpu
@pytest.mark.parametrize("chunks,kw", INT8_GPU_CASES)
@pytest.mark.parametrize("block_n,producer_groups", [(64, 1), (32, 1), (64, 2)])
def test_gpu_int8(chunks, kw, block_n, producer_groups):
    _gpu_skip()
    D = kw.get("D", 128)
    cfg = FusedConfig(16, block_n, 4, producer_groups, k_operand="int8")
    preset = kw.get("preset", "k4v2_g128")
    if not cfg.fits(D, kc.TileSpec(preset, D).tile_tokens):
        pytest.skip(f"{cfg.name} does not fit D={D}")
    for n, nt, e in run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks) + 200, config=cfg, **kw):
        assert e < TOL, (chunks, kw, cfg.name, n, nt, e)


@gpu
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_gpu_int8_adversarial(case):
    _gpu_skip()
    for n, nt, e, e_out in run_chunks([600, 900], device="cuda", impl="gpu", seed=9, floor=True, config=I8,
                                      **ADVERSARIAL[case]):
        assert e < TOL + e_out, (case, n, nt, e, e_out)


@gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_int8_matches_its_mirror(D):
    """Kernel and mirror on the same inputs agree more closely than either agrees with the reference."""
    _gpu_skip()
    e_gpu, e_emu, e_both = kernel_and_mirror_errors(10 + D, D, 900, i8_config(D))
    assert e_gpu < TOL and e_both < max(e_gpu, e_emu), (e_gpu, e_emu, e_both)


@gpu
def test_gpu_int8_real_model_qkv():
    _gpu_skip()
    layers, cfg = capture_qkv(1200, device="cuda")
    for chunks in ((1200,), (500, 500, 200)):
        errs = []
        for li in range(len(layers)):
            q, k, v = (x.half().cuda() for x in layers[li])
            cache = kc.KVarNCache(1, 1, cfg.num_key_value_heads, cfg.head_dim, window=256, dtype=torch.float16,
                                  device="cuda")
            start = 0
            for n in chunks:
                sl = slice(start, start + n)
                ref = kc.reference.attention(q[:, :, sl], cache, 0, k=k[:, :, sl], v=v[:, :, sl])
                out = prefill_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], cache, 0,
                                        config=i8_config(cfg.head_dim))
                errs.append((li, n, rel(out, ref)))
                start += n
        assert max(e for *_, e in errs) < TOL, (chunks, errs)


# ---------------------------------------------------------------------------------------------
# a model of the kernel's K-operand plumbing (PTX semantics from tests/test_decode.py's warp model):
# producers' ldmatrix.trans of the swizzled record + PRMT + masks + fragment-slot stores, consumers' LDS.64 +
# mma.m16n8k32 s8 x s8
def _slot(nt: int, lane: int) -> int:
    """prefill_int8.cuh kint8_slot."""
    return lane ^ (((nt & 1) << 3) | (((lane >> 4) & 1) << 2))


@pytest.mark.parametrize("T,D,BN", [(128, 128, 64), (64, 64, 32), (128, 256, 32), (64, 128, 64)])
def test_int8_fragment_plumbing(T, D, BN):
    """Every block's staged fragments give lane (g, q) of a consumer warp, through the s8 MMA against any int8
    A, sum_c A[row][c] * 16 (code[c][t] - 8) for its rows and tokens; the producers' stores and the consumers'
    loads are bank-conflict-free (each half-warp's 8-byte slots distinct modulo 128 bytes)."""
    import numpy as np
    from test_decode import c_frag, ldsm4t, ldsm_row, mma, prmt, swz

    rng = np.random.default_rng(T + D + BN)
    KST, CH, CPR, SN = D // 32, BN // 32, T // 32, BN // 8
    codes = rng.integers(0, 16, (D, T))
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8).reshape(-1)
    rec = np.zeros(packed.size, np.uint8)
    for i in range(packed.size // 16):  # the fetch: kint8_rec_chunk
        rec[16 * swz(CPR, i):16 * swz(CPR, i) + 16] = packed[16 * i:16 * i + 16]
    HM, SX = 0xF0F0F0F0, 0x80808080
    for t0 in range(0, T, BN):
        stage = {}
        for s in range(KST):
            for tc in range(CH):
                addr = [16 * swz(CPR, (32 * s + ldsm_row(l)) * CPR + (t0 >> 5) + tc) for l in range(32)]
                r = ldsm4t(rec, addr)
                for j in range(4):
                    slots = []
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3
                        x0, y0 = prmt(r[lane][0], r[lane][1], 0x6420), prmt(r[lane][0], r[lane][1], 0x7531)
                        x1, y1 = prmt(r[lane][2], r[lane][3], 0x6420), prmt(r[lane][2], r[lane][3], 0x7531)
                        b0 = [((x0 << 4) & HM) ^ SX, (x0 & HM) ^ SX, ((y0 << 4) & HM) ^ SX, (y0 & HM) ^ SX]
                        b1 = [((x1 << 4) & HM) ^ SX, (x1 & HM) ^ SX, ((y1 << 4) & HM) ^ SX, (y1 & HM) ^ SX]
                        nt = tc * 4 + (g >> 1)
                        sl = (s * SN + nt) * 32 + _slot(nt, 16 * (g & 1) + 4 * j + q)
                        assert sl not in stage
                        stage[sl] = (b0[j], b1[j])
                        slots.append(sl)
                    for half in range(2):  # one STS.64: two phases of 16 lanes
                        assert len({x % 16 for x in slots[16 * half:16 * half + 16]}) == 16
        assert len(stage) == KST * SN * 32
        A = rng.integers(-127, 128, (16, D))
        for nt in range(SN):
            acc = [[0] * 4 for _ in range(32)]
            for s in range(KST):
                slots = [(s * SN + nt) * 32 + _slot(nt, lane) for lane in range(32)]
                for half in range(2):
                    assert len({x % 16 for x in slots[16 * half:16 * half + 16]}) == 16
                bfr = [list(stage[x]) for x in slots]
                afr = []
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    afr.append([sum((int(A[g + 8 * (rr & 1), 32 * s + 16 * (rr >> 1) + 4 * q + i]) & 0xFF) << (8 * i)
                                    for i in range(4)) for rr in range(4)])
                Dm = mma(afr, bfr, a_signed=True)
                for lane in range(32):
                    acc[lane] = [a + b for a, b in zip(acc[lane], c_frag(Dm, lane))]
            want = A.astype(np.int64) @ (16 * (codes[:, t0 + 8 * nt:t0 + 8 * nt + 8] - 8))  # [16, 8]
            for lane in range(32):
                assert acc[lane] == c_frag(want, lane), (t0, nt, lane)


def test_two_level_bit_trick_matches_the_mirror():
    """The kernel's two levels from float bits (prefill_int8.cuh kint8_fold): h = x + MAGIC, t = fma(h, -254,
    255 MAGIC) = MAGIC - 254 rint(x) (exact), lo = fma(x, 254, t): the low bytes are rint(x) and
    rint(254 (x - rint(x))) as the mirror computes them, for |x| <= 127 (1 + 2^-23) (ties included)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-127, 127, 200000), np.arange(-127, 127.5, 0.5),
                        np.arange(-127, 127, 1 / 508), [127 * (1 + 2.0 ** -23), -127 * (1 + 2.0 ** -23)]])
    x = x.astype(np.float32)
    M = np.float32(12582912.0)
    f32 = lambda v: np.asarray(v, np.float64).astype(np.float32)  # noqa: E731  (one rounding of an exact f64)
    h = f32(x.astype(np.float64) + M)
    t = f32(h.astype(np.float64) * -254 + 255 * np.float64(M))
    lo = f32(x.astype(np.float64) * 254 + t.astype(np.float64))
    byte = lambda v: (v.view(np.uint32) & 0xFF).astype(np.int64)  # noqa: E731
    sb = lambda b: np.where(b > 127, b - 256, b)  # noqa: E731
    hi_ref = torch.round(torch.from_numpy(x)).double()
    lo_ref = torch.round((torch.from_numpy(x).double() - hi_ref) * 254)
    assert np.array_equal(sb(byte(h)), hi_ref.numpy().astype(np.int64))
    assert np.array_equal(sb(byte(lo)), lo_ref.numpy().astype(np.int64))
    assert np.abs(lo_ref.numpy()).max() <= 127
