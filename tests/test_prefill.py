"""Tests of ``kvarn_cutlass.prefill.prefill_attention`` (the chunk attends, then is appended).

References: ``kc.reference.attention(q, cache, layer, k=k, v=v)`` (float64, the cache before the chunk
plus the chunk exactly), itself checked here against dense float64 attention built independently from
the codec's reconstruction. CPU tests run ``impl="torch"`` (the fused kernel's arithmetic in torch);
GPU tests (``-m gpu``) run the fused kernel. Tolerance: 5e-3 norm-wise relative error.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass.prefill import prefill_attention

from _helpers import SHARED, assert_same_snapshot, require_disassembler, snapshot

TOL = 5e-3
MODEL_DIR = SHARED / "models" / "kvarn-ref-lm"
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def outliers(gen, D):
    o = torch.rand(D, generator=gen) * 0.5
    o[torch.randperm(D, generator=gen)[:4]] = 4.0
    return o


def make_chunk(gen, B, Hkv, Hq, n, D, dtype, oc, q_scale, kv_scale=1.0):
    """K with a few outlier channels (what the rotation exists for), V, and queries."""
    k = (torch.randn(B, Hkv, n, D, generator=gen) * (1 + oc) * kv_scale).to(dtype)
    v = (torch.randn(B, Hkv, n, D, generator=gen) * kv_scale).to(dtype)
    q = (torch.randn(B, Hq, n, D, generator=gen) * q_scale * (1 + 0.3 * oc)).to(dtype)
    return q, k, v


def run_chunks(chunks, B=1, Hkv=2, group=4, D=128, window=256, sink=0, dtype=torch.float16, device="cpu",
               impl="torch", q_scale=0.2, kv_scale=1.0, seed=0, preset="k4v2_g128", quantizer="uniform",
               scale_dtype=torch.float16, floor=False, **kw):
    """Prefill ``chunks`` through prefill_attention; returns [(n, tiles before the chunk, error)] (with
    ``floor``: and the error of the reference rounded to the output dtype, what no kernel can beat)."""
    gen = torch.Generator().manual_seed(seed)
    cache = kc.KVarNCache(1, B, Hkv, D, preset=preset, window=window, sink_tokens=sink, dtype=dtype, device=device,
                          quantizer=quantizer, scale_dtype=scale_dtype)
    oc = outliers(gen, D)
    errs = []
    for n in chunks:
        q, k, v = (x.to(device) for x in make_chunk(gen, B, Hkv, Hkv * group, n, D, dtype, oc, q_scale, kv_scale))
        ref = kc.reference.attention(q, cache, 0, kw.get("scale"), k=k, v=v)
        nt = cache.num_tiles(0)
        out = prefill_attention(q, k, v, cache, 0, impl=impl, **kw)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.isfinite(out).all(), (seed, n)
        errs.append((n, nt, rel(out, ref)) if not floor else (n, nt, rel(out, ref), rel(ref.to(dtype), ref)))
    return errs


CASES = [
    ([200], dict()),                                       # context entirely in the window
    ([256, 128, 128], dict()),                             # chunks on tile boundaries
    ([300, 1, 1, 44], dict()),                             # one-token chunks, off boundaries
    ([700, 300], dict()),                                  # chunks longer than the window
    ([300, 200], dict(sink=128, window=128, D=64, group=3, B=2)),  # sink tokens, batch 2, GQA 3
    ([260, 260, 300], dict(dtype=torch.bfloat16)),         # bf16
    ([400, 130], dict(D=256, Hkv=1, group=1)),             # head_dim 256, no GQA
    ([500, 77], dict(group=8, Hkv=1)),                     # GQA 8
    ([384, 100], dict(preset="k4v4_g64", window=128)),
    ([384, 100], dict(preset="k4v2_g64", window=64, scale_dtype=torch.float32)),
    ([300, 333], dict(quantizer="lloyd_max")),
    ([300, 333], dict(quantizer="lloyd_max", preset="k4v4_g128", dtype=torch.bfloat16)),
]


# ---------------------------------------------------------------------------------------------
# the reference's chunk form against an independent float64 construction
@pytest.mark.parametrize("seed", [1, 2])
def test_reference_chunk_form_is_dense_attention(seed):
    """Keys = tiles (codec reconstruction, float64) ++ sink/window ++ the chunk in the cache dtype, causal
    from position seq_len on: built here by hand, against reference.attention(k=, v=)."""
    gen = torch.Generator().manual_seed(seed)
    D, Hkv, G = 64, 2, 2
    cache = kc.KVarNCache(1, 1, Hkv, D, preset="k4v2_g64", window=64, sink_tokens=64, dtype=torch.float16)
    oc = outliers(gen, D)
    q0, k0, v0 = make_chunk(gen, 1, Hkv, Hkv * G, 300, D, torch.float32, oc, 0.3)
    cache.append(0, k0, v0)
    q, k, v = make_chunk(gen, 1, Hkv, Hkv * G, 90, D, torch.float32, oc, 0.3)
    before = snapshot(cache)
    got = kc.reference.attention(q.half(), cache, 0, k=k, v=v)
    assert_same_snapshot(before, snapshot(cache))
    # independent: positions 0..63 sink, 64..(64+nt*64) tiles, then the window, then the chunk
    kt, vt = kc.decode_tiles(cache.tile_bytes(0), cache.spec, torch.float64)  # [1, nt, H, T, D]
    nt = kt.shape[1]
    kt = kt[0].permute(1, 0, 2, 3).reshape(Hkv, nt * 64, D)
    vt = vt[0].permute(1, 0, 2, 3).reshape(Hkv, nt * 64, D)
    sk, sv = (x[0].double() for x in cache.sink_kv(0))
    wk, wv = (x[0].double() for x in cache.window_kv(0))
    keys = torch.cat((sk, kt, wk, k[0].half().double()), 1)
    vals = torch.cat((sv, vt, wv, v[0].half().double()), 1)
    L = cache.seq_len(0)
    assert keys.shape[1] == L + 90
    keys, vals = keys.repeat_interleave(G, 0), vals.repeat_interleave(G, 0)
    s = q[0].half().double() @ keys.transpose(1, 2) / math.sqrt(D)
    qpos = torch.arange(L, L + 90)
    s = s.masked_fill(torch.arange(L + 90)[None, :] > qpos[:, None], float("-inf"))
    want = torch.softmax(s, -1) @ vals
    assert rel(got[0], want) < 1e-9, seed


def test_reference_chunk_form_differs_from_appending_first():
    """The old semantics (append, then attend as the newest tokens) reads the chunk's own early tokens
    quantized once the chunk is longer than the window: the two forms differ, and only in that case."""
    gen = torch.Generator().manual_seed(3)
    D = 128
    for n, differs in ((100, False), (600, True)):
        cache = kc.KVarNCache(1, 1, 1, D, window=256, dtype=torch.float16)
        q, k, v = make_chunk(gen, 1, 1, 2, n, D, torch.float16, outliers(gen, D), 0.5)
        chunk = kc.reference.attention(q, cache, 0, k=k, v=v)
        cache.append(0, k, v)
        after = kc.reference.attention(q, cache, 0)
        assert (rel(after, chunk) > 1e-3) == differs, (n, rel(after, chunk))


# ---------------------------------------------------------------------------------------------
# CPU: validation, state, the torch path
def _cache_with(n=10, D=64, device="cpu"):
    c = kc.KVarNCache(1, 1, 2, D, window=128, dtype=torch.float16, device=device)
    gen = torch.Generator().manual_seed(0)
    c.append(0, torch.randn(1, 2, n, D, generator=gen).half().to(device), torch.randn(1, 2, n, D, generator=gen).half().to(device))
    return c


def test_validation_names_the_argument_and_changes_nothing():
    c = _cache_with()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 64, generator=gen).half()
    k = torch.randn(1, 2, 6, 64, generator=gen).half()
    v = torch.randn(1, 2, 6, 64, generator=gen).half()
    before = snapshot(c)
    bad = [
        (dict(q=q.float()), TypeError, r"q has dtype torch.float32; this entry point takes \[torch.float16, torch.bfloat16\]"),
        (dict(cache="cache"), TypeError, "cache must be a KVarNCache"),
        (dict(q=q[:, :, :5]), ValueError, r"q must have shape .*n_q=6 \(a chunk of 6 tokens \(k, v\)\).*got \[1, 4, 5, 64\]"),
        (dict(q=torch.randn(1, 3, 6, 64).half()), ValueError, "num_q_heads"),
        (dict(k=k[:, :1]), ValueError, "k must have shape"),
        (dict(v=v[:, :, :5]), ValueError, "k and v must have the same shape"),
        (dict(k=k.int()), TypeError, "k has dtype"),
        (dict(layer=1), ValueError, "layer"),
        (dict(impl="nope"), ValueError, "impl"),
        (dict(impl="gpu"), ValueError, "CUDA"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(scale=0.0), ValueError, "scale"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(out=torch.empty(1, 4, 6, 64)), ValueError, "out"),
    ]
    for over, exc, msg in bad:
        args = dict(q=q, k=k, v=v, cache=c, layer=0) | over
        with pytest.raises(exc, match=msg):
            prefill_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cache"), args.pop("layer"), **args)
    after = snapshot(c)
    assert_same_snapshot(before, after)


def test_nan_chunk_raises_and_leaves_the_cache():
    c = _cache_with(300)
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_chunk(gen, 1, 2, 4, 40, 64, torch.float16, outliers(gen, 64), 0.3)
    k[0, 1, 7, 3] = float("nan")
    before = snapshot(c)
    with pytest.raises(ValueError, match="NaN"):
        prefill_attention(q, k, v, c, 0)
    assert_same_snapshot(before, snapshot(c))


@pytest.mark.parametrize("chunks,kw", CASES)
def test_cpu_torch_path(chunks, kw):
    errs = run_chunks(chunks, **kw)
    for n, nt, e in errs:
        assert e < TOL, (chunks, kw, n, nt, e)
    if sum(chunks) > 384:
        assert any(nt > 0 for _, nt, _ in errs)  # the tile part was exercised


def test_cpu_largest_chunk():
    for n, nt, e in run_chunks([4096, 8192], D=64, Hkv=1, group=1, preset="k4v2_g64", window=128, seed=4):
        assert e < TOL, (n, nt, e)


def test_append_flag_and_tiles_match_plain_appends():
    """append=True leaves exactly what cache.append leaves (tile bytes, window, sink); append=False leaves
    the cache untouched; both return the same attention."""
    gen = torch.Generator().manual_seed(5)
    D = 64
    a = kc.KVarNCache(1, 1, 2, D, preset="k4v2_g64", window=64, sink_tokens=64, dtype=torch.float16)
    b = kc.KVarNCache(1, 1, 2, D, preset="k4v2_g64", window=64, sink_tokens=64, dtype=torch.float16)
    oc = outliers(gen, D)
    for n in (30, 100, 1, 257):
        q, k, v = make_chunk(gen, 1, 2, 4, n, D, torch.float16, oc, 0.3)
        before = snapshot(b)
        o_keep = prefill_attention(q, k, v, b, 0, append=False)
        assert_same_snapshot(before, snapshot(b))
        o = prefill_attention(q, k, v, a, 0)
        b.append(0, k, v)
        assert torch.equal(o, o_keep)
        assert_same_snapshot(snapshot(a), snapshot(b))


def test_poisoned_out_and_strided_inputs():
    """out= is fully written; q, k, v as transposed views ([B, n, H, D] storage, as transformers makes them)."""
    gen = torch.Generator().manual_seed(6)
    c = _cache_with(500, D=128)
    n = 70
    qs = torch.randn(1, n, 4, 128, generator=gen).half() * 0.3
    ks = torch.randn(1, n, 2, 128, generator=gen).half()
    vs = torch.randn(1, n, 2, 128, generator=gen).half()
    q, k, v = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    ref = kc.reference.attention(q, c, 0, k=k, v=v)
    out = torch.full((1, 4, n, 128), float("nan"), dtype=torch.float16)
    res = prefill_attention(q, k, v, c, 0, out=out)
    assert res is out and torch.isfinite(out).all()
    assert rel(out, ref) < TOL


ADVERSARIAL = dict(
    large_logits=dict(q_scale=200),            # logits ~300 (score dot products ~4e3)
    tiny_values=dict(kv_scale=1e-5),           # f16-subnormal K/V (the f16 output itself then rounds)
    huge_bf16=dict(kv_scale=1e12, q_scale=1e-10, dtype=torch.bfloat16, scale_dtype=torch.float32),  # K/V ~1e12
)


def check_constant_tiles(**prefill_kw) -> None:
    """A chunk over two constant tiles (K 0.5, V -2: zero-variance axes everywhere) within TOL of the reference
    and finite, through prefill_attention with ``prefill_kw``."""
    gen = torch.Generator().manual_seed(7)
    cache = kc.KVarNCache(1, 1, 1, 128, window=128, dtype=torch.float16)
    cache.append(0, torch.full((1, 1, 384, 128), 0.5).half(), torch.full((1, 1, 384, 128), -2.0).half())
    q, k, v = make_chunk(gen, 1, 1, 2, 50, 128, torch.float16, outliers(gen, 128), 0.3)
    ref = kc.reference.attention(q, cache, 0, k=k, v=v)
    out = prefill_attention(q, k, v, cache, 0, **prefill_kw)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL


@pytest.mark.parametrize("case", [*ADVERSARIAL, "constant_tiles"])
def test_cpu_adversarial(case):
    """Within TOL of the reference (plus what rounding the reference to the output dtype costs) where f16
    operands would overflow or underflow without the per-tile and per-row power-of-two ranges."""
    kw = ADVERSARIAL.get(case, {})
    if case == "constant_tiles":
        check_constant_tiles()
        return
    for n, nt, e, e_out in run_chunks([600, 200], seed=8, floor=True, **kw):
        assert e < TOL + e_out, (case, n, nt, e, e_out)


# ---------------------------------------------------------------------------------------------
# the kernel's sources: default variants compile (sm_90: with no register spills) and fit shared memory
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_fused_kernel_compiles(arch):
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.ops.prefill import DEFAULT_CONFIGS, MAX_SMEM_PER_BLOCK, fused_spec, smem_bytes
    from kvarn_cutlass.runtime.spec import build

    variants = [
        (kc.TileSpec("k4v2_g128", 128), torch.float16),
        (kc.TileSpec("k4v2_g128", 128, quantizer="lloyd_max"), torch.bfloat16),
        (kc.TileSpec("k4v4_g64", 64, torch.float32), torch.float16),
        (kc.TileSpec("k4v4_g128", 256, torch.float32, quantizer="lloyd_max"), torch.bfloat16),
        (kc.TileSpec("k4v2_g64", 256), torch.float16),
    ]
    for spec, dt in variants:
        ks = fused_spec(spec, dt, dt, DEFAULT_CONFIGS[spec.head_dim])
        m = build(ks, arch)
        res = m.resources["kvarn_prefill_fused"]
        if arch == "sm_90":  # the measured target; sm_80 builds (never run) may spill a few bytes
            assert res.spill_store_bytes in (0, None) and res.stack_bytes == 0, (ks.name, res)
        smem = smem_bytes(m.cubin)
        assert 0 < smem <= MAX_SMEM_PER_BLOCK, (ks.name, smem)


def test_fused_kernel_lets_its_dependents_launch_as_it_starts():
    """The fused kernel executes griddepcontrol.launch_dependents (SASS PREEXIT) among its first instructions on
    sm_90, before any load, so that the append's programmatic launch can take the SMs its grid leaves idle; it
    never waits for a previous kernel itself (no ACQBULK: it is launched plainly). The sm_80 build has neither."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.cli.sass import disassemble, kernel_opcodes
    from kvarn_cutlass.ops.prefill import DEFAULT_CONFIGS, fused_spec
    from kvarn_cutlass.runtime.spec import build

    require_disassembler()
    for D in (128, 256):
        ks = fused_spec(kc.TileSpec("k4v2_g128", D), torch.float16, torch.float16, DEFAULT_CONFIGS[D])
        for arch, has in (("sm_90", True), ("sm_80", False)):
            ops = kernel_opcodes(disassemble(build(ks, arch).cubin), "kvarn_prefill_fused")
            assert ("PREEXIT" in ops) == has and "ACQBULK" not in ops, (D, arch)
            if has:
                first = ops.index("PREEXIT")
                loads = [o for o in ops[:first] if o.startswith(("LDG", "LDS", "LD.", "LDSM", "ATOM", "RED", "LDGSTS"))]
                assert not loads and first < 16, (D, ops[:first + 1])


