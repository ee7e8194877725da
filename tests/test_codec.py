import hashlib

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


@pytest.mark.parametrize("preset", PRESETS)
def test_golden_bytes(preset):
    spec = kc.TileSpec(preset, 64)
    T = spec.tile_tokens
    rec = kc.encode_tiles(det_tile(T, 64, 1), det_tile(T, 64, 2), spec)
    assert rec.dtype == torch.uint8 and rec.shape == (spec.tile_nbytes,)
    assert hashlib.sha256(rec.numpy().tobytes()).hexdigest() == GOLDEN_SHA256[preset]


def _raw_fields(rec: np.ndarray, spec: kc.TileSpec) -> dict:
    """Parse one record with numpy only, straight from the documented layout (independent of codec)."""
    T, D = spec.tile_tokens, spec.head_dim
    sd = np.float16 if spec.scale_dtype == torch.float16 else np.float32

    def sec(name):
        off, n = spec.section(name)
        return rec[off : off + n]

    kb = sec("k_codes").reshape(D, T // 2)
    k_codes = np.empty((D, T), np.int64)
    k_codes[:, 0::2] = kb & 0xF
    k_codes[:, 1::2] = kb >> 4
    vb = sec("v_codes").reshape(T, -1).astype(np.int64)
    per = 8 // spec.v_bits
    v_codes = np.stack([(vb >> (spec.v_bits * j)) & ((1 << spec.v_bits) - 1) for j in range(per)], -1).reshape(T, D)
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
def test_encode_bad_input(k, v, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kc.encode_tiles(k, v, kc.TileSpec("k4v2_g64", 64))


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
