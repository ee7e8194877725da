import hashlib
from fractions import Fraction

import numpy as np
import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import codec

from _helpers import hadamard64, realistic_kv

PRESETS = list(kc.PRESETS)


def det_tile(T: int, D: int, seed: int) -> torch.Tensor:
    """A deterministic tile built with integer arithmetic only (same bits on every machine)."""
    t = torch.arange(T)[:, None]
    c = torch.arange(D)[None, :]
    x = (((t * 37 + c * 11 + seed * 7) % 29) - 14).float() / 4.0
    x[:, 3] *= 8
    x[5, :] += 3
    return x.to(torch.float16)


# Pinned bytes of the format: any change here is a format change and needs a new format version.
GOLDEN_SHA256 = {
    "k4v2_g128": "66e420de2cd07c4eb5d315f71f20ee6aa99b4ae439695f1e4bf6a55444ddf0b2",
    "k4v4_g128": "01674e84ac028178ab02e0d8a72361aca665f3fd8db0fc06a529b1eb2cdef96b",
    "k4v2_g64": "0139525bbe9da0c6b7577bb6a0da86b24fe0f44c3463f520347e068b23d4f9c9",
    "k4v4_g64": "8c24e6460c0dfe154018c47c52b093b9800b2d69acfc5ae8c3322b6026a824ea",
}


# lloyd_max: re-pinned when its codebook became the float16-rounded centroids (was float32).
GOLDEN_SHA256_LLOYD_MAX = {
    "k4v2_g128": "e2730a806a986cb2c61f217e38245f57ecb03fa318eced9eb4e29112fa3f756d",
    "k4v4_g128": "a7611593895e263e8b7e1c949dc78130fa57376084462c02475b2c9f43554aca",
    "k4v2_g64": "0f73583445b9a468ea83455f4bd7fda784bfb4e7045cb3fba11778cbe2d9cef6",
    "k4v4_g64": "e52b3b027285f35297a408234eacc46b19ff2be4c091a67ffbef996aca79dc6b",
}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_golden_bytes(preset, quantizer):
    spec = kc.TileSpec(preset, 64, quantizer=quantizer)
    T = spec.tile_tokens
    rec = kc.encode_tiles(det_tile(T, 64, 1), det_tile(T, 64, 2), spec)
    assert rec.dtype == torch.uint8 and rec.shape == (spec.tile_nbytes,)
    golden = GOLDEN_SHA256 if quantizer == "uniform" else GOLDEN_SHA256_LLOYD_MAX
    assert hashlib.sha256(rec.numpy().tobytes()).hexdigest() == golden[preset]


def _raw_fields(rec: np.ndarray, spec: kc.TileSpec) -> dict:
    """Parse one record straight from the documented layout: scales with numpy, codes through the one
    unpacking of the format (``codec.unpack_codes``, checked bit by bit in tests/test_codec_unpack.py)."""
    T, D = spec.tile_tokens, spec.head_dim
    sd = np.float16 if spec.scale_dtype == torch.float16 else np.float32

    def sec(name):
        off, n = spec.section(name)
        return rec[off : off + n]

    def codes(name, rows, bits):
        return codec.unpack_codes(torch.from_numpy(sec(name).reshape(rows, -1).copy()), bits).numpy().astype(np.int64)

    k_codes = codes("k_codes", D, spec.k_bits)  # [D, T]: channel-major
    v_codes = codes("v_codes", T, spec.v_bits)  # [T, D]
    scales = {n: sec(n).view(sd).astype(np.float64) for n in ("chan_step", "chan_min", "row_scale", "tok_step", "tok_min", "col_scale")}
    return {"k_codes": k_codes, "v_codes": v_codes, **scales}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_records_quantize_rotated_tiles_to_nearest_level(preset, head_dim, scale_dtype):
    """Every code is the nearest level of its channel/token grid in the float64 rotated domain."""
    spec = kc.TileSpec(preset, head_dim, scale_dtype)
    T, D = spec.tile_tokens, head_dim
    _assert_nearest_levels(realistic_kv(T, D), realistic_kv(T, D), spec)


