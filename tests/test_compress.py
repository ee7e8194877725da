"""GPU tile compression (ops.compress, csrc/compress.cu).

CPU part: every kernel variant the cache can pick compiles with NVRTC for sm_90 and sm_80 with no
GPU, the PTX holds no fused multiply-add, and the wrappers reject bad arguments with clear errors.
GPU part (``-m gpu``): records byte-identical to ``codec.encode_tiles`` for every preset x head_dim x
scale dtype x input dtype on random and adversarial tiles, the codec's errors, every byte written,
and a CUDA KVarNCache matching a CPU one.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvarn_cutlass import codec
from kvarn_cutlass.cache import KVarNCache
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, TileSpec
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
    (name,) = spec.kernel_names
    res = m.resources[name]
    assert res.registers <= 128, res  # 512 threads per block
    assert C.smem_bytes(T, D) <= 163 * 1024  # sm_80's opt-in limit per block
    if (T, D) == (128, 128):
        assert res.spill_store_bytes == 0 and res.stack_bytes == 0, res


@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("v_bits", [2, 4])
def test_compress_compiles_every_dtype_variant_sm90(in_dtype, scale_dtype, v_bits):
    spec = C.compress_spec(128, 128, in_dtype, scale_dtype, v_bits)
    m = build(spec, "sm_90")
    assert set(spec.kernel_names) <= set(m.resources)


def _ptx(defines: dict) -> str:
    from cuda.bindings import nvrtc

    from kvarn_cutlass.runtime.compiler import cuda_include_dirs

    src = (C.compress_spec(128, 128, torch.float16, torch.float16, 2).source_path).read_text()
    prog = nvrtc.nvrtcCreateProgram(src.encode(), b"compress.cu", 0, [], [])[1]
    try:
        opts = [b"-arch=compute_90", b"--std=c++17", b"-default-device", b"--fmad=false"]
        opts += [f"-I{d}".encode() for d in cuda_include_dirs()]
        opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        n = nvrtc.nvrtcGetPTXSize(prog)[1]
        buf = b" " * n
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_compress_ptx_has_only_correctly_rounded_arithmetic():
    ptx = _ptx({"KVARN_T": 128, "KVARN_D": 128, "KVARN_IN": 1, "KVARN_SC": 16, "KVARN_VB": 2})
    body = [ln for ln in ptx.splitlines() if not ln.strip().startswith("//")]
    text = "\n".join(body)
    assert "fma." not in text and "mad.f32" not in text
    assert ".approx" not in text and ".ftz" not in text
    assert "div.rn.f32" in text and "sqrt.rn.f32" in text


def test_compress_registered():
    from kvarn_cutlass.runtime import registry

    fam = registry.families()
    assert "compress" in fam
    names = {n for s in fam["compress"] for n in s.kernel_names}
    assert len(names) == 2 * 3 * 3 * 2 * 2  # (T, v_bits) presets x D x input dtype x scale dtype
    assert C.kernel_name(128, 128, torch.float16, torch.float16, 2) in names


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


def test_smem_bytes_matches_kernel_formula():
    # Shape::kSmemFloats = T*D + W*D + 3*D + 4*W + 4*(D/32), W = 16
    assert C.smem_bytes(128, 128) == 4 * (128 * 128 + 16 * 128 + 3 * 128 + 64 + 16)
    assert max(C.smem_bytes(T, D) for T, D in SHAPES) == C.smem_bytes(128, 256)


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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype", COMBOS)
@pytest.mark.parametrize("kind", ["randn", "outliers", "rope"])
def test_gpu_identity_random(preset, D, scale_dtype, in_dtype, kind):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(zlib.crc32(repr((preset, D, scale_dtype, in_dtype, kind)).encode()))
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
@pytest.mark.parametrize("preset,D,scale_dtype,in_dtype", COMBOS)
def test_gpu_identity_adversarial(preset, D, scale_dtype, in_dtype):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype)
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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("iters", [0, 1, 2, 7])
def test_gpu_identity_sinkhorn_iters(iters):
    spec = TileSpec(sinkhorn_iters=iters)
    g = torch.Generator().manual_seed(iters)
    k = _sanitize(_gen("outliers", 8, 128, 128, g), torch.float16)
    v = _sanitize(_gen("rope", 8, 128, 128, g), torch.float16)
    _check_identity(k, v, spec)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_every_byte_written_and_lead_dims():
    spec = TileSpec(preset="k4v4_g64", head_dim=64)
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
@pytest.mark.parametrize("preset,D", [("k4v2_g128", 128), ("k4v4_g64", 256), ("k4v2_g64", 64)])
def test_gpu_compress_layer_into_pool_slice(preset, D):
    spec = TileSpec(preset=preset, head_dim=D)
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
def test_gpu_errors_match_codec():
    spec = TileSpec()
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
@pytest.mark.parametrize("preset,D,dtype", [("k4v2_g128", 128, torch.float16), ("k4v4_g64", 64, torch.bfloat16)])
def test_gpu_cache_matches_cpu_cache(preset, D, dtype):
    kw = dict(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=D, preset=preset, dtype=dtype)
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
