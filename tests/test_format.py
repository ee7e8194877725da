import math

import numpy as np
import pytest
import torch

import kvarn_cutlass as kc


def test_documented_sizes():
    spec = kc.TileSpec(preset="k4v2_g128", head_dim=128, scale_dtype=torch.float16)
    assert (spec.tile_tokens, spec.tile_nbytes, spec.bytes_per_token) == (128, 13824, 108.0)
    assert round(512 / spec.bytes_per_token, 2) == 4.74
    spec32 = kc.TileSpec(preset="k4v2_g128", head_dim=128, scale_dtype=torch.float32)
    assert (spec32.tile_nbytes, spec32.bytes_per_token) == (15360, 120.0)


@pytest.mark.parametrize("preset", list(kc.PRESETS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_sections_tile_the_record_in_order(preset, head_dim, scale_dtype):
    spec = kc.TileSpec(preset, head_dim, scale_dtype)
    T, D, sb = spec.tile_tokens, head_dim, spec.scale_bytes
    expected = {
        "k_codes": D * T // 2,
        "chan_step": D * sb,
        "chan_min": D * sb,
        "row_scale": T * sb,
        "v_codes": T * D * spec.v_bits // 8,
        "tok_step": T * sb,
        "tok_min": T * sb,
        "col_scale": D * sb,
    }
    assert spec.section_names() == list(expected)
    pos = 0
    for name, size in expected.items():
        assert spec.section(name) == (pos, size)
        assert pos % 16 == 0
        pos += size
    assert spec.tile_nbytes == pos and pos % 16 == 0
    assert spec.bytes_per_token == pos / T


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"preset": "k3v2_g128"}, "preset"),
        ({"head_dim": 96}, "head_dim"),
        ({"head_dim": 128.0}, "head_dim"),
        ({"scale_dtype": torch.bfloat16}, "scale_dtype"),
        ({"sinkhorn_iters": -1}, "sinkhorn_iters"),
        # unhashable or array-valued arguments: an error naming the argument, not "unhashable type"
        # or numpy's "truth value of an array is ambiguous"
        ({"preset": ["k4v2_g128"]}, r"preset=\['k4v2_g128'\] is not supported"),
        ({"preset": {"k4v2_g128": 1}}, "preset="),
        ({"preset": np.array(["k4v2_g128"])}, "preset="),
        ({"quantizer": ["uniform"]}, "quantizer="),
        ({"quantizer": np.array(["uniform", "lloyd_max"])}, "quantizer="),
        ({"scale_dtype": np.array([1, 2])}, "scale_dtype="),
        ({"scale_dtype": "float16"}, "scale_dtype="),
        ({"sinkhorn_iters": np.array([1, 2])}, "sinkhorn_iters"),
        ({"sinkhorn_iters": kc.format.MAX_SINKHORN_ITERS + 1}, "sinkhorn_iters"),
        ({"sinkhorn_iters": 10**6}, "sinkhorn_iters"),  # a hang in the codec before it had a bound
    ],
)
def test_bad_spec_names_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kc.TileSpec(**kwargs)


@pytest.mark.parametrize("kwargs", [{"preset": ["k4v2_g128"]}, {"quantizer": np.array(["uniform", "x"])}])
def test_cache_with_an_unhashable_spec_argument_names_it(kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}="):
        kc.KVarNCache(1, 1, 1, 128, **kwargs)


def test_sinkhorn_iters_bound_is_inclusive_and_reaches_the_cache():
    assert kc.TileSpec(sinkhorn_iters=kc.format.MAX_SINKHORN_ITERS).sinkhorn_iters == kc.format.MAX_SINKHORN_ITERS
    with pytest.raises(ValueError, match=r"sinkhorn_iters must be an int in \[0, 64\], got 1000000"):
        kc.KVarNCache(1, 1, 2, 128, sinkhorn_iters=10**6)


def test_unknown_section():
    with pytest.raises(KeyError, match="v_scale"):
        kc.TileSpec().section("v_scale")


# --- quantizer -------------------------------------------------------------------------------------
def _gauss_mass(a: float, b: float) -> float:
    """P(a < X < b) for X ~ N(0, 1) in float64, through erfc on the side away from 0 (no cancellation
    of two numbers close to 1 in the tails)."""
    if a >= 0:
        return 0.5 * (math.erfc(a / math.sqrt(2)) - math.erfc(b / math.sqrt(2)))
    if b <= 0:
        return _gauss_mass(-b, -a)
    return 0.5 * (math.erf(b / math.sqrt(2)) - math.erf(a / math.sqrt(2)))


