"""GPU tile compression (ops.compress, csrc/compress.cu).

CPU part: every shape compiles with NVRTC for sm_90 and sm_80 with no GPU, every pair of input
dtype, scale dtype and V bits on sm_90 (the lloyd_max quantizer for every shape on sm_90; the GPU
part compiles every variant the cache can pick), the PTX holds no fused multiply-add, the
lloyd_max thresholds are compiled in exactly, and the wrappers reject bad arguments with clear errors.
GPU part (``-m gpu``): records byte-identical to ``codec.encode_tiles`` for every preset x head_dim x
scale dtype x input dtype on random and adversarial tiles (lloyd_max: every preset x head_dim x scale
dtype, the input dtype cycling), the codec's errors, every byte written, and a CUDA KVarNCache
matching a CPU one.
"""

from __future__ import annotations

import itertools
import re
import struct
import zlib

import pytest
import torch

from kvarn_cutlass import codec
from kvarn_cutlass.cache import KVarNCache
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, TileSpec, lloyd_max_thresholds
from kvarn_cutlass.ops import compress as C
from kvarn_cutlass.runtime.spec import build

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.float16, torch.float32)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # one kernel cache for the whole session, never the user's
    root = tmp_path_factory.getbasetemp() / "kvarn-kernel-cache"
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(root))


# ================================================================ CPU: compilation ===============
SHAPES = sorted({(T, D) for (_, _, T) in PRESETS.values() for D in HEAD_DIMS}, reverse=True)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("T,D", SHAPES)
def test_compress_compiles_every_shape(arch, T, D):
    spec = C.compress_spec(T, D, torch.float16, torch.float16, 2)
    m = build(spec, arch)
    name, append_compress, commit, snapshot = spec.kernel_names
    for kernel in (name, append_compress):
        res = m.resources[kernel]
        assert res.registers <= 128, res  # 512 threads per block
        if (T, D) == (128, 128):
            assert res.spill_store_bytes == 0 and res.stack_bytes == 0, res
    if arch == "sm_90":  # the append's compression blocks: no spills in any shape (sm_90, 2026-12)
        assert m.resources[append_compress].spill_store_bytes == 0, m.resources[append_compress]
    for kernel in (commit, snapshot):  # 256 threads; copies and integer checks only
        res = m.resources[kernel]
        assert res.registers <= 64 and res.spill_store_bytes == 0 and res.stack_bytes == 0, res
    assert C.smem_bytes(T, D) <= 163 * 1024  # sm_80's opt-in limit per block


# lloyd_max on sm_90 only, one V width per shape (both widths for every head_dim): the quantizer
# changes the code decision, not the shape- or dtype-dependent parts tested above.
LM_SHAPES = [(T, D, 2 if T == 128 else 4) for T, D in SHAPES]


@pytest.mark.parametrize("T,D,v_bits", LM_SHAPES)
def test_compress_lloyd_max_compiles_every_shape_sm90(T, D, v_bits):
    spec = C.compress_spec(T, D, torch.float16, torch.float16, v_bits, "lloyd_max")
    m = build(spec, "sm_90")
    assert all(name.endswith("_lm") for name in spec.kernel_names)
    for name in spec.kernel_names[:2]:  # the codec's kernel and the append's
        res = m.resources[name]
        assert res.registers <= 128, res  # 512 threads per block
        if (T, D) == (128, 128):
            assert res.spill_store_bytes == 0 and res.stack_bytes == 0, res