@pytest.mark.parametrize("D,preset,scale_dtype,quantizer,dtype", [
    (128, "k4v2_g128", torch.float16, "uniform", torch.float16),
    (128, "k4v4_g128", torch.float32, "lloyd_max", torch.bfloat16),
    (64, "k4v2_g64", torch.float16, "uniform", torch.bfloat16),
])
def test_wgmma_variant_compiles_for_sm90a(D, preset, scale_dtype, quantizer, dtype):
    """The wgmma configs build for sm_90a (CuTe's GMMA atoms: the source refuses any other target) with no
    register spills (512-thread configs, whose warpgroups trade registers by setmaxnreg: at most 128 bytes of
    producer state), and are refused where they cannot run."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.ops.prefill import CANDIDATES, fused_spec
    from kvarn_cutlass.runtime.errors import CompileError
    from kvarn_cutlass.runtime.spec import build

    spec = kc.TileSpec(preset, D, scale_dtype, quantizer=quantizer)
    wg = [c for c in CANDIDATES if c.mma == "wgmma" and c.fits(D, spec.tile_tokens)]
    # six with Q in shared memory; Q in registers: two consumer warpgroups, at D=128 one producer warpgroup only
    assert sorted(c.name for c in wg if c.q_operand == "regs") == (
        ["r16c8n64wgrq"] if D == 128 else ["r16c8n64g2p8wgrq", "r16c8n64p8wgrq", "r16c8n64wgrq"])
    assert len(wg) == 6 + (1 if D == 128 else 3)
    for cfg in wg:
        assert cfg.supported_on(90) and not cfg.supported_on(80) and not cfg.supported_on(100)
        m = build(fused_spec(spec, dtype, dtype, cfg), "sm_90")
        assert m.target == "sm_90a"
        res = m.resources["kvarn_prefill_fused"]
        # Q in registers: no spills at all (a spilled fragment would be reloaded inside the MMA sequence).
        # 512 threads: producer loop state, read a few times a tile. r16c8n64g2p8wg spills 12 bytes with the
        # GPU machine's NVRTC 13.0.88 (what docs/perf-notes.md measured, "Fused prefill v3e") and 84-132 with
        # 13.5, whose cost is not measured yet; over 128 bytes would be a new problem
        limit = 128 if cfg.threads == 512 and cfg.q_operand == "smem" else 0
        assert (res.spill_store_bytes or 0) <= limit and res.stack_bytes <= limit, (cfg, res)
        if cfg.q_operand == "regs" and D == 128:  # the register trade's pool: 384 x 168 at launch
            assert cfg.threads == 384 and res.registers == 168, (cfg, res)
    with pytest.raises(CompileError, match="sm_90a"):
        build(fused_spec(spec, dtype, dtype, wg[0]), "sm_80")
    # at head_dim 256 only the 64-token config with two consumer warpgroups and one producer warpgroup
    assert [c.name for c in wg if c.fits(256, 128)] == ["r16c8n64wg"]


def test_q_in_registers_config():
    """q_operand="regs": a wgmma-only option named by the suffix rq, emitted as Q_REGS=1; refused for mma.sync,
    head_dim 256 and, at D=128, two producer warpgroups. Its score wgmmas are RS (register A, 8 a tile block at
    D=128) and the rest of the SASS has the form of the shared-memory config's: the same HGMMA counts, no
    local memory."""
    pytest.importorskip("cuda.bindings")
    import re

    from kvarn_cutlass.cli.sass import disassemble, find_tool
    from kvarn_cutlass.ops.prefill import FusedConfig, fused_spec
    from kvarn_cutlass.runtime.spec import build

    cfg = FusedConfig.from_name("r16c8n64wgrq")
    assert cfg == FusedConfig(16, 64, 8, mma="wgmma", q_operand="regs") and cfg.name == "r16c8n64wgrq"
    assert FusedConfig.from_name("r16c8n64g2p8wgrq").producer_groups == 2
    with pytest.raises(ValueError, match="q_operand"):
        FusedConfig(16, 64, 8, mma="wgmma", q_operand="registers")
    assert not FusedConfig(16, 64, 4, q_operand="regs").fits(128, 128)          # mma.sync
    assert not FusedConfig(16, 32, 8, mma="wgmma", q_operand="regs").fits(256, 128)
    assert not FusedConfig(16, 64, 8, mma="wgmma", producer_warps=8, q_operand="regs").fits(128, 128)
    assert FusedConfig(16, 64, 8, mma="wgmma", producer_warps=8, q_operand="regs").fits(64, 128)
    spec = kc.TileSpec("k4v2_g128", 128)
    ks = fused_spec(spec, torch.float16, torch.float16, cfg)
    assert dict(ks.defines)["Q_REGS"] == "1"
    assert "Q_REGS" not in dict(fused_spec(spec, torch.float16, torch.float16, FusedConfig(16, 64, 8, mma="wgmma")).defines)
    if find_tool("cuobjdump") is None and find_tool("nvdisasm") is None:
        pytest.skip("no disassembler")
    sass = {}
    for q_operand in ("smem", "regs"):
        c = FusedConfig(16, 64, 8, mma="wgmma", q_operand=q_operand)
        m = build(fused_spec(spec, torch.float16, torch.float16, c), "sm_90")
        sass[q_operand] = [ln.split(";")[0] for ln in disassemble(m.cubin).splitlines()
                           if re.search(r"\b(HGMMA|LDL|STL)\b", ln)]
    count = lambda q_operand, pattern: sum(bool(re.search(pattern, ln)) for ln in sass[q_operand])
    rs_tile = r"HGMMA\.64x64x16\.F32 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB"  # register A, MN-major tile K
    ss_tile = r"HGMMA\.64x64x16\.F32 R\d+, gdesc\[UR\d+\]\.tnspB"
    for q_operand in ("smem", "regs"):
        assert count(q_operand, r"\b(LDL|STL)\b") == 0, q_operand
    # the tile scores' two turn sequences (with and without a pending P . V), 8 k-steps each; the exact ones SS
    assert (count("regs", rs_tile), count("regs", ss_tile)) == (16, 0)
    assert (count("smem", rs_tile), count("smem", ss_tile)) == (0, 16)
    for shape in ("64x64x16", "64x128x16"):
        assert count("regs", f"HGMMA.{shape}") == count("smem", f"HGMMA.{shape}") == (32 if shape == "64x64x16" else 20)


@pytest.mark.parametrize("preset,scale_dtype,quantizer,dtype", [
    ("k4v2_g128", torch.float16, "uniform", torch.float16),     # the bench's bucket: two record slots
    ("k4v4_g128", torch.float32, "uniform", torch.float16),     # 37 KB records: one record slot
    ("k4v2_g128", torch.float32, "lloyd_max", torch.float16),   # the most shared memory, 231,040 bytes
    ("k4v2_g64", torch.float16, "uniform", torch.bfloat16),     # 64-token tiles: two blocks a tile
])
def test_wgmma_d256_variant_compiles_for_sm90a(preset, scale_dtype, quantizer, dtype):
    """The head_dim 256 wgmma configs (one producer warpgroup; 32-token blocks, or 64 with two consumer warpgroups)
    build for sm_90a with no register spills. With two consumer warpgroups the roles trade registers (200 a
    consumer thread and 104 a producer thread at 32-token blocks, 208 and 88 at 64, from the pool of the 168 each
    of 384 threads holds at launch): the module must launch with 168, or the consumers' setmaxnreg.inc would wait
    for registers the pool never gets. The 32-token configs fit shared memory for every record; the 64-token one
    (two 64 KB stages) for the bench's bucket, and not beside 4-bit V records of 128-token tiles, which the
    kernel's load refuses."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.ops.prefill import CANDIDATES, MAX_SMEM_PER_BLOCK, fused_spec, smem_bytes
    from kvarn_cutlass.runtime.spec import build

    spec = kc.TileSpec(preset, 256, scale_dtype, quantizer=quantizer)
    wg = [c for c in CANDIDATES if c.mma == "wgmma" and c.fits(256, spec.tile_tokens)]
    assert sorted(c.name for c in wg) == ["r16c4n32wg", "r16c8n32wg", "r16c8n64wg"]
    if preset != "k4v2_g128" or scale_dtype != torch.float16:  # the single consumer warpgroup: the bench's bucket
        wg = [c for c in wg if c.consumer_warps == 8]
    for cfg in wg:
        m = build(fused_spec(spec, dtype, dtype, cfg), "sm_90")
        assert m.target == "sm_90a"
        res = m.resources["kvarn_prefill_fused"]
        assert res.spill_store_bytes == 0 and res.stack_bytes == 0, (cfg, res)
        if cfg.threads == 384:
            assert res.registers == 168, (cfg, res)
        smem = smem_bytes(m.cubin)
        if cfg.block_n == 32 or (preset, scale_dtype, quantizer) == ("k4v2_g128", torch.float16, "uniform"):
            assert smem <= MAX_SMEM_PER_BLOCK, (cfg, smem)  # every record; the 64-token one: the bench's bucket
        elif preset == "k4v4_g128":
            assert smem > MAX_SMEM_PER_BLOCK, (cfg, smem)  # 4-bit V records beside two 64 KB stages: refused


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_aligned_rows_returns_kernel_ready_views(dtype):
    """_aligned_rows: the same tensor when its rows are 16-byte aligned with unit channel stride, else a copy that
    is; the values are unchanged either way (views that offset, slice or transpose the rows)."""
    from kvarn_cutlass.prefill import _aligned_rows

    g = torch.Generator().manual_seed(5)
    base = torch.randn(2, 3, 40, 136, generator=g).to(dtype)
    es = base.element_size()
    views = [base[..., :128], base[..., 1:129], base[:, :, 3:35, :128], base.transpose(1, 2)[..., :64],
             base[..., :128].transpose(-1, -2).contiguous().transpose(-1, -2), base.flatten()[8:8 + 2 * 3 * 40 * 128].view(2, 3, 40, 128)]
    for x in views:
        y = _aligned_rows(x)
        ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(st * es % 16 == 0 for st in x.stride()[:-1])
        assert (y is x) == ok
        assert y.stride(-1) == 1 and y.data_ptr() % 16 == 0 and all(st * es % 16 == 0 for st in y.stride()[:-1])
        assert torch.equal(y, x)


