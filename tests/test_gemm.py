"""CPU tests of the K-score GEMM package: compat, emission, validators, nvcc build + SASS, prep kernels
(NVRTC) and their torch references, config table.  The one nvcc build (~1 min on 2 cores) is cached
on disk under the kvarn-cutlass cache root and shared through a session fixture."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kvarn_cutlass.format import TileSpec
from kvarn_cutlass.gemm import GemmConfig, emit_source, validate_config, validate_for_problem
from kvarn_cutlass.gemm.configs import (UntunedConfigWarning, bucket_key, default_config, gemm_depth, load_table,
                                        select_config, untuned_table)
from kvarn_cutlass.gemm.tune import parse_bucket
from kvarn_cutlass.gemm.prep import TileOffsets, fold_reference, kscore_reference, unpack_reference

REPO = Path(__file__).resolve().parents[1]
CFG = GemmConfig()  # cooperative 128x128x128, f16 scores: the config the test builds with nvcc
PINGPONG = GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=2, kernel_schedule="pingpong", out_dtype="f32")


def _run_py(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------
# compat
def test_cutlass_cppgen_offline_no_cwd_writes_no_alias_leak(tmp_path):
    """Import + plan/EVT emission through compat: works with cuda-bindings 13, writes nothing into cwd,
    leaves no cuda.cuda alias and no tempfile.tempdir change behind, never queries a device."""
    code = r"""
import sys, tempfile
from kvarn_cutlass.gemm.compat import cutlass_cppgen_offline, import_cutlass_cppgen, DeviceQueryError
from kvarn_cutlass.gemm.emit import cppgen_reference_source
from kvarn_cutlass.gemm import GemmConfig
before = tempfile.tempdir
src = cppgen_reference_source(GemmConfig())
assert "Sm90ColBroadcast" in src and "Sm90RowBroadcast" in src and "Sm90ScalarBroadcast" in src, src
assert "KernelTmaWarpSpecializedCooperative" in src and "int8_t" in src
assert "cuda.cuda" not in sys.modules and "cuda.cudart" not in sys.modules
import cuda
assert not hasattr(cuda, "cuda")
assert tempfile.tempdir == before
with cutlass_cppgen_offline(90) as c:
    from cutlass_cppgen.backend.utils import device
    try:
        device.device_cc()
    except DeviceQueryError:
        pass
    else:
        raise AssertionError("device_cc() was not blocked")