def test_compress_quantizer_is_part_of_the_spec():
    uniform = C.compress_spec(128, 128, torch.float16, torch.float16, 2)
    assert uniform == C.compress_spec(128, 128, torch.float16, torch.float16, 2, "uniform")
    # unchanged by the quantizer option; the cache dtypes' modules also hold the append kernels
    assert uniform.kernel_names == tuple(f"kvarn_{r}_t128_d128_f16_s16_v2"
                                         for r in ("compress", "append_compress", "append_commit", "append_snapshot"))
    assert C.compress_spec(128, 128, torch.float32, torch.float16, 2).kernel_names == ("kvarn_compress_t128_d128_f32_s16_v2",)
    assert not any(k.startswith("KVARN_LM_") for k, _ in uniform.defines)
    for v_bits in (2, 4):
        lm = C.compress_spec(128, 128, torch.float16, torch.float16, v_bits, "lloyd_max")
        assert lm.name != C.compress_spec(128, 128, torch.float16, torch.float16, v_bits).name
        assert lm.kernel_names[0] == f"kvarn_compress_t128_d128_f16_s16_v{v_bits}_lm"
        defines = dict(lm.defines)
        assert defines["KVARN_QUANT"] == "1" and dict(uniform.defines)["KVARN_QUANT"] == "0"
        # the literals are exact: they parse back to format.lloyd_max_thresholds bit for bit
        for bits in (4, v_bits):
            literals = defines[f"KVARN_LM_THR{bits}"].split(",")
            assert all(x.endswith("f") for x in literals)
            assert tuple(float.fromhex(x[:-1]) for x in literals) == lloyd_max_thresholds(bits)
        assert ("KVARN_LM_THR2" in defines) == (v_bits == 2)
    with pytest.raises(KeyError):
        C.compress_spec(128, 128, torch.float16, torch.float16, 2, "nearest")


# Every pair of values of (input dtype, scale dtype, V bits) once: 6 compiles instead of all 12
# combinations; each axis changes its own part of the kernel (loads, scale stores, V packing), and
# the GPU identity tests below compile and run all 12.
DTYPE_PAIRS = [(ind, sd, 2 if (i + j) % 2 == 0 else 4)
               for i, ind in enumerate(IN_DTYPES) for j, sd in enumerate(SCALE_DTYPES)]


@pytest.mark.parametrize("in_dtype,scale_dtype,v_bits", DTYPE_PAIRS)
def test_compress_compiles_every_dtype_pair_sm90(in_dtype, scale_dtype, v_bits):
    spec = C.compress_spec(128, 128, in_dtype, scale_dtype, v_bits)
    m = build(spec, "sm_90")
    assert set(spec.kernel_names) <= set(m.resources)


def _ptx(defines: dict, extra_source: str = "") -> str:
    from cuda.bindings import nvrtc

    from kvarn_cutlass.runtime.compiler import cuda_include_dirs

    src = (C.compress_spec(128, 128, torch.float16, torch.float16, 2).source_path).read_text() + extra_source
    defines = dict(defines)
    prog = nvrtc.nvrtcCreateProgram(src.encode(), b"compress.cu", 0, [], [])[1]
    try:
        opts = [b"-arch=compute_90", b"--std=c++17", b"-default-device", b"--fmad=false"]
        opts += [f"-I{d}".encode() for d in (str(C.compress_spec(128, 128, torch.float16, torch.float16, 2).source_path.parent),
                                              *cuda_include_dirs())]
        opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        n = nvrtc.nvrtcGetPTXSize(prog)[1]
        buf = b" " * n
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_compress_ptx_has_only_correctly_rounded_arithmetic(quantizer):
    spec = C.compress_spec(128, 128, torch.bfloat16, torch.float16, 2, quantizer)
    ptx = _ptx(spec.defines)
    body = [ln for ln in ptx.splitlines() if not ln.strip().startswith("//")]
    text = "\n".join(body)
    assert "fma." not in text and "mad.f32" not in text
    assert ".approx" not in text and ".ftz" not in text
    assert "div.rn.f32" in text and "sqrt.rn.f32" in text
    if quantizer == "lloyd_max":
        # every threshold is compared as an immediate (no table in memory): setp.gt.f32 ..., 0fXXXXXXXX
        compared = set(re.findall(r"setp\.gt\.f32\s+%p\d+, %f\d+, 0f([0-9A-F]{8});", text))
        for bits in (4, 2):
            want = {struct.pack(">f", t).hex().upper() for t in lloyd_max_thresholds(bits)}
            assert want <= compared, sorted(want - compared)
        assert ".local" not in text