def test_get_kernel_resolves_once_per_arguments(monkeypatch):
    """get_kernel resolves the device's arch and the tuned config once per (arguments, table override): later
    calls return the same kernel without asking again; a new $KVARN_CUTLASS_GEMM_CONFIGS, another config or a
    cleared kernel cache resolves again."""
    from kvarn_cutlass.ops import prefill as OP
    from kvarn_cutlass.runtime import arch as arch_mod
    from kvarn_cutlass.runtime.configs import CONFIG_ENV

    asked = []
    monkeypatch.setattr(arch_mod, "device_arch", lambda index: asked.append(("arch", index)) or 90)
    monkeypatch.setattr(OP, "select_config", lambda spec, arch: asked.append(("config", arch)) or OP.DEFAULT_CONFIGS[128])
    monkeypatch.setattr(OP, "FusedPrefillKernel", lambda spec, cd, qd, cfg, dev: ("kernel", spec, cd, qd, cfg, dev.index))
    monkeypatch.setattr(OP, "_kernels", {})
    monkeypatch.setattr(OP, "_resolved", {})
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    spec, dev = kc.TileSpec(), torch.device("cuda", 0)
    first = OP.get_kernel(spec, torch.float16, torch.float16, dev)
    assert first == ("kernel", spec, torch.float16, torch.float16, OP.DEFAULT_CONFIGS[128], 0)
    assert asked == [("arch", 0), ("config", "sm90")]
    assert all(OP.get_kernel(spec, torch.float16, torch.float16, dev) is first for _ in range(3))
    assert len(asked) == 2
    monkeypatch.setenv(CONFIG_ENV, "/elsewhere")
    assert OP.get_kernel(spec, torch.float16, torch.float16, dev) is first  # same config: the loaded kernel
    assert asked[2:] == [("arch", 0), ("config", "sm90")]
    other = OP.FusedConfig.from_name("r16c4n32")
    assert OP.get_kernel(spec, torch.float16, torch.float16, dev, other)[4] == other
    assert asked[4:] == [("arch", 0)]
    OP._kernels.clear()  # e.g. tools/prefill_variants.py after swapping the kernel source
    again = OP.get_kernel(spec, torch.float16, torch.float16, dev)
    assert again == first and again is not first and asked[5:] == [("arch", 0), ("config", "sm90")]