print("OK")
"""
    r = _run_py(code, tmp_path)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


# ---------------------------------------------------------------------------------------------
# emission
@pytest.mark.parametrize("cfg,expect", [
    (CFG, ["cutlass::gemm::KernelTmaWarpSpecializedCooperative", "cutlass::epilogue::TmaWarpSpecializedCooperative",
           "Shape<_128, _128, _128>", "Shape<_1, _1, _1>", "using ElementD = cutlass::half_t;",
           "homogeneous_multiply_add", "Sm90ColBroadcast", "Sm90RowBroadcast", "Sm90ScalarBroadcast",
           "cutlass::layout::ColumnMajor", "int8_t", ", 8,\n"]),
    (PINGPONG, ["cutlass::gemm::KernelTmaWarpSpecializedPingpong", "using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;",
                "Shape<_64, _128, _128>", "Shape<_2, _1, _1>", "using ElementD = float;", ", 4,\n"]),
    (GemmConfig(kernel_schedule="streamk", tile_k=64), ["cutlass::gemm::StreamKScheduler"]),
    (GemmConfig(out_dtype="s32"), ["using ElementD = int32_t;", "Identity"]),
])
def test_emission_contents_and_determinism(cfg, expect):
    src = emit_source(cfg)
    for e in expect:
        assert e in src, f"{e!r} missing from the source of {cfg.name}"
    assert 'extern "C" __global__ void\n' in src and f"{cfg.name}_params" in src
    assert emit_source(cfg) == src
    # stable across processes (no hash-seed or id()-dependent text)
    r = _run_py(f"from kvarn_cutlass.gemm import GemmConfig, emit_source; import hashlib; "
                f"print(hashlib.sha256(emit_source(GemmConfig(**{cfg.to_dict()!r})).encode()).hexdigest())",
                REPO)
    import hashlib
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == hashlib.sha256(src.encode()).hexdigest()


def test_emit_rejects_invalid():
    with pytest.raises(ValueError, match="pingpong"):
        emit_source(GemmConfig(kernel_schedule="pingpong", tile_m=128))


@pytest.mark.parametrize("kw,frag", [
    (dict(kernel_schedule="pingpong", tile_m=128), "tile_m must be 64"),
    (dict(kernel_schedule="cooperative", tile_m=64), "tile_m must be 128 or 256"),
    (dict(kernel_schedule="warpspecialized"), "unknown kernel_schedule"),
    (dict(kernel_schedule="pingpong", tile_m=64, epilogue_schedule="tma_cooperative"), "does not pair"),
    (dict(out_dtype="bf16"), "unknown out_dtype"),
    (dict(align_a=8), "16-element"),
    (dict(tile_k=32), "tile_k=32"),
    (dict(tile_n=96), "tile_n=96"),
    (dict(cluster_m=4, cluster_n=4), "portable limit"),
    (dict(cluster_m=3), "cluster 3x1"),
    (dict(tile_m=256, tile_n=256, tile_k=256), "shared memory"),
])
def test_validate_config_rejects_with_reason(kw, frag):
    ok, why = validate_config(GemmConfig(**kw))
    assert not ok and frag in why, why


def test_validate_for_problem():
    assert validate_for_problem(CFG, 4096, 128, 128, 128) == (True, "")
    for args, frag in [((4096, 64, 128, 8), "tile_n=128 > N=64"),
                       ((4096, 128, 64, 8), "not a multiple of tile_k"),
                       ((4096, 128, 120, 8), "multiple of 16"),
                       ((0, 128, 128, 8), "M=0")]:
        ok, why = validate_for_problem(CFG, *args)
        assert not ok and frag in why, (args, why)
    ok, why = validate_for_problem(CFG.replace(cluster_n=2), 4096, 128, 128, 8)
    assert not ok and "cluster_n=2" in why
    ok, why = validate_for_problem(GemmConfig(kernel_schedule="streamk"), 4096, 128, 128, 8)
    assert not ok and "stream-K" in why
    ok, why = validate_for_problem(CFG.replace(out_dtype="f16"), 4096, 36, 128, 8)
    assert not ok


# ---------------------------------------------------------------------------------------------
# nvcc build (session fixture, disk-cached) + SASS
@pytest.fixture(scope="session")
def built(tmp_path_factory):
    from kvarn_cutlass.gemm.compile import build_gemm

    cwd = tmp_path_factory.mktemp("cwd")
    old = os.getcwd()
    os.chdir(cwd)
    try:
        b = build_gemm(CFG, "sm90")
    finally:
        os.chdir(old)
    return b, cwd


def test_build_writes_nothing_to_cwd(built):
    b, cwd = built
    assert os.listdir(cwd) == []
    assert b.cubin[:4] == b"\x7fELF" and b.host_so[:4] == b"\x7fELF"
    from kvarn_cutlass.runtime import cubin_sm, cubin_symbols

    assert b.entry in cubin_symbols(b.cubin)
    assert cubin_sm(b.cubin) == 90
    assert "-DNDEBUG" in b.meta["flags"] and "-arch=sm_90a" in b.meta["flags"]
    assert "C7510" not in b.ptxas_log


def test_host_helper_reports_kernel_sizes(built):
    b, _ = built
    h = b.host()
    assert h.threads == 384  # cooperative: 1 producer + 2 consumer warp groups
    assert h.cluster == (1, 1, 1)
    assert 0 < h.params_size <= 4096  # a by-value kernel parameter (limit 4 KB on sm_90)
    assert 100_000 < h.smem_size <= 227 * 1024


def test_sass_has_igmma_and_no_spills(built):
    from kvarn_cutlass.gemm.sass import disassemble, find_tool, summarize

    if find_tool("cuobjdump") is None and find_tool("nvdisasm") is None:
        pytest.skip("no cuobjdump/nvdisasm (pip install nvidia-cuda-cuobjdump)")
    b, _ = built
    s = summarize(disassemble(b.cubin), b.ptxas_log)
    assert s.igmma > 0 and all(k.startswith("IGMMA.64x128x32.S8.S8") for k in s.igmma_shapes), s
    assert s.warpgroup_depbar > 0
    assert s.ldl == 0 and s.stl == 0, s
    assert s.spill_stores == 0 and s.spill_loads == 0


# ---------------------------------------------------------------------------------------------
# prep kernels: NVRTC build for sm_90 and sm_80
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_prep_kernels_compile(arch):
    from kvarn_cutlass.gemm.prep import PREP_KERNELS, build_prep
    from kvarn_cutlass.runtime import cubin_sm, cubin_symbols

    cubin = build_prep(arch).cubin
    assert set(PREP_KERNELS) <= cubin_symbols(cubin)
    assert cubin_sm(cubin) == int(arch[3:])


# ---------------------------------------------------------------------------------------------
# torch references vs independent float64 / integer computations
def make_pool(spec: TileSpec, n_records: int, gen: torch.Generator) -> torch.Tensor:
    """Random records with valid K sections: random nibbles, positive steps, signed mins/scales."""
    nb = spec.tile_nbytes
    pool = torch.randint(0, 256, (n_records, nb), generator=gen, dtype=torch.int64).to(torch.uint8)
    D, T, dt = spec.head_dim, spec.tile_tokens, spec.scale_dtype

    def put(name, vals):
        o = spec.offset(name)
        raw = vals.to(dt).contiguous().view(torch.uint8).reshape(n_records, -1)
        pool[:, o:o + raw.shape[1]] = raw

    put("chan_step", torch.rand(n_records, D, generator=gen) * 0.2 + 0.01)
    put("chan_min", torch.randn(n_records, D, generator=gen))
    put("row_scale", torch.rand(n_records, T, generator=gen) + 0.5)
    return pool


@pytest.mark.parametrize("D,preset,sdt", [(128, "k4v2_g128", torch.float16), (64, "k4v2_g64", torch.float32),
                                          (256, "k4v4_g128", torch.float16)])
def test_unpack_reference_against_bit_loop(D, preset, sdt):
    gen = torch.Generator().manual_seed(D)
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=sdt)
    pool = make_pool(spec, 7, gen)
    offs = TileOffsets.from_spec(spec)
    tile_index = torch.tensor([3, 0, 6, 3], dtype=torch.int32)
    codes, rs = unpack_reference(pool, tile_index, offs)
    T = spec.tile_tokens
    assert codes.shape == (4, T, 2 * D) and codes.dtype == torch.int8 and rs.shape == (4, T)
    # centered codes: [16*(code-8) ++ (code-8)], values in [-128, 112] and [-8, 7]
    assert int(codes[..., :D].min()) >= -128 and int(codes[..., :D].max()) <= 112
    assert int(codes[..., D:].min()) >= -8 and int(codes[..., D:].max()) <= 7
    assert torch.equal(codes[..., :D].long(), 16 * codes[..., D:].long())
    ko = spec.offset("k_codes")
    for l, r in enumerate(tile_index.tolist()):
        rec = pool[r].tolist()
        for t in range(0, T, 7):
            for c in range(0, D, 5):
                byte = rec[ko + c * (T // 2) + t // 2]
                want = (byte >> 4) & 15 if t % 2 else byte & 15
                assert codes[l, t, c].item() == 16 * (want - 8)
                assert codes[l, t, D + c].item() == want - 8
        ro = spec.offset("row_scale")
        want_rs = pool[r, ro:ro + T * (2 if sdt == torch.float16 else 4)].view(sdt).double()
        assert torch.equal(rs[l].double(), want_rs)


@pytest.mark.parametrize("qdt", [torch.float16, torch.bfloat16, torch.float32])
def test_fold_reference_properties(qdt):
    gen = torch.Generator().manual_seed(11)
    spec = TileSpec(preset="k4v2_g128", head_dim=128)
    H, n_tiles, M, D = 2, 3, 40, 128
    pool = make_pool(spec, 9, gen)
    offs = TileOffsets.from_spec(spec)
    tile_index = torch.randperm(9, generator=gen)[: H * n_tiles].to(torch.int32)
    q = (torch.randn(H, M, D, generator=gen) * 3).to(qdt)
    q[0, 5] = 0  # an all-zero row: a = 0, qi8 = 0
    qi8, a, bias = fold_reference(q, pool, tile_index, offs, n_tiles)
    assert qi8.shape == (H * n_tiles, M, 2 * D) and a.shape == bias.shape == (H * n_tiles, M)
    hi, lo = qi8[..., :D].double(), qi8[..., D:].double()
    assert int(hi.abs().max()) <= 127 and int(lo.abs().max()) <= 8
    # independent float64 computation
    step = torch.stack([pool[r, offs.chan_step:offs.chan_step + 2 * D].view(torch.float16) for r in tile_index.tolist()]).double()
    cmin = torch.stack([pool[r, offs.chan_min:offs.chan_min + 2 * D].view(torch.float16) for r in tile_index.tolist()]).double()
    for l in range(H * n_tiles):
        h = l // n_tiles
        qf = q[h].double() * step[l]
        amax = qf.abs().amax(-1)
        # a is the GEMM's per-row scale: max|qfold| / 127 / 16 (the 1/16 of the residual level)
        assert torch.allclose(a[l].double(), amax / 127 / 16, rtol=1e-6, atol=0)
        nz = amax > 0
        x = qf[nz] / (amax[nz, None] / 127)  # qfold / (max|qfold| / 127), float64
        two_level = hi[l][nz] + lo[l][nz] / 16
        # two levels: |qfold/a - (hi + lo/16)| <= 1/32 (+ the f32 rounding of x, |x| <= 127)
        assert float((x - two_level).abs().max()) <= 1 / 32 + 1e-4
        # and the scale the GEMM applies reconstructs qfold: 16 * a * (hi + lo/16)
        err = (qf[nz] - 16 * a[l][nz].double()[:, None] * two_level).abs()
        assert bool((err <= 16 * a[l][nz].double()[:, None] * (1 / 32 + 1e-4)).all())
        # the max-magnitude channel maps to +-127
        assert bool((hi[l].abs().amax(-1)[nz] == 127).all())
        # bias carries the centering offset of the codes: sum_c q * (chanMin + 8 * chanStep)
        want = (q[h].double() * (cmin[l] + 8 * step[l])).sum(-1)
        assert torch.allclose(bias[l].double(), want, rtol=1e-5, atol=1e-4)
    assert int(qi8[0:n_tiles, 5].abs().max()) == 0 and float(a[0:n_tiles, 5].abs().max()) == 0.0


def encoded_pool(spec: TileSpec, n_records: int, gen: torch.Generator) -> torch.Tensor:
    """Records made by the project's codec from realistic K/V (outlier channels, drift)."""
    from kvarn_cutlass.codec import encode_tiles
    from _helpers import realistic_kv

    k = realistic_kv(n_records, spec.tile_tokens, spec.head_dim, generator=gen)
    v = realistic_kv(n_records, spec.tile_tokens, spec.head_dim, generator=gen)
    return encode_tiles(k, v, spec)