def _assert_nearest_levels(k: torch.Tensor, v: torch.Tensor, spec: kc.TileSpec) -> None:
    D = spec.head_dim
    f = _raw_fields(kc.encode_tiles(k, v, spec).numpy(), spec)
    H = hadamard64(D).numpy()
    yk = k.double().numpy() @ H
    yv = v.double().numpy() @ H
    assert f["k_codes"].max() <= 15 and f["v_codes"].max() < 2**spec.v_bits
    assert (f["row_scale"] > 0).all() and (f["col_scale"] > 0).all()
    # K: per channel c over tokens, u = y / row_scale is coded as chan_min + chan_step * code.
    u = yk / f["row_scale"][:, None]
    step, lo = f["chan_step"][None, :], f["chan_min"][None, :]
    err = np.abs(lo + step * f["k_codes"].T - u)
    rounding = 2e-3 * (np.abs(u) + np.abs(lo)) + 1e-6 * np.abs(u).max()  # storage rounding, float32 math
    assert (err <= step / 2 * (1 + 1e-3) + rounding).all()
    # Each non-constant channel's range is used: its lowest and (within one) highest level are hit.
    used = f["chan_step"] > 0
    assert (f["k_codes"].min(1)[used] == 0).all() and (f["k_codes"].max(1)[used] >= 14).all()
    # V: per token t over channels, w = y / col_scale is coded as tok_min + tok_step * code.
    w = yv / f["col_scale"][None, :]
    step, lo = f["tok_step"][:, None], f["tok_min"][:, None]
    err = np.abs(lo + step * f["v_codes"] - w)
    rounding = 2e-3 * (np.abs(w) + np.abs(lo)) + 1e-6 * np.abs(w).max()
    assert (err <= step / 2 * (1 + 1e-3) + rounding).all()