def test_every_candidate_fits_shared_memory_for_its_buckets():
    """Shared memory of the largest record (k4v4, f32 scales) for each candidate config that fits a head_dim:
    read from the compiled module, as the launcher does."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.ops.prefill import CANDIDATES, MAX_SMEM_PER_BLOCK, fused_spec, smem_bytes
    from kvarn_cutlass.runtime.spec import build

    for D in (128, 256):
        spec = kc.TileSpec("k4v4_g128", D, torch.float32)
        for cfg in CANDIDATES:
            if cfg.fits(D, 128) and cfg.rows_per_warp == 16 and cfg.block_n == (32 if D == 256 else 64):
                smem = smem_bytes(build(fused_spec(spec, torch.float16, torch.float16, cfg), "sm_90").cubin)
                assert smem <= MAX_SMEM_PER_BLOCK, (D, cfg, smem)


# ---------------------------------------------------------------------------------------------
# real model Q/K/V
def capture_qkv(n_tokens=640, device="cpu", seed=0):
    """Post-RoPE q, k, v per layer from ``kvarn-ref-lm`` on random token ids: list of (q, k, v)."""
    transformers = pytest.importorskip("transformers")
    if not MODEL_DIR.is_dir():
        pytest.skip(f"{MODEL_DIR} is absent (set KVARN_SHARED_DIR)")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).to(device).eval()
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, n_tokens), generator=gen).to(device)
    captured = {}

    def hook(idx):
        def fn(mod, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shp = (*h.shape[:-1], -1, mod.head_dim)
            q = mod.q_norm(mod.q_proj(h).view(shp)).transpose(1, 2)
            k = mod.k_norm(mod.k_proj(h).view(shp)).transpose(1, 2)
            v = mod.v_proj(h).view(shp).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            captured[idx] = (q.detach(), k.detach(), v.detach())
        return fn

    hs = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    return [captured[i] for i in range(len(model.model.layers))], model.config


def _real_model_errors(layers, cfg, chunks, device, impl, layer_ids):
    errs = []
    for li in layer_ids:
        q, k, v = (x.half().to(device) for x in layers[li])
        cache = kc.KVarNCache(1, 1, cfg.num_key_value_heads, cfg.head_dim, window=256, dtype=torch.float16, device=device)
        start = 0
        for n in chunks:
            sl = slice(start, start + n)
            ref = kc.reference.attention(q[:, :, sl], cache, 0, k=k[:, :, sl], v=v[:, :, sl])
            out = prefill_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], cache, 0, impl=impl)
            errs.append((li, n, rel(out, ref)))
            start += n
    return errs


def test_cpu_real_model_qkv():
    layers, cfg = capture_qkv(640)
    errs = _real_model_errors(layers, cfg, (300, 340), "cpu", "torch", (0, len(layers) - 1))
    assert max(e for *_, e in errs) < TOL, errs


# ---------------------------------------------------------------------------------------------
# GPU: the fused kernel
def _gpu_skip():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")


GPU_CASES = CASES + [
    ([2048, 2048], dict(Hkv=2, group=4)),
    ([8192], dict(Hkv=1, group=4)),                      # 32768 query rows per KV head
    ([3000, 1000], dict(D=256, Hkv=2, group=2, quantizer="lloyd_max")),
    ([1000, 24], dict(D=64, group=8, Hkv=2, dtype=torch.bfloat16, preset="k4v4_g64", window=128)),
]


@gpu
@pytest.mark.parametrize("chunks,kw", GPU_CASES)
def test_gpu(chunks, kw):
    _gpu_skip()
    for n, nt, e in run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks), **kw):
        assert e < TOL, (chunks, kw, n, nt, e)


# chunks after a context of at least 8 tiles whose grids fill at most half the SMs: the split-tile mode
SPLIT_CASES = [
    ([2600, 100, 1, 37], dict()),
    ([2600, 50], dict(D=256, Hkv=1, group=2)),
    ([2000, 90, 5], dict(D=64, sink=128, window=128, dtype=torch.bfloat16, group=3)),
    ([1500, 40, 200], dict(preset="k4v4_g64", window=128, quantizer="lloyd_max", scale_dtype=torch.float32)),
    ([2600, 16], dict(group=8, Hkv=1)),
]


@gpu
@pytest.mark.parametrize("chunks,kw", SPLIT_CASES)
@pytest.mark.parametrize("split", ["1", "0"])
def test_gpu_split_tiles(monkeypatch, chunks, kw, split):
    """Split tiles (the default, $KVARN_PREFILL_SPLIT=1): a chunk whose grid leaves SMs idle splits its tiles over
    CTAs (the last split also takes the exact phase) and merges them (kvarn_prefill_merge), against the
    reference: both quantizers, bf16, f32 scales, sink tokens, GQA 3 and 8, head_dim 64/128/256, 64-token tiles;
    and the same chunks unsplit ($KVARN_PREFILL_SPLIT=0)."""
    _gpu_skip()
    from kvarn_cutlass.ops import prefill as OP

    monkeypatch.setattr(OP, "_kernels", {})  # kernels read the knob when loaded
    monkeypatch.setenv(OP.SPLIT_ENV, split)
    for n, nt, e in run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks) + 11, **kw):
        assert e < TOL, (chunks, kw, n, nt, e)
    was_split = any(k.split and k._ws.numel() > 0 for k in OP._kernels.values())
    assert was_split == (split == "1"), "a chunk was split" if was_split else "no chunk was split"


@gpu
@pytest.mark.parametrize("chunks,kw", [c for c in GPU_CASES if sum(c[0]) >= 500])
def test_gpu_row_order(monkeypatch, chunks, kw):
    """$KVARN_PREFILL_ORDER=rows (blocks of folded rows in order, where the default launches each head's token
    blocks, the chunk's last first): the same shapes as test_gpu against the reference."""
    _gpu_skip()
    from kvarn_cutlass.ops import prefill as OP

    monkeypatch.setattr(OP, "_kernels", {})  # kernels read the order when loaded
    monkeypatch.setenv(OP.ORDER_ENV, "rows")
    for n, nt, e in run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks) + 7, **kw):
        assert e < TOL, (chunks, kw, n, nt, e)
    assert all(k.order == "rows" for k in OP._kernels.values())