def test_unpack_reference_matches_codec_fields():
    from kvarn_cutlass.codec import unpack_fields

    gen = torch.Generator().manual_seed(2)
    spec = TileSpec(preset="k4v2_g128", head_dim=128)
    pool = encoded_pool(spec, 5, gen)
    f = unpack_fields(pool, spec)
    codes, rs = unpack_reference(pool, torch.tensor([4, 1], dtype=torch.int32), TileOffsets.from_spec(spec))
    want = f.k_codes[[4, 1]].transpose(1, 2).long() - 8
    assert torch.equal(codes.long(), torch.cat((16 * want, want), dim=-1))
    assert torch.equal(rs, f.row_scale[[4, 1]])


def test_kscore_formula_matches_dequantized_dot():
    """S from (qi8, codes, a, bias, rowScale) ~ q_rot . K_dequant (float64) within the 5e-3 bar."""
    from kvarn_cutlass.codec import unpack_fields, wht
    from _helpers import realistic_kv

    gen = torch.Generator().manual_seed(5)
    spec = TileSpec(preset="k4v2_g128", head_dim=128)
    pool = encoded_pool(spec, 4, gen)
    offs = TileOffsets.from_spec(spec)
    tile_index = torch.arange(4, dtype=torch.int32)
    q_rot = wht(realistic_kv(1, 64, 128, generator=gen).float())
    codes, rs = unpack_reference(pool, tile_index, offs)
    qi8, a, bias = fold_reference(q_rot, pool, tile_index, offs, 4)
    acc, S = kscore_reference(qi8, codes, a, bias, rs, scale=0.125)
    f = unpack_fields(pool, spec)
    Kdq = f.row_scale.double()[:, :, None] * (f.chan_min.double()[:, None, :]
                                              + f.chan_step.double()[:, None, :] * f.k_codes.double().transpose(1, 2))
    exact = 0.125 * torch.einsum("md,ltd->lmt", q_rot[0].double(), Kdq)
    rel = (S - exact).norm() / exact.norm()
    # Measured on this data (CPU): 5.4e-4 with centered codes and the two-level [hi ++ lo] fold; the
    # earlier single int8 level with codes 0..15 measured 2.1e-2 (outlier channels + a*acc/bias cancellation).
    assert rel < 5e-3, rel
    assert acc.dtype == torch.int64
    assert int(acc.abs().max()) < 2 ** 23  # exact in the GEMM's int32 accumulator (bound D * 16320)