def test_compress_registered():
    from kvarn_cutlass.runtime import registry

    fam = registry.families()
    assert "compress" in fam
    names = {n for s in fam["compress"] for n in s.kernel_names}
    per_input_dtype = 2 * 2 * 3 * 2 * 2  # T x v_bits (the presets) x D x scale dtype x quantizer
    # the codec's kernel for 3 input dtypes; the 3 append kernels for the 2 cache dtypes
    assert len(names) == 3 * per_input_dtype + 3 * 2 * per_input_dtype
    assert C.kernel_name(128, 128, torch.float16, torch.float16, 2) in names
    assert C.kernel_name(64, 256, torch.float32, torch.float32, 4, "lloyd_max") in names
    assert C.kernel_name(64, 256, torch.bfloat16, torch.float32, 4, "lloyd_max", "append_commit") in names


# ================================================================ CPU: argument checks ===========
def test_compress_rejects_bad_arguments():
    spec = TileSpec()
    k = torch.zeros(2, 128, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="k is on cpu"):
        C.compress_tiles(k, k, spec)
    with pytest.raises(TypeError, match="spec must be"):
        C.compress_tiles(k, k, "k4v2_g128")
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        C.compress_tiles(k.numpy(), k, spec)
    with pytest.raises(TypeError, match="v has dtype torch.int32"):
        C.compress_tiles(k, k.to(torch.int32), spec)
    with pytest.raises(ValueError, match=r"k must have shape \[\.\.\., 128, 128\]"):
        C.compress_tiles(k[:, :64], k, spec)
    with pytest.raises(ValueError, match=r"k must have shape \[batch, heads, n_tiles\*128, 128\]"):
        C.compress_layer(torch.zeros(1, 2, 100, 128), torch.zeros(1, 2, 100, 128), spec)
    with pytest.raises(ValueError, match="k is on cpu"):
        C.compress_layer(torch.zeros(1, 2, 128, 128), torch.zeros(1, 2, 128, 128), spec)


def test_error_messages_follow_codec_order():
    f16 = torch.float16
    assert C.error_message(1 << 6 | 1 << 0, f16) == "k contains NaN or Inf"
    assert C.error_message(1 << 9 | 1 << 3, f16).startswith("v has values of magnitude > 2^48")
    assert C.error_message(1 << 1 | 1 << 3, f16) == (
        "K chan step overflows torch.float16: the input's magnitude needs scale_dtype=torch.float32"
    )
    assert C.error_message(1 << 5, torch.float32).startswith("V tok min overflows torch.float32")
    with pytest.raises(ValueError):
        C.error_message(1 << 20, f16)
    # lloyd_max stores the min (the mean) before the step (the RMS about it): the codec raises on the min
    assert C.error_message(1 << 1 | 1 << 2, f16, "lloyd_max") == (
        "K chan min overflows torch.float16: the input's magnitude needs scale_dtype=torch.float32"
    )
    assert C.error_message(1 << 1 | 1 << 2, f16, "uniform").startswith("K chan step")
    assert C.error_message(1 << 4 | 1 << 5 | 1 << 1, f16, "lloyd_max").startswith("K chan step")  # K half first
    assert C.error_message(1 << 4 | 1 << 5, f16, "lloyd_max").startswith("V tok min")
    assert C.error_message(1 << 0 | 1 << 2, f16, "lloyd_max").startswith("K row_scale")
    with pytest.raises(ValueError, match="quantizer"):
        C.error_message(1 << 1, f16, "nearest")


def test_smem_bytes_is_the_kernels_own_constant():
    """The launch's dynamic shared memory is what the compiled kernel says it carves up: each shape's
    ``kvc::Shape<T, D>::kSmemBytes``, read from the PTX of a probe compiled with the kernel source."""
    probe = "".join(f"\n__device__ int kvarn_probe_smem_{T}_{D} = kvc::Shape<{T}, {D}>::kSmemBytes;" for T, D in SHAPES)
    ptx = _ptx(C.compress_spec(128, 128, torch.float16, torch.float16, 2).defines, probe)
    compiled = {(int(t), int(d)): int(n) for t, d, n in re.findall(r"kvarn_probe_smem_(\d+)_(\d+) = (\d+);", ptx)}
    assert set(compiled) == set(SHAPES)
    assert {(T, D): C.smem_bytes(T, D) for T, D in SHAPES} == compiled


