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
    ],
)
def test_bad_spec_names_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kc.TileSpec(**kwargs)


def test_unknown_section():
    with pytest.raises(KeyError, match="v_scale"):
        kc.TileSpec().section("v_scale")