# ---------------------------------------------------------------------------------------------
# lloyd_max: the int8 centroid tables of the codes operand
def test_lm_tables_and_documented_error():
    """The tables fit int8, lo = round(S c / 16), and the documented errors are what they are (recomputed
    here in float64 from format.codebook with independently computed cell probabilities); S is the
    least-squares scale of its table, and the table is the best of its family: of every distinct
    table round(s c) for s in [32, 127 / max|c|] (enumerated exactly, between the breakpoints
    s = (k + 1/2) / |c_i| where a rounding changes, not on lm_table's grid), none has a smaller
    weighted RMS error."""
    import math
    from kvarn_cutlass.format import codebook
    from kvarn_cutlass.gemm import prep

    c = codebook("lloyd_max", 4)
    S, hi = prep.LM_SCALE, prep.LM_TABLE_HI
    assert prep.LM_TABLE_LO == tuple(int(round(x * S / 16)) for x in c)
    assert max(map(abs, hi)) <= 127 and max(map(abs, prep.LM_TABLE_LO)) <= 8
    assert hi == tuple(-h for h in reversed(hi)) and list(hi) == sorted(set(hi))  # symmetric, increasing
    assert all(abs(h - x * S) <= 1.0 for h, x in zip(hi, c))  # a rounding of S c (within one level)
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(c[:-1], c[1:])] + [math.inf]
    cdf = lambda z: 0.5 * math.erfc(-z / math.sqrt(2))  # noqa: E731
    prob = [cdf(b) - cdf(a) for a, b in zip(edges[:-1], edges[1:])]
    assert sum(prob) == pytest.approx(1.0)
    err = [h / S - x for h, x in zip(hi, c)]
    rms = math.sqrt(sum(p * e * e for p, e in zip(prob, err)))
    assert max(map(abs, err)) == pytest.approx(prep.LM_TABLE_MAX_ERR, rel=1e-9)
    assert rms == pytest.approx(prep.LM_TABLE_RMS_ERR, rel=1e-6)
    # the documented numbers (module docstring, report): RMS 0.00316, max 0.0112, S = 38.2183
    assert rms < 0.0032 and prep.LM_TABLE_MAX_ERR < 0.0113 and S == pytest.approx(38.2183, abs=1e-4)  # as documented
    # S is (to f32) the weighted least-squares scale of the table: d/dS sum p (h/S - c)^2 = 0
    assert S == pytest.approx(sum(p * h * h for p, h in zip(prob, hi)) / sum(p * h * x for p, h, x in zip(prob, hi, c)),
                              rel=1e-6)
    top = 127 / max(c)
    cuts = sorted({(k + 0.5) / abs(x) for x in c for k in range(128) if 32 < (k + 0.5) / abs(x) < top})
    scales = [32.0, *((a + b) / 2 for a, b in zip([32.0, *cuts], [*cuts, top])), top]
    tables = {tuple(round(x * s) for x in c) for s in scales}

    def weighted_rms(h):
        s_ls = sum(p * v * v for p, v in zip(prob, h)) / sum(p * v * x for p, v, x in zip(prob, h, c))
        return math.sqrt(sum(p * (v / s_ls - x) ** 2 for p, v, x in zip(prob, h, c)))

    assert len(tables) > 100  # the family is enumerated, not sampled
    assert min(tables, key=weighted_rms) == hi