@gpu
@pytest.mark.parametrize("chunks,kw", [c for c in GPU_CASES if c[1].get("D", 128) != 256])
@pytest.mark.parametrize("consumer_warps,producer_warps,q_operand",
                         [(4, 4, "smem"), (8, 4, "smem"), (8, 8, "smem"), (8, 4, "regs"), (8, 8, "regs")])
def test_gpu_wgmma(chunks, kw, consumer_warps, producer_warps, q_operand):
    """The wgmma configs (sm_90 only) on every shape they take: both phases, ragged row blocks, GQA 1..8,
    bf16, both quantizers, f32 scales, sink tokens; Q in shared memory or, for the tile phase, in registers
    (two producer warpgroups with it at D=64 only)."""
    _gpu_skip()
    from kvarn_cutlass.ops.prefill import FusedConfig
    from kvarn_cutlass.runtime.arch import device_arch

    cfg = FusedConfig(16, 64, consumer_warps, mma="wgmma", producer_warps=producer_warps, q_operand=q_operand)
    if not cfg.supported_on(device_arch()):
        pytest.skip("wgmma needs sm_90")
    if not cfg.fits(kw.get("D", 128), kc.TileSpec(kw.get("preset", "k4v2_g128"), kw.get("D", 128)).tile_tokens):
        pytest.skip(f"{cfg.name} does not take head_dim {kw.get('D', 128)}")
    for n, nt, e in run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks) + 100, config=cfg, **kw):
        assert e < TOL, (chunks, kw, n, nt, e)