# Relative (Frobenius) round-trip error on realistic data; measured about 0.086-0.095 for 4-bit K,
# 0.09-0.11 for 4-bit V and 0.44-0.54 for 2-bit V (uniform 2-bit on Gaussian rows).
ROUND_TRIP_BOUNDS = {4: 0.12, 2: 0.6}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_round_trip_error_bounds(preset, head_dim):
    spec = kc.TileSpec(preset, head_dim)
    g = torch.Generator().manual_seed(1000 + head_dim)
    k = realistic_kv(6, spec.tile_tokens, head_dim, generator=g)
    v = realistic_kv(6, spec.tile_tokens, head_dim, generator=g)
    k_hat, v_hat = kc.decode_tiles(kc.encode_tiles(k, v, spec), spec)
    assert k_hat.dtype == torch.float32 and k_hat.shape == k.shape
    rel = lambda a, b: ((a - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(k_hat, k) < ROUND_TRIP_BOUNDS[spec.k_bits]
    assert rel(v_hat, v) < ROUND_TRIP_BOUNDS[spec.v_bits]


def test_batched_encoding_equals_tile_by_tile():
    spec = kc.TileSpec("k4v4_g64", 128)
    k = realistic_kv(2, 3, 64, 128)
    v = realistic_kv(2, 3, 64, 128)
    rec = kc.encode_tiles(k, v, spec)
    assert rec.shape == (2, 3, spec.tile_nbytes)
    for i in range(2):
        for j in range(3):
            assert torch.equal(rec[i, j], kc.encode_tiles(k[i, j], v[i, j], spec))


def test_wht_is_normalized_sylvester_and_involutive():
    x = torch.randn(5, 256, dtype=torch.float64)
    assert torch.allclose(codec.wht(x), x @ hadamard64(256), atol=1e-12)
    assert torch.allclose(codec.wht(codec.wht(x)), x, atol=1e-12)


def test_tree_sum_order():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32)
    # (1e8 + -1e8) + (1 + 1) = 2 exactly; a left-to-right float32 sum would give 1.
    assert codec.tree_sum(x).item() == 2.0


def _adversarial_tiles(T, D):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(T, D, generator=g)
    const_chan = base.clone()
    const_chan[:, 7] = 3.25
    const_chan[:, 9] = 0.0
    const_tok = base.clone()
    const_tok[11] = -2.0
    outliers = base.clone()
    outliers[3, 5] = 6.0e4
    outliers[40, 17] = -6.0e4
    denormal = (torch.randint(-3, 4, (T, D), generator=g).float() * 2.0**-24)
    huge_token = base.clone()
    huge_token[0] = 6.0e4 * torch.sign(base[0] + 0.01)
    return {
        "zeros": torch.zeros(T, D),
        "constant": torch.full((T, D), 1.5),
        "const_channel": const_chan,
        "const_token": const_tok,
        "outliers_6e4": outliers,
        "denormals": denormal,
        "huge_token": huge_token,
        "max_fp16_everywhere": torch.full((T, D), 65504.0),
    }


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", list(_adversarial_tiles(64, 64)))
def test_adversarial_tiles_encode_and_decode(preset, head_dim, case):
    spec = kc.TileSpec(preset, head_dim)
    x = _adversarial_tiles(spec.tile_tokens, head_dim)[case].to(torch.float16)
    rec = kc.encode_tiles(x, x, spec)
    k_hat, v_hat = kc.decode_tiles(rec, spec, torch.float64)
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    x64 = x.double()
    if case == "zeros":
        assert not k_hat.any() and not v_hat.any()
        return
    if case in ("constant", "max_fp16_everywhere"):
        # A constant tile rotates into one constant column (channel 0): exact up to scale rounding.
        assert torch.allclose(k_hat, x64, rtol=2e-3, atol=1e-6)
    # Whatever the tile, every code is the nearest level of its grid (no error beyond half a step).
    _assert_nearest_levels(x, x, spec)


def test_float16_scale_overflow_is_reported_and_float32_scales_work():
    spec16 = kc.TileSpec("k4v2_g64", 64, torch.float16)
    x = torch.full((64, 64), 3.0e10, dtype=torch.float32)
    with pytest.raises(ValueError, match="scale_dtype=torch.float32"):
        kc.encode_tiles(x, x, spec16)
    spec32 = kc.TileSpec("k4v2_g64", 64, torch.float32)
    k_hat, _ = kc.decode_tiles(kc.encode_tiles(x, x, spec32), spec32, torch.float64)
    assert torch.allclose(k_hat, x.double(), rtol=1e-5)


def _is_correctly_rounded_sqrt(r: float, m: float) -> bool:
    """Exact check, no sqrt involved: r (a float32) is the float32 nearest to sqrt(m) iff m lies
    strictly between the squares of the midpoints to r's float32 neighbours (sqrt of a float32 is
    never such a midpoint)."""
    r32 = np.float32(r)
    below = Fraction(float(np.nextafter(r32, np.float32(0))))
    above = Fraction(float(np.nextafter(r32, np.float32(np.inf))))
    R, M = Fraction(float(r32)), Fraction(m)
    return ((R + below) / 2) ** 2 < M < ((R + above) / 2) ** 2


def test_codec_rms_is_the_correctly_rounded_sqrt():
    """The codec's RMS (module docstring: sqrt of the halving-tree mean square, correctly rounded)
    against an exact rational check. On MKL builds float32 torch.sqrt misses 868 of these 4096 rows by
    1 ulp (measured); the GPU kernel's __fsqrt_rn is correctly rounded, so a codec on torch.sqrt
    broke byte identity with float32 scales."""
    seed = 2024
    z = torch.randn(4096, 64, generator=torch.Generator().manual_seed(seed))
    mean_square = codec.tree_sum(z * z, -1) / 64.0
    rms = codec._rms(z, -1)
    wrong = [i for i, (r, m) in enumerate(zip(rms.tolist(), mean_square.tolist())) if not _is_correctly_rounded_sqrt(r, m)]
    assert not wrong, f"seed={seed}: {len(wrong)} of 4096 rows not correctly rounded, first row {wrong[0]}"


@pytest.mark.parametrize(
    "k, v, match",
    [
        (torch.zeros(64, 64, dtype=torch.int32), torch.zeros(64, 64), "k has dtype"),
        (torch.zeros(64, 64), torch.zeros(64, 64, dtype=torch.float64), "v has dtype"),
        (torch.zeros(63, 64), torch.zeros(63, 64), r"k must have shape \[\.\.\., 64, 64\]"),
        (torch.zeros(64, 64), torch.zeros(2, 64, 64), "same shape"),
        (torch.full((64, 64), float("nan")), torch.zeros(64, 64), "k contains NaN or Inf"),
        (torch.zeros(64, 64), torch.full((64, 64), float("inf")), "v contains NaN or Inf"),
        ([[0.0]], torch.zeros(64, 64), "k must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_encode_bad_input(k, v, match, quantizer):
    with pytest.raises((ValueError, TypeError), match=match):
        kc.encode_tiles(k, v, kc.TileSpec("k4v2_g64", 64, quantizer=quantizer))


def test_encode_rejects_magnitudes_outside_float32_range():
    x = torch.full((64, 64), 2.0**60, dtype=torch.float32)
    with pytest.raises(ValueError, match="k has values of magnitude"):
        kc.encode_tiles(x, torch.zeros(64, 64), kc.TileSpec("k4v2_g64", 64, torch.float32))


def test_decode_bad_records():
    spec = kc.TileSpec("k4v2_g64", 64)
    with pytest.raises(ValueError, match="uint8"):
        kc.decode_tiles(torch.zeros(spec.tile_nbytes + 16, dtype=torch.uint8), spec)
    with pytest.raises(ValueError, match="uint8"):
        kc.decode_tiles(torch.zeros(spec.tile_nbytes, dtype=torch.int8), spec)


@pytest.mark.parametrize("spec", [None, "k4v2_g64", {"preset": "k4v2_g64"}])
def test_encode_and_decode_name_a_bad_spec(spec):
    with pytest.raises(TypeError, match=f"spec must be a kvarn_cutlass.TileSpec, got {type(spec).__name__}"):
        kc.encode_tiles(torch.zeros(64, 64), torch.zeros(64, 64), spec)
    with pytest.raises(TypeError, match="spec must be a kvarn_cutlass.TileSpec"):
        kc.decode_tiles(torch.zeros(kc.TileSpec("k4v2_g64", 64).tile_nbytes, dtype=torch.uint8), spec)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float16, torch.bfloat16,
                                   "float32", None, float])
def test_decode_rejects_a_dtype_it_cannot_compute_in(dtype):
    """Integer dtypes used to return zeros, complex was accepted, bool and strings failed deep inside."""
    spec = kc.TileSpec("k4v2_g64", 64)
    rec = kc.encode_tiles(torch.ones(64, 64), torch.ones(64, 64), spec)
    with pytest.raises(TypeError, match=r"^dtype"):
        kc.decode_tiles(rec, spec, dtype)
    with pytest.raises(TypeError, match=r"^dtype"):
        codec.dequantize_rotated(codec.unpack_fields(rec, spec), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_dtypes_agree(dtype):
    seed = 31
    g = torch.Generator().manual_seed(seed)
    spec = kc.TileSpec("k4v4_g64", 64)
    rec = kc.encode_tiles(torch.randn(2, 64, 64, generator=g), torch.randn(2, 64, 64, generator=g), spec)
    k64, v64 = kc.decode_tiles(rec, spec, torch.float64)
    k, v = kc.decode_tiles(rec, spec, dtype)
    assert k.dtype == v.dtype == dtype
    # float32 arithmetic on float16 fields: a few float32 ulps of the float64 reconstruction
    assert torch.allclose(k.double(), k64, rtol=1e-5, atol=1e-5), f"seed={seed}"
    assert torch.allclose(v.double(), v64, rtol=1e-5, atol=1e-5), f"seed={seed}"


# --- lloyd_max quantizer ---------------------------------------------------------------------------
QUANTIZERS = list(kc.format.QUANTIZERS)
# Half an ulp of the storage dtype, relative, and the smallest float16 subnormal's half (absolute).
STORE_REL = {torch.float16: 2.0**-11, torch.float32: 2.0**-24}
STORE_ABS = {torch.float16: 2.0**-25, torch.float32: 2.0**-150}


def _check_lloyd_max_axes(u: np.ndarray, step: np.ndarray, low: np.ndarray, codes: np.ndarray, bits: int, sd) -> None:
    """Check one record's axes against an independent float64 nearest-centroid quantizer.

    u: [rows, n] float64, each row one axis (a K channel over tokens or a V token over channels),
    computed in float64 from the input and the record's stored row/col scales; step, low: [rows]
    the stored fields; codes: [rows, n]. The codec computes u in float32 (its own WHT), so
    ``noise`` bounds |u_codec - u| and codes may differ only where z is that close to a decision
    midpoint, and then only by one.
    """
    book = np.array(kc.format.codebook("lloyd_max", bits))
    mids = (book[1:] + book[:-1]) / 2  # exact decision points of the nearest-centroid rule
    noise = 1e-6 * np.abs(u).max(1) + 1e-30
    rel, tiny = STORE_REL[sd], STORE_ABS[sd]
    mean = u.mean(1)
    assert (np.abs(low - mean) <= rel * np.abs(mean) + noise + tiny).all()
    rms = np.sqrt(((u - low[:, None]) ** 2).mean(1))  # about the stored centre, as the format says
    assert (np.abs(step - rms) <= rel * rms + 2 * noise + tiny).all()
    zero = step == 0
    assert (codes[zero] == 0).all()
    s = np.where(zero, 1.0, step)[:, None]
    z = (u - low[:, None]) / s
    ref = np.abs(z[..., None] - book).argmin(-1)
    near_tie = np.abs(z[..., None] - mids).min(-1) <= 4 * noise[:, None] / s + 1e-6 * np.abs(z)
    ok = (codes == ref) | (near_tie & (np.abs(codes.astype(np.int64) - ref) == 1))
    assert ok[~zero].all(), f"{(~ok[~zero]).sum()} codes are not the nearest centroid"
    # the per-axis reconstruction error equals the float64 quantizer's (the same up to near ties)
    err = lambda c: ((u - low[:, None] - step[:, None] * book[c]) ** 2).mean(1)  # noqa: E731
    e_codec, e_ref = err(codes), err(ref)
    slack = 8 * (noise + 1e-6 * np.abs(step)) * (np.abs(u).max(1) + np.abs(step) * book[-1])
    assert (np.abs(e_codec - e_ref) <= 1e-6 * e_ref + slack).all()


def _assert_lloyd_max_record(k: torch.Tensor, v: torch.Tensor, spec: kc.TileSpec) -> None:
    """Encode one tile with ``spec`` (lloyd_max) and check every axis; the normalization factors
    must be those of the uniform quantizer (only the quantizer differs)."""
    assert spec.quantizer == "lloyd_max"
    D = spec.head_dim
    rec = kc.encode_tiles(k, v, spec).numpy()
    uni = kc.encode_tiles(k, v, kc.TileSpec(spec.preset, D, spec.scale_dtype, spec.sinkhorn_iters)).numpy()
    for name in ("row_scale", "col_scale"):
        off, n = spec.section(name)
        assert (rec[off : off + n] == uni[off : off + n]).all(), name
    f = _raw_fields(rec, spec)
    assert f["k_codes"].max() < 2**spec.k_bits and f["v_codes"].max() < 2**spec.v_bits
    H = hadamard64(D).numpy()
    u_k = (k.double().numpy() @ H) / f["row_scale"][:, None]  # [T, D]; K axes are channels
    _check_lloyd_max_axes(u_k.T, f["chan_step"], f["chan_min"], f["k_codes"], spec.k_bits, spec.scale_dtype)
    u_v = (v.double().numpy() @ H) / f["col_scale"][None, :]  # [T, D]; V axes are tokens
    _check_lloyd_max_axes(u_v, f["tok_step"], f["tok_min"], f["v_codes"], spec.v_bits, spec.scale_dtype)


@pytest.mark.parametrize("preset", ["k4v2_g128", "k4v4_g128", "k4v2_g64"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_lloyd_max_codes_are_the_nearest_centroid(preset, head_dim, scale_dtype):
    spec = kc.TileSpec(preset, head_dim, scale_dtype, quantizer="lloyd_max")
    g = torch.Generator().manual_seed(head_dim * 7 + spec.v_bits + (scale_dtype == torch.float32))
    T = spec.tile_tokens
    _assert_lloyd_max_record(realistic_kv(T, head_dim, generator=g), realistic_kv(T, head_dim, generator=g), spec)


@pytest.mark.parametrize("preset", ["k4v2_g128", "k4v4_g64"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("case", list(_adversarial_tiles(64, 64)))
def test_lloyd_max_adversarial_tiles(preset, head_dim, case):
    spec = kc.TileSpec(preset, head_dim, quantizer="lloyd_max")
    x = _adversarial_tiles(spec.tile_tokens, head_dim)[case].to(torch.float16)
    _assert_lloyd_max_record(x, x, spec)
    k_hat, v_hat = kc.decode_tiles(kc.encode_tiles(x, x, spec), spec, torch.float64)
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    if case == "zeros":
        assert not k_hat.any() and not v_hat.any()
    if case in ("constant", "max_fp16_everywhere"):
        # one constant rotated channel (mean = the value, RMS 0) and zero channels: exact up to storage
        assert torch.allclose(k_hat, x.double(), rtol=2e-3, atol=1e-6)


def test_lloyd_max_float32_scales_huge_and_tiny_magnitudes():
    spec32 = kc.TileSpec("k4v2_g64", 64, torch.float32, quantizer="lloyd_max")
    g = torch.Generator().manual_seed(5)
    for magnitude in (3.0e10, 2.0**-60):
        x = torch.randn(64, 64, generator=g) * magnitude
        _assert_lloyd_max_record(x, x, spec32)
    spec16 = kc.TileSpec("k4v2_g64", 64, torch.float16, quantizer="lloyd_max")
    with pytest.raises(ValueError, match="scale_dtype=torch.float32"):
        kc.encode_tiles(torch.full((64, 64), 3.0e10), torch.zeros(64, 64), spec16)


def _tie_axis(bits: int, n: int) -> torch.Tensor:
    """An axis u [n] float32 whose stored centre is exactly 0 and stored RMS exactly 1, holding every
    threshold t_j and its two float32 neighbours: z = (u - 0) / 1 = u exactly, so every threshold
    is hit as an exact tie. The centre is an exact 0 because u[i + n/2] = -u[i] (the halving tree
    pairs them first); fillers +-b make the RMS 1 and b is nudged by ulps until the stored RMS is
    exactly 1.0 (checked by the caller on the codec's output)."""
    th = np.array(kc.format.lloyd_max_thresholds(bits), np.float32)
    pos = th[th >= 0]
    half = np.concatenate([pos, np.nextafter(pos, np.float32(np.inf)), np.nextafter(pos, np.float32(-np.inf))])
    fill = n // 2 - half.size
    assert fill > 0
    b = np.float32(np.sqrt((n - 2 * float((half.astype(np.float64) ** 2).sum())) / (2 * fill)))
    first = np.concatenate([half, np.full(fill, b, np.float32)])
    return torch.from_numpy(np.concatenate([first, -first]))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_lloyd_max_exact_ties_go_to_the_lower_code(bits, scale_dtype):
    n = 128
    u = _tie_axis(bits, n)
    fill_at = (u.numpy() == u.numpy()[n // 2 - 1]).nonzero()[0]
    for _ in range(200):  # nudge the fillers by ulps until the stored RMS is exactly 1
        step, low, codes = codec._quantize(u[None], bits, -1, scale_dtype, "axis", "lloyd_max")
        if step.item() == 1.0:
            break
        b = u[fill_at[0]].numpy()
        u[fill_at] = torch.from_numpy(np.nextafter(b, np.float32(0 if step.item() > 1 else np.inf))).float()
        u[fill_at + n // 2] = -u[fill_at]
    assert step.item() == 1.0 and low.item() == 0.0
    th = np.array(kc.format.lloyd_max_thresholds(bits), np.float64)
    z = u.double().numpy()
    want = (z[:, None] > th).sum(1)  # the format's rule, in float64 (exact for float32 z and t)
    assert (codes[0].numpy() == want).all()
    for j, t in enumerate(th):
        assert (codes[0].numpy()[z == t] == j).all() and (z == t).any()  # the tie: the lower of j, j+1
        assert (codes[0].numpy()[z == np.nextafter(np.float32(t), np.float32(np.inf))] == j + 1).all()


def test_lloyd_max_constant_axis_has_zero_step_and_code_zero():
    u = torch.tensor([[3.25] * 64, [-0.0] * 32 + [0.0] * 32, [1e-30] * 64], dtype=torch.float32)
    for bits in (2, 4):
        for sd in (torch.float16, torch.float32):
            step, low, codes = codec._quantize(u, bits, -1, sd, "axis", "lloyd_max")
            assert (step == 0).all() and not codes.any()
            assert low.tolist() == [3.25, 0.0, u[2, 0].to(sd).item()]
            assert str(low[1].item()) == "0.0"  # +0.0: mixed-sign zeros give one sign


def test_lloyd_max_beats_uniform_on_gaussian_2bit():
    """Lloyd-Max is MSE-optimal for a Gaussian: on Gaussian tiles (the rotated domain of
    Gaussian data is Gaussian) the 2-bit V error is lower than the uniform quantizer's."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 128, 128, generator=g)
    mse = {}
    for q in QUANTIZERS:
        spec = kc.TileSpec("k4v2_g128", 128, quantizer=q)
        _, v_hat = kc.decode_tiles(kc.encode_tiles(x, x, spec), spec, torch.float64)
        mse[q] = ((v_hat - x.double()) ** 2).mean().item()
    # Lloyd-Max 2-bit distortion of N(0, 1) is 0.1175; uniform min/max over 128 values is far worse.
    assert mse["lloyd_max"] < 0.8 * mse["uniform"]
    assert 0.10 < mse["lloyd_max"] < 0.14


@pytest.mark.parametrize("preset", PRESETS)
def test_lloyd_max_round_trip_and_batching(preset):
    spec = kc.TileSpec(preset, 128, quantizer="lloyd_max")
    g = torch.Generator().manual_seed(77)
    k = realistic_kv(2, 3, spec.tile_tokens, 128, generator=g)
    v = realistic_kv(2, 3, spec.tile_tokens, 128, generator=g)
    rec = kc.encode_tiles(k, v, spec)
    for i, j in ((0, 0), (1, 2)):
        assert torch.equal(rec[i, j], kc.encode_tiles(k[i, j], v[i, j], spec))
    k_hat, v_hat = kc.decode_tiles(rec, spec)
    rel = lambda a, b: ((a - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(k_hat, k) < ROUND_TRIP_BOUNDS[spec.k_bits]
    assert rel(v_hat, v) < ROUND_TRIP_BOUNDS[spec.v_bits]
    # decoding: min + step * codebook[code], times the row/col scale, inverse WHT (float64 here)
    f = _raw_fields(rec[1, 2].numpy(), spec)
    kb, vb = np.array(spec.k_codebook), np.array(spec.v_codebook)
    H = hadamard64(128).numpy()
    k_rot = f["row_scale"][:, None] * (f["chan_min"][None, :] + f["chan_step"][None, :] * kb[f["k_codes"].T])
    v_rot = f["col_scale"][None, :] * (f["tok_min"][:, None] + f["tok_step"][:, None] * vb[f["v_codes"]])
    k64, v64 = kc.decode_tiles(rec[1, 2], spec, torch.float64)
    assert np.allclose(k64.numpy(), k_rot @ H, rtol=1e-12, atol=1e-12)
    assert np.allclose(v64.numpy(), v_rot @ H, rtol=1e-12, atol=1e-12)


def test_uniform_and_lloyd_max_share_the_layout_but_not_the_codes():
    spec_u = kc.TileSpec("k4v2_g64", 64)
    spec_l = kc.TileSpec("k4v2_g64", 64, quantizer="lloyd_max")
    x = det_tile(64, 64, 1)
    ru, rl = kc.encode_tiles(x, x, spec_u), kc.encode_tiles(x, x, spec_l)
    assert ru.shape == rl.shape and not torch.equal(ru, rl)
    # decoding with the wrong quantizer gives a different (wrong) tile: the quantizer is part of the format
    assert not torch.allclose(kc.decode_tiles(rl, spec_u)[1], kc.decode_tiles(rl, spec_l)[1])