def test_lm_unpack_reference_matches_codec_fields():
    from kvarn_cutlass.codec import unpack_fields
    from kvarn_cutlass.gemm import prep

    gen = torch.Generator().manual_seed(21)
    spec = TileSpec(preset="k4v4_g64", head_dim=64, quantizer="lloyd_max")
    pool = encoded_pool(spec, 5, gen)
    f = unpack_fields(pool, spec)
    offs = TileOffsets.from_spec(spec)
    assert offs.quantizer == "lloyd_max" and offs.kernel_tag == "lm_f16"
    codes, rs = unpack_reference(pool, torch.tensor([4, 1, 4], dtype=torch.int32), offs)
    k = f.k_codes[[4, 1, 4]].transpose(1, 2).long()  # [L, T, D]
    hi = torch.tensor(prep.LM_TABLE_HI)[k]
    lo = torch.tensor(prep.LM_TABLE_LO)[k]
    assert torch.equal(codes.long(), torch.cat((hi, lo), dim=-1))
    assert torch.equal(rs, f.row_scale[[4, 1, 4]])
    assert len(set(k.flatten().tolist())) == 16  # every code (and so every table entry) was exercised


@pytest.mark.parametrize("D,preset,sdt", [(128, "k4v2_g128", torch.float16), (64, "k4v4_g64", torch.float32),
                                          (256, "k4v2_g128", torch.float16)])