# head_dim 256 shapes for its wgmma configs: both phases, ragged row blocks, GQA, bf16, both quantizers, f32 scales
# and one record slot (k4v4), 64-token tiles, sink tokens
D256_GPU_CASES = [c for c in GPU_CASES if c[1].get("D") == 256] + [
    ([700, 300], dict(D=256, Hkv=2, group=4)),
    ([600, 333], dict(D=256, Hkv=1, group=3, dtype=torch.bfloat16, preset="k4v4_g128", scale_dtype=torch.float32)),
    ([500, 200], dict(D=256, sink=128, window=128, preset="k4v2_g64", quantizer="lloyd_max", B=2, group=2)),
]


@gpu
@pytest.mark.parametrize("chunks,kw", D256_GPU_CASES)
@pytest.mark.parametrize("consumer_warps,block_n", [(4, 32), (8, 32), (8, 64)])
def test_gpu_wgmma_d256(chunks, kw, consumer_warps, block_n):
    """The head_dim 256 wgmma configs (sm_90 only; N=256 P.V, with 8 consumer warps the register trade; 32-token
    blocks in three stages, or 64-token ones in two) against the float64 reference. Where the 64-token
    config's layout exceeds shared memory (4-bit V records of 128-token tiles, or float32 scales with Lloyd-Max),
    its load refuses, naming the bytes."""
    _gpu_skip()
    from kvarn_cutlass.ops.prefill import MAX_SMEM_PER_BLOCK, FusedConfig, fused_spec, smem_bytes
    from kvarn_cutlass.runtime.arch import device_arch
    from kvarn_cutlass.runtime.spec import build

    cfg = FusedConfig(16, block_n, consumer_warps, mma="wgmma")
    if not cfg.supported_on(device_arch()):
        pytest.skip("wgmma needs sm_90")
    spec = kc.TileSpec(kw.get("preset", "k4v2_g128"), 256, kw.get("scale_dtype", torch.float16),
                       quantizer=kw.get("quantizer", "uniform"))
    dtype = kw.get("dtype", torch.float16)
    if smem_bytes(build(fused_spec(spec, dtype, dtype, cfg), "sm_90").cubin) > MAX_SMEM_PER_BLOCK:
        assert block_n == 64, cfg  # the layout the launcher reads: only the two 64 KB stages can exceed it
        with pytest.raises(ValueError, match="bytes of shared memory"):
            run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks) + 200, config=cfg, **kw)
        return
    for n, nt, e in run_chunks(chunks, device="cuda", impl="gpu", seed=len(chunks) + 200, config=cfg, **kw):
        assert e < TOL, (chunks, kw, n, nt, e)