# ================================================================ GPU: byte identity ============
def _gen(kind: str, n: int, T: int, D: int, g: torch.Generator) -> torch.Tensor:
    """float32 [n, T, D] test tiles."""
    if kind == "randn":
        return torch.randn(n, T, D, generator=g)
    if kind == "outliers":  # scaled randn with a few large channels, per-record scale
        x = torch.randn(n, T, D, generator=g) * torch.exp(torch.randn(n, 1, 1, generator=g))
        ch = torch.randint(0, D, (n, 4), generator=g)
        for i in range(n):
            x[i, :, ch[i]] *= 20.0
        return x
    if kind == "rope":  # RoPE-like: per-channel-pair rotation of a slowly varying vector by position
        pos = torch.arange(T, dtype=torch.float64)[:, None]
        freq = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) / (D // 2))
        ang = pos * freq
        base = torch.randn(n, 1, D, generator=g, dtype=torch.float64) * 3 + torch.randn(n, T, D, generator=g, dtype=torch.float64) * 0.3
        a, b = base[..., : D // 2], base[..., D // 2 :]
        out = torch.cat((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), -1)
        return out.float()
    raise ValueError(kind)


def _sanitize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # +0.0 turns -0.0 into +0.0: the codec's min/max of mixed-sign zeros is not defined bit for bit
    # (see ops/compress.py); every other value is kept.
    return x.to(dtype) + 0.0


def _check_identity(k: torch.Tensor, v: torch.Tensor, spec: TileSpec, poison: int = 0xAB) -> None:
    ref = codec.encode_tiles(k, v, spec)
    out = torch.full(ref.shape, poison, dtype=torch.uint8, device="cuda")
    got = C.compress_tiles(k.cuda(), v.cuda(), spec, out=out)
    assert got.data_ptr() == out.data_ptr()
    got = got.cpu()
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()
        first = bad[0].tolist()
        secs = {name: spec.section(name) for name in spec.section_names()}
        where = next(n for n, (o, s) in secs.items() if o <= first[-1] < o + s)
        raise AssertionError(
            f"{len(bad)} bytes differ ({spec.preset}, D={spec.head_dim}, {spec.scale_dtype}, {k.dtype}); "
            f"first at {first} in section {where!r}: got {int(got[tuple(first)])}, want {int(ref[tuple(first)])}"
        )


COMBOS = [
    (p, D, sd, ind) for p in PRESETS for D in HEAD_DIMS for sd in SCALE_DTYPES for ind in IN_DTYPES
]
# lloyd_max: every preset x head_dim x scale dtype, the input dtype cycling through the three (it only
# changes the load, which the uniform combos cover in full): 24 compiled variants rather than 72.
LM_COMBOS = [
    (p, D, sd, IN_DTYPES[i % len(IN_DTYPES)])
    for i, (p, D, sd) in enumerate(itertools.product(PRESETS, HEAD_DIMS, SCALE_DTYPES))
]
QCOMBOS = [("uniform", *c) for c in COMBOS] + [("lloyd_max", *c) for c in LM_COMBOS]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer,preset,D,scale_dtype,in_dtype", QCOMBOS)
@pytest.mark.parametrize("kind", ["randn", "outliers", "rope"])
def test_gpu_identity_random(quantizer, preset, D, scale_dtype, in_dtype, kind):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer=quantizer)
    g = torch.Generator().manual_seed(zlib.crc32(repr((quantizer, preset, D, scale_dtype, in_dtype, kind)).encode()))
    T = spec.tile_tokens
    for _ in range(3):
        k = _sanitize(_gen(kind, 12, T, D, g), in_dtype)
        v = _sanitize(_gen(kind, 12, T, D, g), in_dtype)
        _check_identity(k, v, spec)


def _adversarial(T: int, D: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    r = lambda: torch.randn(T, D, generator=g)  # noqa: E731
    big = 6.0e4 if dtype == torch.float16 else 1.0e6
    cases = {
        "zeros": torch.zeros(T, D),
        "constant_channels": torch.randn(1, D, generator=g).expand(T, D).clone(),
        "constant_tokens": torch.randn(T, 1, generator=g).expand(T, D).clone(),
        "constant": torch.full((T, D), 3.25),
        "one_channel": torch.zeros(T, D).index_fill_(1, torch.tensor([5]), 1.0),
        "one_token": torch.zeros(T, D).index_fill_(0, torch.tensor([3]), -2.0),
        "outliers_near_max": r().clamp(-3, 3) * (big / 3),
        "outlier_entries": r().index_put_((torch.tensor([0, T - 1]), torch.tensor([1, D - 2])), torch.tensor([big, -big])),
        "one_huge_token": torch.cat((r()[: T - 1], r()[:1] * big / 4)),
        "ties": torch.randint(-2, 3, (T, D), generator=g).float() * 0.5,
        "binary": torch.randint(0, 2, (T, D), generator=g).float(),
        "tiny": r() * 1e-6,
    }
    if dtype == torch.float16:
        cases["fp16_denormals"] = torch.randint(-40, 41, (T, D), generator=g).float() * 2.0**-24
        cases["fp16_mixed_denormals"] = r() * 2.0**-20
    else:
        cases["huge_range"] = r() * 1e12
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer,preset,D,scale_dtype,in_dtype", QCOMBOS)
def test_gpu_identity_adversarial(quantizer, preset, D, scale_dtype, in_dtype):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer=quantizer)
    T = spec.tile_tokens
    cases = _adversarial(T, D, in_dtype)
    for name, x in cases.items():
        for kx, vx in ((x, x), (x, torch.randn(T, D)), (torch.randn(T, D), x)):
            k, v = _sanitize(kx[None], in_dtype), _sanitize(vx[None], in_dtype)
            try:
                codec.encode_tiles(k, v, spec)
            except ValueError as e:
                with pytest.raises(ValueError, match=str(e).split(":")[0]):
                    C.compress_tiles(k.cuda(), v.cuda(), spec)
                continue
            try:
                _check_identity(k, v, spec)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}") from None


