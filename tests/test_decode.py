"""CPU tests of decode: every shipped kernel variant compiles (NVRTC, sm_90 and sm_80), the host
mirror of the kernel's record layout matches kvarn_cutlass.format, argument validation."""

from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import decode
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, SCALE_DTYPES, TileSpec
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
    assert len(fams["decode"]) == len(PRESETS) * len(HEAD_DIMS) * len(SCALE_DTYPES)


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