def kernel_and_mirror_errors(seed: int, D: int, n: int, config=None, strided: bool = False) -> tuple[float, float, float]:
    """Relative errors (kernel vs the float64 reference, torch path vs the reference, kernel vs torch path) of
    one n-token chunk over a 2000-token history (1 sequence, 2 KV heads, 8 query heads, fp16, window 256) on the
    GPU, with ``config`` for both paths (the torch path takes its k_operand); the kernel writes a NaN-poisoned
    ``out=`` (checked finite); ``strided``: the chunk's tensors are transposed views."""
    gen = torch.Generator().manual_seed(seed)
    c = kc.KVarNCache(1, 1, 2, D, window=256, dtype=torch.float16, device="cuda")
    oc = outliers(gen, D)
    _, k0, v0 = make_chunk(gen, 1, 2, 8, 2000, D, torch.float16, oc, 0.35)
    c.append(0, k0.cuda(), v0.cuda())
    q, k, v = make_chunk(gen, 1, 2, 8, n, D, torch.float16, oc, 0.35)
    if strided:
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    ref = kc.reference.attention(q, c, 0, k=k, v=v)
    out = torch.full((1, 8, n, D), float("nan"), dtype=torch.float16, device="cuda")
    prefill_attention(q, k, v, c, 0, out=out, append=False, config=config)
    assert torch.isfinite(out).all()
    emu = prefill_attention(q, k, v, c, 0, impl="torch", append=False, config=config)
    return rel(out, ref), rel(emu, ref), rel(out, emu.double())


@gpu
@pytest.mark.parametrize("consumer_warps", [4, 8])
def test_gpu_wgmma_d256_matches_torch_path(consumer_warps):
    """The head_dim 256 wgmma kernel and the torch path (the kernel's operand roundings) agree more closely
    than either agrees with the reference."""
    _gpu_skip()
    from kvarn_cutlass.ops.prefill import FusedConfig
    from kvarn_cutlass.runtime.arch import device_arch

    cfg = FusedConfig(16, 32, consumer_warps, mma="wgmma")
    if not cfg.supported_on(device_arch()):
        pytest.skip("wgmma needs sm_90")
    e_gpu, e_emu, e_both = kernel_and_mirror_errors(22, 256, 600, cfg)
    assert e_gpu < TOL and e_both < max(e_gpu, e_emu), (cfg, e_gpu, e_emu, e_both)