def _gauss_pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _lloyd_max_float64(levels: int) -> list[float]:
    """The Lloyd iteration for N(0, 1) in float64 with exact integrals, from a uniform start on
    [-2, 2]: thresholds at centroid midpoints, centroids at the conditional means
    E[X | t_j < X < t_{j+1}] = (pdf(t_j) - pdf(t_{j+1})) / mass(t_j, t_{j+1})."""
    c = [-2 + 4 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(20000):
        t = [-math.inf] + [(a + b) / 2 for a, b in zip(c[:-1], c[1:])] + [math.inf]
        new = [(_gauss_pdf(t[i]) - _gauss_pdf(t[i + 1])) / _gauss_mass(t[i], t[i + 1]) for i in range(levels)]
        change, c = max(abs(x - y) for x, y in zip(new, c)), new
        if change < 1e-14:
            return c
    raise AssertionError("the Lloyd iteration did not converge")


@pytest.mark.parametrize("bits", [2, 4])
def test_lloyd_max_codebook_is_the_float16_rounded_gaussian_fixed_point(bits):
    book = kc.format.codebook("lloyd_max", bits)
    want = _lloyd_max_float64(2**bits)
    assert len(book) == 2**bits
    assert all(isinstance(c, float) and c == float(np.float16(c)) for c in book)  # exactly float16
    assert list(book) == [float(np.float16(c)) for c in want]
    assert max(abs(a - b) / abs(b) for a, b in zip(book, want)) < 2**-11  # half an f16 ulp
    assert list(book) == sorted(book) and list(book) == [-c for c in reversed(book)]
    # the values the issue quotes
    quoted = {2: (0.4528, 1.5104), 4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326)}[bits]
    assert np.allclose(book[2 ** (bits - 1):], quoted, atol=1e-3)  # half an f16 ulp at 2.7 is 1e-3


@pytest.mark.parametrize("bits", [2, 4])
def test_lloyd_max_thresholds_are_float32_midpoints(bits):
    book = kc.format.codebook("lloyd_max", bits)
    th = kc.format.lloyd_max_thresholds(bits)
    assert len(th) == 2**bits - 1
    for j, t in enumerate(th):
        mid = (book[j] + book[j + 1]) / 2  # exact in float64 for float32 inputs
        assert mid == (np.float64(book[j]) + np.float64(book[j + 1])) * 0.5
        assert t == float(np.float32(mid)) and book[j] < t < book[j + 1]


@pytest.mark.parametrize("bits", [2, 4])
def test_uniform_codebook_is_the_identity(bits):
    assert kc.format.codebook("uniform", bits) == tuple(float(c) for c in range(2**bits))


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (("lloyd", 4), ValueError, "quantizer"),
        (("lloyd_max", 3), ValueError, "bits"),
        (("uniform", 8), ValueError, "bits"),
        (("lloyd_max", 4.0), TypeError, "bits"),
        (("lloyd_max", True), TypeError, "bits"),
    ],
)
def test_codebook_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        kc.format.codebook(*args)
    if args[0] == "lloyd_max":
        with pytest.raises(exc, match=match):
            kc.format.lloyd_max_thresholds(args[1])


@pytest.mark.parametrize("bad", ["Lloyd_Max", "", None, 1])
def test_bad_quantizer_names_the_argument(bad):
    with pytest.raises(ValueError, match="quantizer"):
        kc.TileSpec(quantizer=bad)


def test_quantizer_is_part_of_identity_not_of_layout():
    uni, lm = kc.TileSpec(), kc.TileSpec(quantizer="lloyd_max")
    assert uni.quantizer == "uniform" and uni == kc.TileSpec(quantizer="uniform")
    assert uni != lm and len({uni, lm, kc.TileSpec(quantizer="lloyd_max")}) == 2
    assert lm == kc.TileSpec(quantizer="lloyd_max") and hash(lm) == hash(kc.TileSpec(quantizer="lloyd_max"))
    for preset in kc.PRESETS:
        for sd in (torch.float16, torch.float32):
            a, b = kc.TileSpec(preset, 128, sd), kc.TileSpec(preset, 128, sd, quantizer="lloyd_max")
            assert a.tile_nbytes == b.tile_nbytes
            assert [a.section(n) for n in a.section_names()] == [b.section(n) for n in b.section_names()]
            assert b.k_codebook == kc.format.codebook("lloyd_max", b.k_bits)
            assert b.v_codebook == kc.format.codebook("lloyd_max", b.v_bits)
    assert lm.describe()["quantizer"] == "lloyd_max" and "quantizer='lloyd_max'" in repr(lm)