def test_lm_kscore_error_within_documented_bound(D, preset, sdt):
    """lloyd_max scores from the int8 operands vs float64 q_rot . K_dequant: every score is within the bound
    the tables and the two-level fold imply, per channel |hi| * LM_TABLE_MAX_ERR + |lo/16| * E_lo + |c|/32
    (E_lo = max|16 round(S c / 16)/S - c|, |lo/16| <= 1/2) in units of max|qfold|/127; and norm-wise
    the scores are within the 5e-3 bar."""
    from kvarn_cutlass.codec import unpack_fields, wht
    from kvarn_cutlass.format import codebook
    from kvarn_cutlass.gemm import prep
    from _helpers import realistic_kv

    gen = torch.Generator().manual_seed(D + 1)
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=sdt, quantizer="lloyd_max")
    L = 3
    pool = encoded_pool(spec, L, gen)
    offs = TileOffsets.from_spec(spec)
    tile_index = torch.arange(L, dtype=torch.int32)
    q_rot = wht(realistic_kv(1, 48, D, generator=gen).float())
    codes, rs = unpack_reference(pool, tile_index, offs)
    qi8, a, bias = fold_reference(q_rot, pool, tile_index, offs, L)
    acc, S = kscore_reference(qi8, codes, a, bias, rs, scale=0.125)
    assert int(acc.abs().max()) < 2 ** 23
    f = unpack_fields(pool, spec)
    book = torch.tensor(codebook("lloyd_max", 4), dtype=torch.float64)
    vals = book[f.k_codes.long()]  # [L, D, T]
    Kdq = f.row_scale.double()[:, :, None] * (f.chan_min.double()[:, None, :] + f.chan_step.double()[:, None, :] * vals.transpose(1, 2))
    exact = 0.125 * torch.einsum("md,ltd->lmt", q_rot[0].double(), Kdq)
    assert ((S - exact).norm() / exact.norm()).item() < 5e-3
    e_lo = max(abs(16 * l / prep.LM_SCALE - x) for l, x in zip(prep.LM_TABLE_LO, book.tolist()))
    hi, lo = qi8[..., :D].double(), qi8[..., D:].double()  # [L, M, D]
    step = f.chan_step.double()
    amax = (q_rot[0].double()[None] * step[:, None, :]).abs().amax(-1)  # [L, M]
    # per (l, m, t): sum_c of the channel bound (the code's |c| term uses the actual code of (c, t))
    per_ch = hi.abs() * prep.LM_TABLE_MAX_ERR + lo.abs() / 16 * e_lo  # [L, M, D]
    bound_units = per_ch.sum(-1)[..., None] + torch.einsum("lmd,ldt->lmt", torch.ones_like(hi) / 32, vals.abs())
    bound = 0.125 * rs.double()[:, None, :].abs() * (amax / 127)[..., None] * bound_units
    slack = 1e-5 * exact.abs().amax()  # f32 rounding of a, bias and the epilogue
    assert bool(((S - exact).abs() <= bound + slack).all())
    # the bound is not vacuous: the largest error is within 20x of its bound
    assert float(((S - exact).abs() / (bound + slack)).max()) > 1 / 20