@gpu
@pytest.mark.parametrize("D,name", [(128, "r16c8n64wgrq"), (64, "r16c8n64g2p8wgrq")])
def test_gpu_wgmma_regq_matches_torch_path(D, name):
    """Q in registers (RS score wgmma in the tile phase) computes the same products as the shared-memory
    operand: the kernel and the torch path agree more closely than either agrees with the reference."""
    _gpu_skip()
    from kvarn_cutlass.ops.prefill import FusedConfig
    from kvarn_cutlass.runtime.arch import device_arch

    cfg = FusedConfig.from_name(name)
    if not cfg.supported_on(device_arch()):
        pytest.skip("wgmma needs sm_90")
    e_gpu, e_emu, e_both = kernel_and_mirror_errors(23, D, 700, cfg)
    assert e_gpu < TOL and e_both < max(e_gpu, e_emu), (cfg, e_gpu, e_emu, e_both)


@gpu
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_gpu_adversarial(case):
    _gpu_skip()
    for n, nt, e, e_out in run_chunks([600, 900], device="cuda", impl="gpu", seed=9, floor=True, **ADVERSARIAL[case]):
        assert e < TOL + e_out, (case, n, nt, e, e_out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_extreme_logits_stay_finite(device):
    """Logits of ~1e4..1e5 (scale=1e4, or queries of ~1e3): f16 scores would overflow to inf and NaN; here the
    scores stay f32 and the output stays finite and near the reference. (Accuracy at such logits is bounded by
    the f16 rounding of the MMA operands: an absolute score error of ~1e-4 of the logit, see docs/perf-notes.md.)"""
    if device == "cuda":
        _gpu_skip()
    impl = "gpu" if device == "cuda" else "torch"
    for kw in (dict(q_scale=2e3), dict(scale=1e4)):
        for n, nt, e in run_chunks([600, 300], device=device, impl=impl, seed=13, **kw):
            assert e < 0.05, (kw, n, nt, e)


@gpu
def test_gpu_matches_torch_path_poisoned_strided():
    """The kernel and the torch path on the same inputs agree more closely than either agrees with the
    reference (same operand roundings); out= poisoned; transposed-view inputs."""
    _gpu_skip()
    e_gpu, e_emu, e_both = kernel_and_mirror_errors(10, 128, 900, strided=True)
    assert e_gpu < TOL and e_both < max(e_gpu, e_emu), (e_gpu, e_emu, e_both)


@gpu
def test_gpu_launches_reuse_no_stale_argument():
    """A kernel's later launches rewrite every argument of its prepared launch: two caches of the same
    variant (other pools, tables, windows, lengths) and chunks of other sizes and strides, interleaved,
    each against the reference."""
    _gpu_skip()
    gen = torch.Generator().manual_seed(21)
    D = 128
    caches = [kc.KVarNCache(1, 1, 2, D, window=256, dtype=torch.float16, device="cuda") for _ in range(2)]
    oc = outliers(gen, D)
    for c, n0 in zip(caches, (700, 1500)):
        _, k0, v0 = make_chunk(gen, 1, 2, 8, n0, D, torch.float16, oc, 0.3)
        c.append(0, k0.cuda(), v0.cuda())
    for c, n in ((caches[0], 300), (caches[1], 77), (caches[0], 1), (caches[1], 513)):
        q, k, v = (x.cuda() for x in make_chunk(gen, 1, 2, 8, n, D, torch.float16, oc, 0.3))
        if n == 513:  # other strides
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        ref = kc.reference.attention(q, c, 0, k=k, v=v)
        out = prefill_attention(q, k, v, c, 0)
        assert rel(out, ref) < TOL, (n, rel(out, ref))


@gpu
def test_gpu_every_candidate_config():
    """Each tuner candidate that fits is correct (what `tune` may pick)."""
    _gpu_skip()
    from kvarn_cutlass.ops.prefill import CANDIDATES

    from kvarn_cutlass.runtime.arch import device_arch

    for D in (64, 128, 256):
        for cfg in CANDIDATES:
            if not cfg.fits(D, 128) or not cfg.supported_on(device_arch()):
                continue
            for n, nt, e in run_chunks([700, 333], D=D, device="cuda", impl="gpu", config=cfg, seed=11):
                assert e < TOL, (D, cfg, n, nt, e)


@gpu
def test_gpu_rechunking_oracle():
    """640 tokens in one call, as 300 + 340, in chunks of 44 and 84, and token by token: identical tiles."""
    _gpu_skip()
    gen = torch.Generator().manual_seed(12)
    B, H, D, n_layers = 1, 2, 128, 2
    oc = outliers(gen, D)
    data = [make_chunk(gen, B, H, 8, 640, D, torch.float16, oc, 0.35) for _ in range(n_layers)]
    splits = {"one": [640], "two": [300, 340], "44_84": [44, 84] * 5, "tok": [1] * 640}
    tiles = {}
    for name, chunks in splits.items():
        assert sum(chunks) == 640
        cache = kc.KVarNCache(n_layers, B, H, D, window=256, dtype=torch.float16, device="cuda")
        start = 0
        for ci, n in enumerate(chunks):
            for li in range(n_layers):
                q, k, v = (x[:, :, start:start + n].cuda() for x in data[li])
                if name != "tok" or ci % 97 == 0:
                    ref = kc.reference.attention(q, cache, li, k=k, v=v)
                    assert rel(prefill_attention(q, k, v, cache, li), ref) < TOL, (name, ci, li)
                else:
                    prefill_attention(q, k, v, cache, li)
            start += n
        tiles[name] = [cache.tile_bytes(li).cpu() for li in range(n_layers)]
    for name in splits:
        for li in range(n_layers):
            assert torch.equal(tiles[name][li], tiles["one"][li]), (name, li)


@gpu
def test_gpu_real_model_qkv():
    _gpu_skip()
    layers, cfg = capture_qkv(1200, device="cuda")
    for chunks in ((1200,), (500, 500, 200), (128,) * 9 + (48,)):
        errs = _real_model_errors(layers, cfg, chunks, "cuda", "gpu", range(len(layers)))
        assert max(e for *_, e in errs) < TOL, (chunks, errs)