def _threshold_tie_tiles(T: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 k, v [1, T, D] whose lloyd_max normalized values hit the decision thresholds exactly.

    Meant for ``sinkhorn_iters=0`` and D = 64 or 256: the normalization keeps r = s = 1, so u is the
    rotated tile y, and float32 WHT of an input with one or two nonzero channels scaled by sqrt(D) (a
    power of two) is exact. Every axis is antisymmetric under the first halving-tree pairing (t, t + T/2
    for K; c, c + D/2 for V, channels >= D/2 flip sign there), so its mean is exactly +0, and its RMS is
    1 within 1e-6, which float16 scales store as 1.0: z = u exactly.

    * K: channel 1 holds sqrt(D) * a_t with a = (positive thresholds of 4 and 2 bits, 0, fillers, then
      the negation): every K axis is +-a.
    * V: token t holds sqrt(D) * (alpha, beta) at channels D/2 + 1, D/2 + 2 with alpha + beta = t_a (a
      threshold below sqrt(2), or 0) exactly and alpha^2 + beta^2 = 1: the token's values are
      +-t_a and +-(alpha - beta). Thresholds for which no float32 pair has an exact sum are left out
      (t = 0.2582: its last bit is below the spacing of floats near 1/sqrt(2)); K has them all.
    """
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    positive = [t for t in lloyd_max_thresholds(4) + lloyd_max_thresholds(2) if t > 0]
    first = sorted(set(positive)) + [0.0]
    n_fill = T // 2 - len(first)
    fill = f32(((T / 2 - sum(t * t for t in first)) / n_fill) ** 0.5)
    a = torch.tensor(first + [fill] * n_fill, dtype=torch.float32)
    a = torch.cat((a, -a))
    root = D**0.5
    k = torch.zeros(1, T, D)
    k[0, :, 1] = a * root
    pairs = []
    for ta in [0.0] + sorted({t for t in positive if t * t < 2}):
        alpha = f32((ta + (2 - ta * ta) ** 0.5) / 2)
        beta = f32(ta - alpha)
        if f32(alpha + beta) == ta:  # the sum the WHT forms is exact
            pairs.append((alpha, beta))
    v = torch.zeros(1, T, D)
    for t in range(T):
        v[0, t, D // 2 + 1], v[0, t, D // 2 + 2] = (x * root for x in pairs[t % len(pairs)])
    return k, v


@pytest.mark.parametrize("T", [64, 128])
@pytest.mark.parametrize("D", [64, 256])
def test_threshold_tie_tiles_hit_the_thresholds(T, D):
    # the construction's promise, checked with the codec: stored mean 0 and RMS 1, so z = u, and u takes
    # every threshold of the 4-bit book on the K axis and the sub-sqrt(2) ones on the V axis
    spec = TileSpec(preset=f"k4v2_g{T}", head_dim=D, sinkhorn_iters=0, quantizer="lloyd_max")
    k, v = _threshold_tie_tiles(T, D)
    f = codec.unpack_fields(codec.encode_tiles(k, v, spec), spec)
    for scales in (f.row_scale, f.col_scale, f.chan_step, f.tok_step):
        assert bool((scales == 1).all())
    assert bool((f.chan_min == 0).all()) and bool((f.tok_min == 0).all())
    yk, yv = codec.wht(k), codec.wht(v)
    thr4, thr2 = set(lloyd_max_thresholds(4)), set(lloyd_max_thresholds(2))
    assert thr4 <= set(yk[0, :, 0].tolist())
    assert thr2 <= set(yv.flatten().tolist()) and len(thr4 & set(yv.flatten().tolist())) >= 7


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_gpu_lloyd_max_threshold_ties(preset, D, scale_dtype):
    # float16 scales: exact ties (z == t_j, lower code); float32 scales: z within an ulp or so of t_j
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, sinkhorn_iters=0, quantizer="lloyd_max")
    k, v = _threshold_tie_tiles(spec.tile_tokens, D)
    _check_identity(k, v, spec)
    _check_identity(v, k, spec)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("iters", [0, 1, 2, 7])
def test_gpu_identity_sinkhorn_iters(quantizer, iters):
    spec = TileSpec(sinkhorn_iters=iters, quantizer=quantizer)
    g = torch.Generator().manual_seed(iters)
    k = _sanitize(_gen("outliers", 8, 128, 128, g), torch.float16)
    v = _sanitize(_gen("rope", 8, 128, 128, g), torch.float16)
    _check_identity(k, v, spec)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_gpu_every_byte_written_and_lead_dims(quantizer):
    spec = TileSpec(preset="k4v4_g64", head_dim=64, quantizer=quantizer)
    g = torch.Generator().manual_seed(3)
    k = _sanitize(torch.randn(2, 3, 64, 64, generator=g), torch.bfloat16)
    v = _sanitize(torch.randn(2, 3, 64, 64, generator=g), torch.bfloat16)
    for poison in (0x00, 0xAB, 0xFF):
        _check_identity(k, v, spec, poison=poison)
    got = C.compress_tiles(k.cuda(), v.cuda(), spec)
    assert got.shape == (2, 3, spec.tile_nbytes)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_mixed_input_dtypes_and_strided_input():
    spec = TileSpec()
    g = torch.Generator().manual_seed(5)
    k = _sanitize(torch.randn(4, 128, 128, generator=g), torch.float16)
    v = _sanitize(torch.randn(4, 128, 128, generator=g), torch.bfloat16)
    ref = codec.encode_tiles(k, v, spec)
    assert torch.equal(C.compress_tiles(k.cuda(), v.cuda(), spec).cpu(), ref)
    # token-strided views: every other head of a bigger buffer
    kb = torch.zeros(8, 128, 128, dtype=torch.float16, device="cuda")
    kb[::2] = k.cuda()
    assert torch.equal(C.compress_tiles(kb[::2], v.cuda(), spec).cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "quantizer,preset,D",
    [("uniform", "k4v2_g128", 128), ("uniform", "k4v4_g64", 256), ("uniform", "k4v2_g64", 64),
     ("lloyd_max", "k4v2_g128", 128), ("lloyd_max", "k4v4_g64", 64)],
)
def test_gpu_compress_layer_into_pool_slice(quantizer, preset, D):
    spec = TileSpec(preset=preset, head_dim=D, quantizer=quantizer)
    T = spec.tile_tokens
    B, H, n_tiles, extra = 2, 3, 2, 64
    g = torch.Generator().manual_seed(11)
    full_k = _sanitize(torch.randn(B, H, n_tiles * T + extra, D, generator=g), torch.float16).cuda()
    full_v = _sanitize(torch.randn(B, H, n_tiles * T + extra, D, generator=g), torch.float16).cuda()
    k, v = full_k[:, :, extra:], full_v[:, :, extra:]  # a token-offset view, like the cache's stream
    pool = torch.full((B, 5, H, spec.tile_nbytes), 0xAB, dtype=torch.uint8, device="cuda")
    got = C.compress_layer(k, v, spec, out=pool[:, 1 : 1 + n_tiles])
    assert got.data_ptr() == pool[:, 1].data_ptr()
    tiles = lambda x: x.reshape(B, H, n_tiles, T, D).transpose(1, 2).cpu()  # noqa: E731
    ref = codec.encode_tiles(tiles(k), tiles(v), spec)
    assert torch.equal(pool[:, 1 : 1 + n_tiles].cpu(), ref)
    assert bool((pool[:, 0] == 0xAB).all()) and bool((pool[:, 1 + n_tiles :] == 0xAB).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_gpu_errors_match_codec(quantizer):
    spec = TileSpec(quantizer=quantizer)
    g = torch.Generator().manual_seed(2)
    good = torch.randn(2, 128, 128, generator=g, dtype=torch.float32)
    nan = good.clone()
    nan[1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        C.compress_tiles(nan.cuda(), good.cuda(), spec)
    with pytest.raises(ValueError, match="v contains NaN or Inf"):
        C.compress_tiles(good.cuda(), nan.cuda(), spec)
    huge = good * 2.0**50
    with pytest.raises(ValueError, match="v has values of magnitude"):
        C.compress_tiles(good.cuda(), huge.cuda(), spec)
    # float16 scale overflow: bfloat16 input of magnitude 1e12
    big = (torch.randn(1, 128, 128, generator=g) * 1e12).to(torch.bfloat16)
    with pytest.raises(ValueError) as ref:
        codec.encode_tiles(big, big, spec)
    with pytest.raises(ValueError) as got:
        C.compress_tiles(big.cuda(), big.cuda(), spec)
    assert str(got.value) == str(ref.value)
    # the flag was reset: a good launch afterwards succeeds, and matches
    _check_identity(good[:1], good[:1], spec)
    # deferred check
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    C.compress_tiles(big.cuda(), big.cuda(), spec, error_flag=flag)
    with pytest.raises(ValueError, match="overflows torch.float16"):
        C.check_error_flag(flag, spec)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "quantizer,preset,D,dtype",
    [("uniform", "k4v2_g128", 128, torch.float16), ("uniform", "k4v4_g64", 64, torch.bfloat16),
     ("lloyd_max", "k4v2_g128", 128, torch.float16), ("lloyd_max", "k4v4_g64", 64, torch.bfloat16)],
)
def test_gpu_cache_matches_cpu_cache(quantizer, preset, D, dtype):
    kw = dict(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=D, preset=preset, dtype=dtype, quantizer=quantizer)
    T = PRESETS[preset][2]
    cpu = KVarNCache(**kw, device="cpu", window=T, sink_tokens=T)
    gpuc = KVarNCache(**kw, device="cuda", window=T, sink_tokens=T)
    g = torch.Generator().manual_seed(1)
    for n in (5, 200, 1, 3 * T + 7, 64, 2 * T):
        for layer in range(2):
            k = _sanitize(torch.randn(2, 3, n, D, generator=g) * 2, dtype)
            v = _sanitize(torch.randn(2, 3, n, D, generator=g), dtype)
            cpu.append(layer, k, v)
            gpuc.append(layer, k.cuda(), v.cuda())
            assert gpuc.num_tiles(layer) == cpu.num_tiles(layer)
            assert torch.equal(gpuc.tile_bytes(layer).cpu(), cpu.tile_bytes(layer))
    assert cpu.num_tiles(0) > 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_cache_error_leaves_cache_unchanged():
    c = KVarNCache(1, 1, 2, 128, dtype=torch.bfloat16, device="cuda", window=128)
    k = torch.randn(1, 2, 100, 128, device="cuda", dtype=torch.bfloat16)
    c.append(0, k, k)
    before = (c.seq_len(0), c.num_tiles(0), c.window_kv(0)[0].clone())
    big = (torch.randn(1, 2, 200, 128, device="cuda") * 1e12).to(torch.bfloat16)
    with pytest.raises(ValueError):
        c.append(0, big, big)
    assert (c.seq_len(0), c.num_tiles(0)) == before[:2]
    assert torch.equal(c.window_kv(0)[0], before[2])