def test_lm_fold_reference_scale_and_bias():
    """lloyd_max fold: qi8 identical to the uniform fold (same hi/lo), a = max|qfold|/127 * f32(1/S),
    bias = sum_c q * chanMin (no centering offset: the codebook is centred)."""
    from kvarn_cutlass.gemm import prep

    gen = torch.Generator().manual_seed(13)
    spec_u = TileSpec(preset="k4v2_g128", head_dim=128)
    spec_l = TileSpec(preset="k4v2_g128", head_dim=128, quantizer="lloyd_max")
    pool = make_pool(spec_u, 6, gen)  # the K sections are laid out identically in both modes
    ti = torch.tensor([5, 2, 0, 1], dtype=torch.int32)
    q = (torch.randn(2, 30, 128, generator=gen) * 2).half()
    qu, au, bu = fold_reference(q, pool, ti, TileOffsets.from_spec(spec_u), 2)
    ql, al, bl = fold_reference(q, pool, ti, TileOffsets.from_spec(spec_l), 2)
    assert torch.equal(qu, ql)
    assert torch.equal(al, (au / 0.0625) * prep.LM_INV_SCALE)  # au / 0.0625 is exact (a power of two)
    cmin = torch.stack([pool[r, spec_u.offset("chan_min"):spec_u.offset("chan_min") + 256].view(torch.float16)
                        for r in ti.tolist()]).double()
    want = torch.einsum("lmd,ld->lm", q.double().repeat_interleave(2, 0), cmin)
    assert torch.allclose(bl.double(), want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# config table
def test_committed_table_is_valid_and_tuned_entries_have_provenance():
    table = load_table(90)
    assert table is not None and table["schema"] == 1 and table["arch"] == "sm90"
    assert set(table["buckets"]) == set(untuned_table(90)["buckets"])
    for key, e in table["buckets"].items():
        cfg = GemmConfig.from_dict(e["config"])
        ok, why = validate_config(cfg)
        assert ok, (key, why)
        if e["status"] == "tuned":
            M, T, D, out = parse_bucket(key)
            assert validate_for_problem(cfg, M, T, gemm_depth(D), 128)[0], key
            assert e["tops"] > 0 and e["time_us"] > 0 and cfg.out_dtype == out, key
            assert {"gpu", "driver", "cuda", "nvidia_cutlass", "date"} <= set(e["provenance"]), key
        else:
            assert e["status"] == "untuned" and e["tops"] is None and e["provenance"] is None, key


def test_select_config_takes_a_tuned_entry_valid_at_depth_2d(monkeypatch, tmp_path):
    """A tuned tile_k = 256 entry of a D=128 bucket is valid for the GEMM (K = 2D = 256) and is used."""
    table = untuned_table(90)
    tuned = GemmConfig(tile_m=256, tile_n=128, tile_k=256, cluster_m=2, kernel_schedule="cooperative")
    table["buckets"]["M4096_T128_D128_f16"].update(config=tuned.to_dict(), status="tuned", tops=1.0, time_us=1.0,
                                                    provenance={})
    (tmp_path / "sm90.json").write_text(json.dumps(table))
    monkeypatch.setenv("KVARN_CUTLASS_GEMM_CONFIGS", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntunedConfigWarning)
        assert select_config(90, 4096, 128, 128, 128, "f16") == tuned
    with pytest.warns(UntunedConfigWarning, match="untuned"):  # the same table's untuned D=64 bucket
        select_config(90, 4096, 128, 64, 128, "f16")


def test_select_config_warns_untuned_and_falls_back(monkeypatch, tmp_path):
    untuned = [k for k, e in load_table(90)["buckets"].items() if e["status"] == "untuned"]
    M, T, D, out = parse_bucket(untuned[0])
    with pytest.warns(UntunedConfigWarning, match="untuned"):
        cfg = select_config("sm90", M, T, D, 128, out)
    assert cfg == default_config(T, D, out)
    assert bucket_key(3000, 128, 128, "f16") == "M4096_T128_D128_f16"
    assert bucket_key(10, 64, 64, "f32") == "M128_T64_D64_f32"
    assert bucket_key(10 ** 6, 64, 64, "f32") == "M16384_T64_D64_f32"
    monkeypatch.setenv("KVARN_CUTLASS_GEMM_CONFIGS", str(tmp_path))
    with pytest.warns(UntunedConfigWarning, match="no gemm_configs table"):
        cfg = select_config(90, 512, 64, 256, 4, "f32")
    assert cfg.tile_n == 64 and cfg.tile_k == 128 and cfg.out_dtype == "f32"


def test_build_lists_every_table_config_and_the_s32_check():
    """`kvarn-cutlass build` compiles each distinct GEMM config of the table once, and none below sm_90."""
    from kvarn_cutlass.cli.build import _gemm_configs
    from kvarn_cutlass.gemm.config import GemmConfig
    from kvarn_cutlass.gemm.configs import load_table

    table = load_table(90)
    listed = _gemm_configs(90)
    names = [c.name for c in listed]
    assert len(names) == len(set(names))
    for entry in table["buckets"].values():
        assert GemmConfig.from_dict(entry["config"]).name in names
    assert GemmConfig(out_dtype="s32").name in names
    assert _gemm_configs(80) == []


def test_tune_dry_run_sweeps_valid_candidates_and_filters(capsys):
    """`kvarn-cutlass tune --dry-run` lists every valid candidate of a bucket (validated at K = 2D);
    --filter keeps the matching names only."""
    from kvarn_cutlass import cli
    from kvarn_cutlass.gemm.tune import sweep

    bucket = "M4096_T128_D128_f16"
    cands = sweep(bucket)
    assert cands and all(validate_for_problem(c, 4096, 128, gemm_depth(128), 128)[0] for c in cands)
    assert any(c.tile_k == 256 for c in cands)  # valid only because K = 2D = 256
    assert cli.main(["tune", "--dry-run", "--buckets", bucket]) == 0
    full = capsys.readouterr().out
    assert f"{bucket}: {len(cands)} configs" in full
    assert cli.main(["tune", "--dry-run", "--buckets", bucket, "--filter", "_pingpong_"]) == 0
    listed = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")]
    want = [c.name for c in cands if "_pingpong_" in c.name]
    assert want and listed == want
