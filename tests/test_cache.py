import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvarn_cutlass as kc

from _helpers import assert_same_snapshot, realistic_kv, snapshot


def _stream(B, H, n, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return realistic_kv(B, H, n, D, generator=g), realistic_kv(B, H, n, D, generator=g)


def _fill(cache, layer, k, v, chunks):
    pos = 0
    for c in chunks:
        cache.append(layer, k[:, :, pos : pos + c], v[:, :, pos : pos + c])
        pos += c
    assert pos == k.shape[2]


def test_documented_api_and_tile_count_rule():
    cache = kc.KVarNCache(2, 2, 2, 128, preset="k4v2_g128", window=256, sink_tokens=0, dtype=torch.float16, device="cpu")
    k, v = _stream(2, 2, 700, 128)
    cache.append(1, k, v)
    assert cache.seq_len(1) == 700 and cache.seq_len(0) == 0
    assert cache.num_tiles(1) == math.ceil((700 - 256) / 128) == 4
    tb = cache.tile_bytes(1)
    assert tb.shape == (2, 4, 2, 13824) and tb.dtype == torch.uint8
    # Record [b, i, h] encodes tokens i*128 .. of sequence b, head h, exactly as encode_tiles does.
    rec = kc.encode_tiles(k[1, 0, 256:384], v[1, 0, 256:384], cache.spec)
    assert torch.equal(tb[1, 2, 0], rec)
    wk, wv = cache.window_kv(1)
    assert torch.equal(wk, k[:, :, 512:]) and torch.equal(wv, v[:, :, 512:])
    buf = cache.buffers(1)
    assert buf["window_k"].shape == (2, 2, 256, 128) and buf["sink_k"].shape == (2, 2, 0, 128)
    assert buf["window_k"].data_ptr() == wk.data_ptr() and torch.equal(buf["window_v"][:, :, :188], wv)
    assert cache.nbytes() == 4 * 2 * 2 * 13824 + 188 * 2 * 2 * 2 * 128 * 2


@pytest.mark.parametrize("preset, head_dim", [("k4v2_g128", 128), ("k4v4_g64", 64), ("k4v2_g64", 256)])
def test_rechunking_gives_identical_tiles(preset, head_dim):
    k, v = _stream(1, 2, 640, head_dim, seed=3)
    splits = {
        "one_call": [640],
        "300_340": [300, 340],
        "token_by_token": [1] * 640,
    }
    # Chunks of 44 and 84 alternating, trimmed to 640 tokens.
    chunks, total = [], 0
    for c in [44, 84] * 10:
        c = min(c, 640 - total)
        if c:
            chunks.append(c)
            total += c
    splits["44_84"] = chunks
    results = {}
    for name, chunks in splits.items():
        cache = kc.KVarNCache(1, 1, 2, head_dim, preset=preset, window=128 if preset.endswith("128") else 64)
        _fill(cache, 0, k, v, chunks)
        results[name] = (cache.tile_bytes(0).clone(), *[t.clone() for t in cache.window_kv(0)])
    ref = results["one_call"]
    assert ref[0].shape[1] > 0
    for name, got in results.items():
        for a, b in zip(ref, got):
            assert torch.equal(a, b), name


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 150), min_size=1, max_size=12),
    sink=st.sampled_from([0, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rechunking_property(chunks, sink, seed):
    n = sum(chunks)
    k, v = _stream(1, 1, n, 64, seed=seed % 1000)
    one = kc.KVarNCache(1, 1, 1, 64, preset="k4v4_g64", window=64, sink_tokens=sink)
    one.append(0, k, v)
    many = kc.KVarNCache(1, 1, 1, 64, preset="k4v4_g64", window=64, sink_tokens=sink)
    _fill(many, 0, k, v, chunks)
    assert one.seq_len(0) == many.seq_len(0) == n
    assert one.positions(0) == many.positions(0)
    assert torch.equal(one.tile_bytes(0), many.tile_bytes(0))
    for a, b in zip(one.window_kv(0) + one.sink_kv(0), many.window_kv(0) + many.sink_kv(0)):
        assert torch.equal(a, b)


def test_sink_tokens_stay_unquantized():
    k, v = _stream(1, 2, 600, 64)
    cache = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=128, sink_tokens=128)
    _fill(cache, 0, k, v, [100, 1, 499])
    sk, sv = cache.sink_kv(0)
    assert torch.equal(sk, k[:, :, :128]) and torch.equal(sv, v[:, :, :128])
    assert cache.positions(0) == {"sink": (0, 128), "tiles": (128, 128 + 64 * 6), "window": (512, 600)}
    assert torch.equal(cache.tile_bytes(0)[0, 0, 1], kc.encode_tiles(k[0, 1, 128:192], v[0, 1, 128:192], cache.spec))


def test_growth_and_preallocation_agree():
    k, v = _stream(1, 1, 2000, 64)
    grow = kc.KVarNCache(1, 1, 1, 64, preset="k4v2_g64", window=64)
    fixed = kc.KVarNCache(1, 1, 1, 64, preset="k4v2_g64", window=64, max_seq_len=2000)
    assert fixed.tile_pool(0).shape[1] == math.ceil(2000 / 64)
    _fill(grow, 0, k, v, [7] * 100 + [1300])
    _fill(fixed, 0, k, v, [2000])
    assert torch.equal(grow.tile_bytes(0), fixed.tile_bytes(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        fixed.append(0, k[:, :, :1], v[:, :, :1])


def test_float32_input_is_stored_as_cache_dtype():
    k, v = _stream(1, 1, 200, 64)
    a = kc.KVarNCache(1, 1, 1, 64, preset="k4v2_g64", window=64)
    b = kc.KVarNCache(1, 1, 1, 64, preset="k4v2_g64", window=64)
    a.append(0, k, v)
    b.append(0, k.float(), v.float())
    assert torch.equal(a.tile_bytes(0), b.tile_bytes(0))


def test_truncate_within_window_and_not_into_tiles():
    k, v = _stream(1, 2, 400, 64)
    cache = kc.KVarNCache(2, 1, 2, 64, preset="k4v2_g64", window=128)
    for layer in range(2):
        cache.append(layer, k[:, :, :300], v[:, :, :300])
    tiles_end = cache.positions(0)["tiles"][1]
    assert tiles_end == 192
    before = snapshot(cache)
    with pytest.raises(ValueError, match="rewinds layer 0 into compressed tiles"):
        cache.truncate(None, tiles_end - 1)
    with pytest.raises(ValueError, match="exceeds"):
        cache.truncate(1, 301)
    with pytest.raises(ValueError, match="layer"):
        cache.truncate(2, 250)
    assert_same_snapshot(before, snapshot(cache))
    cache.truncate(None, 250)
    assert cache.seq_len(0) == cache.seq_len(1) == 250
    # Appending after a rewind behaves as if the dropped tokens had never been appended.
    k2, v2 = _stream(1, 2, 150, 64, seed=9)
    cache.append(0, k2, v2)
    fresh = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=128)
    fresh.append(0, torch.cat((k[:, :, :250], k2), 2), torch.cat((v[:, :, :250], v2), 2))
    assert torch.equal(cache.tile_bytes(0), fresh.tile_bytes(0))
    assert all(torch.equal(a, b) for a, b in zip(cache.window_kv(0), fresh.window_kv(0)))


def test_truncate_into_sink_without_tiles():
    k, v = _stream(1, 1, 100, 64)
    cache = kc.KVarNCache(1, 1, 1, 64, preset="k4v2_g64", window=64, sink_tokens=64)
    cache.append(0, k, v)
    cache.truncate(0, 10)
    assert cache.seq_len(0) == 10 and cache.positions(0)["sink"] == (0, 10)
    cache.append(0, k[:, :, 10:], v[:, :, 10:])
    assert torch.equal(cache.sink_kv(0)[0], k[:, :, :64]) and torch.equal(cache.window_kv(0)[0], k[:, :, 64:])


def _bad_append_cases():
    B, H, D = 1, 2, 64
    good = torch.randn(B, H, 5, D)
    nan = good.clone()
    nan[0, 1, 2, 3] = float("nan")
    inf = good.clone()
    inf[0, 0, 0, 0] = float("inf")
    big = good.clone()
    big[0, 0, 4, 0] = 1e6  # finite in float32, overflows the float16 cache
    return [
        ((5, good, good), ValueError, "layer"),
        (("0", good, good), ValueError, "layer"),
        ((0, good.numpy(), good), TypeError, "k must be a torch.Tensor"),
        ((0, good.to(torch.int32), good), TypeError, "k has dtype"),
        ((0, good, good.double()), TypeError, "v has dtype"),
        ((0, torch.randn(B, H, 5, 128), torch.randn(B, H, 5, 128)), ValueError, "head_dim=64"),
        ((0, torch.randn(2, H, 5, D), torch.randn(2, H, 5, D)), ValueError, "batch=1"),
        ((0, torch.randn(B, 3, 5, D), torch.randn(B, 3, 5, D)), ValueError, "num_kv_heads=2"),
        ((0, torch.randn(B, H, 0, D), torch.randn(B, H, 0, D)), ValueError, "n_new>=1"),
        ((0, good, torch.randn(B, H, 4, D)), ValueError, "same shape"),
        ((0, good.to("meta"), good), ValueError, "k is on meta"),
        ((0, nan, good), ValueError, "k contains NaN or Inf"),
        ((0, good, inf), ValueError, "v contains NaN or Inf"),
        ((0, big, good), ValueError, "k contains NaN or Inf"),
    ]


@pytest.mark.parametrize("args, exc, match", _bad_append_cases())
def test_bad_append_leaves_cache_unchanged(args, exc, match):
    cache = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, sink_tokens=64)
    k, v = _stream(1, 2, 150, 64)
    cache.append(0, k, v)
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        cache.append(*args)
    assert_same_snapshot(before, snapshot(cache))


def test_failed_compression_leaves_cache_unchanged():
    """bf16 values beyond float16 scale range fail inside compression, after validation."""
    cache = kc.KVarNCache(1, 1, 1, 64, preset="k4v2_g64", window=64, dtype=torch.bfloat16)
    cache.append(0, *_stream(1, 1, 100, 64))
    before = snapshot(cache)
    huge = torch.full((1, 1, 64, 64), 1e12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale_dtype=torch.float32"):
        cache.append(0, huge, huge)
    assert_same_snapshot(before, snapshot(cache))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"head_dim": 96}, ValueError, "head_dim"),
        ({"preset": "k2v2_g128"}, ValueError, "preset"),
        ({"dtype": torch.float32}, TypeError, "dtype"),
        ({"window": 100}, ValueError, "window"),
        ({"window": 0}, ValueError, "window"),
        ({"sink_tokens": 50}, ValueError, "sink_tokens"),
        ({"num_layers": 0}, ValueError, "num_layers"),
        ({"batch_size": 1.5}, ValueError, "batch_size"),
        ({"scale_dtype": torch.bfloat16}, ValueError, "scale_dtype"),
        ({"max_seq_len": -4}, ValueError, "max_seq_len"),
        ({"quantizer": "lloydmax"}, ValueError, "quantizer"),
        ({"device": "gpu"}, ValueError, "device='gpu' is not a device"),
        ({"device": None}, TypeError, "device must be a str, torch.device or CUDA device index, got NoneType"),
        ({"device": 1.5}, TypeError, "device must be"),
    ],
)
def test_bad_construction(kwargs, exc, match):
    args = dict(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=128)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        kc.KVarNCache(**args)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), torch.device("cpu")])
def test_every_spelling_of_the_cpu_is_one_device(device):
    """torch.device("cpu:0") != torch.device("cpu") although CPU tensors are all on "cpu": a cache
    built with "cpu:0" used to reject every append."""
    seed = 41
    k, v = _stream(1, 2, 300, 64, seed=seed)
    cache = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, device=device)
    plain = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, device="cpu")
    assert cache.device == torch.device("cpu") == k.device
    cache.append(0, k, v)
    plain.append(0, k, v)
    assert cache.num_tiles(0) == 4 and torch.equal(cache.tile_bytes(0), plain.tile_bytes(0)), f"seed={seed}"
    assert "device=cpu)" in repr(cache)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without a usable CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_without_a_gpu_names_the_device(device):
    # a CPU-only torch raises a bare AssertionError("Torch not compiled with CUDA enabled") here
    with pytest.raises(ValueError, match=r"device=.*cuda.* cannot be used here .*torch.cuda.is_available\(\) is False"):
        kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, device=device)


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_quantizer_keyword_fixes_the_tile_bytes(quantizer):
    cache = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, quantizer=quantizer)
    assert cache.quantizer == quantizer and cache.spec == kc.TileSpec("k4v2_g64", 64, quantizer=quantizer)
    assert f"quantizer={quantizer!r}" in repr(cache)
    k, v = _stream(1, 2, 300, 64, seed=9)
    for chunk in (k[:, :, :77], v[:, :, :77]), (k[:, :, 77:], v[:, :, 77:]):
        cache.append(0, *chunk)
    tb = cache.tile_bytes(0)  # [1, 4, 2, nbytes]: tiles of tokens 0..255, window 256..299
    assert tb.shape[1] == 4
    for i in range(4):
        for h in range(2):
            want = kc.encode_tiles(k[0, h, 64 * i : 64 * (i + 1)], v[0, h, 64 * i : 64 * (i + 1)], cache.spec)
            assert torch.equal(tb[0, i, h], want)
    other = kc.TileSpec("k4v2_g64", 64, quantizer="lloyd_max" if quantizer == "uniform" else "uniform")
    assert not torch.equal(tb[0, 0, 0], kc.encode_tiles(k[0, 0, :64], v[0, 0, :64], other))


def test_sizes_against_fp16():
    cache = kc.KVarNCache(1, 1, 8, 128, window=128, max_seq_len=128 * 65)
    k, v = _stream(1, 8, 128 * 65, 128)
    cache.append(0, k, v)
    tiles = 64 * 8 * 13824
    window = 128 * 8 * 2 * 128 * 2
    assert cache.nbytes() == tiles + window
    # 64 tiles plus a one-tile fp16 window: 4.48x smaller than fp16 (4.74x for the tiles alone).
    assert (128 * 65 * 8 * 2 * 128 * 2) / cache.nbytes() > 4.45


# ---------------------------------------------------------------------------------------------
# deferred_checks: appends without a host synchronization per call
def _valid_state(cache) -> list:
    """What a cache holds that reads can see: lengths and the valid prefixes of its buffers."""
    return [
        (st.n_tiles, st.window_len, st.sink_len, st.tiles[:, : st.n_tiles].clone(),
         st.window_k[:, :, : st.window_len].clone(), st.window_v[:, :, : st.window_len].clone(),
         st.sink_k[:, :, : st.sink_len].clone(), st.sink_v[:, :, : st.sink_len].clone())
        for st in cache._layers
    ]


def _assert_same_state(a: list, b: list) -> None:
    for la, lb in zip(a, b, strict=True):
        assert la[:3] == lb[:3]
        for ta, tb in zip(la[3:], lb[3:]):
            assert ta.shape == tb.shape and torch.equal(ta, tb)


def _deferred_cache():
    return kc.KVarNCache(2, 1, 2, 64, preset="k4v2_g64", window=64, sink_tokens=64, dtype=torch.float16)


@pytest.mark.parametrize("chunks", [[100, 90, 1, 70], [64, 64, 64]])
def test_deferred_checks_same_state_as_eager(chunks):
    gen = torch.Generator().manual_seed(21)
    kv = [(realistic_kv(1, 2, n, 64, generator=gen), realistic_kv(1, 2, n, 64, generator=gen)) for n in chunks]
    eager, deferred = _deferred_cache(), _deferred_cache()
    for layer in range(2):
        for k, v in kv:
            eager.append(layer, k, v)
    with deferred.deferred_checks():
        for layer in range(2):
            for k, v in kv:
                deferred.append(layer, k, v)
    _assert_same_state(_valid_state(eager), _valid_state(deferred))


@pytest.mark.parametrize("bad", ["k", "v"])
def test_deferred_checks_raise_at_exit_and_restore(bad):
    gen = torch.Generator().manual_seed(22)
    c = _deferred_cache()
    c.append(0, realistic_kv(1, 2, 150, 64, generator=gen), realistic_kv(1, 2, 150, 64, generator=gen))
    c.append(1, realistic_kv(1, 2, 70, 64, generator=gen), realistic_kv(1, 2, 70, 64, generator=gen))
    before = _valid_state(c)
    k, v = realistic_kv(1, 2, 130, 64, generator=gen), realistic_kv(1, 2, 130, 64, generator=gen)
    (k if bad == "k" else v)[0, 1, 129, 5] = float("nan")  # stays in the window: only the deferred flag sees it
    with pytest.raises(ValueError, match=rf"^{bad} contains NaN or Inf .*deferred_checks.*restored"):
        with c.deferred_checks():
            c.append(0, realistic_kv(1, 2, 90, 64, generator=gen), realistic_kv(1, 2, 90, 64, generator=gen))
            c.append(1, k, v)  # no exception here: the check is deferred
            c.append(1, realistic_kv(1, 2, 10, 64, generator=gen), realistic_kv(1, 2, 10, 64, generator=gen))
            assert c.seq_len(1) == 70 + 130 + 10
    _assert_same_state(before, _valid_state(c))
    # a NaN that reaches the compression: on the CPU the codec raises at once, the block restores
    k2, v2 = realistic_kv(1, 2, 130, 64, generator=gen), realistic_kv(1, 2, 130, 64, generator=gen)
    (k2 if bad == "k" else v2)[0, 0, 3, 1] = float("inf")
    with pytest.raises(ValueError, match=rf"^{bad} contains NaN or Inf"):
        with c.deferred_checks():
            c.append(1, k2, v2)
    _assert_same_state(before, _valid_state(c))
    # the cache keeps working, eager and deferred
    c.append(1, realistic_kv(1, 2, 60, 64, generator=gen), realistic_kv(1, 2, 60, 64, generator=gen))
    with c.deferred_checks():
        c.append(1, realistic_kv(1, 2, 5, 64, generator=gen), realistic_kv(1, 2, 5, 64, generator=gen))
    assert c.seq_len(1) == 70 + 60 + 5


def test_deferred_block_reports_its_first_failing_append():
    """The device kernels skip every append after a failed one (the flag is set), so a block's error names the first
    failing append's problems only; the CPU path reports the same, not the union with later appends'."""
    gen = torch.Generator().manual_seed(23)
    c = _deferred_cache()
    c.append(0, realistic_kv(1, 2, 20, 64, generator=gen), realistic_kv(1, 2, 20, 64, generator=gen))
    before = _valid_state(c)
    k1, v1 = realistic_kv(1, 2, 10, 64, generator=gen), realistic_kv(1, 2, 10, 64, generator=gen)
    v1[0, 0, 4, 2] = float("nan")
    k2, v2 = realistic_kv(1, 2, 10, 64, generator=gen), realistic_kv(1, 2, 10, 64, generator=gen)
    k2[0, 1, 7, 3] = float("inf")
    with pytest.raises(ValueError) as info:
        with c.deferred_checks():
            c.append(0, k1, v1)
            c.append(1, k2, v2)
    assert str(info.value).startswith("v contains NaN or Inf") and "k contains" not in str(info.value), info.value
    _assert_same_state(before, _valid_state(c))


def test_deferred_checks_restore_when_the_block_raises_and_do_not_nest():
    gen = torch.Generator().manual_seed(23)
    c = _deferred_cache()
    c.append(0, realistic_kv(1, 2, 100, 64, generator=gen), realistic_kv(1, 2, 100, 64, generator=gen))
    before = _valid_state(c)
    with pytest.raises(KeyError):
        with c.deferred_checks():
            c.append(0, realistic_kv(1, 2, 200, 64, generator=gen), realistic_kv(1, 2, 200, 64, generator=gen))
            c.truncate(0, c.seq_len(0) - 10)
            raise KeyError("user code failed")
    _assert_same_state(before, _valid_state(c))
    with pytest.raises(ValueError, match="head_dim=64"):  # host-side checks still raise at once
        with c.deferred_checks():
            c.append(0, torch.zeros(1, 2, 3, 32, dtype=torch.float16), torch.zeros(1, 2, 3, 32, dtype=torch.float16))
    with c.deferred_checks():
        with pytest.raises(RuntimeError, match="do not nest"):
            with c.deferred_checks():
                pass
    _assert_same_state(before, _valid_state(c))


# ---------------------------------------------------------------------------------------------
# replace_layers: all or nothing
def _replace_cache():
    """Two layers, no max_seq_len: layer 0 holds 2 tiles (capacity 8 after growth), layer 1 none."""
    gen = torch.Generator().manual_seed(31)
    c = kc.KVarNCache(2, 1, 2, 64, preset="k4v2_g64", window=64, sink_tokens=64)
    c.append(0, realistic_kv(1, 2, 64 + 2 * 64 + 40, 64, generator=gen), realistic_kv(1, 2, 232, 64, generator=gen))
    c.append(1, realistic_kv(1, 2, 90, 64, generator=gen), realistic_kv(1, 2, 90, 64, generator=gen))
    return c


def _bad_kv(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _stream(1, 2, n, 64, seed=32)
    if kind == "shape":
        return k, v[:, :, :-1]
    if kind == "dtype":
        return k.to(torch.int32), v
    k[0, 1, 100, 7] = float("nan")  # inside a compressed tile
    return k, v


@pytest.mark.parametrize("kind, exc, match", [("shape", ValueError, "same shape"), ("dtype", TypeError, "k has dtype"),
                                              ("nan", ValueError, "k contains NaN or Inf")])
def test_replace_layers_bad_later_layer_changes_no_layer(kind, exc, match):
    c = _replace_cache()
    before = snapshot(c)
    good = _stream(1, 2, 64 + 20 * 64 + 10, 64, seed=33)  # needs 20 tiles: more than layer 0 holds
    with pytest.raises(exc, match=match):
        c.replace_layers({0: good, 1: _bad_kv(kind, 400)})
    assert_same_snapshot(before, snapshot(c))


def test_replace_layers_failed_growth_changes_no_layer(monkeypatch):
    """An allocation that fails (out of memory) on the second layer leaves the first layer as it was."""
    c = _replace_cache()
    before = _valid_state(c)
    grow, calls = c._grow, []

    def grow_then_fail(st, needed):
        calls.append(needed)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("simulated allocation failure")
        grow(st, needed)

    monkeypatch.setattr(c, "_grow", grow_then_fail)
    contents = {0: _stream(1, 2, 64 + 20 * 64 + 10, 64, seed=34), 1: _stream(1, 2, 64 + 12 * 64 + 3, 64, seed=35)}
    with pytest.raises(torch.OutOfMemoryError):
        c.replace_layers(contents)
    assert calls == [20, 12]
    _assert_same_state(before, _valid_state(c))


def test_replace_layers_grows_a_pool_and_equals_a_fresh_append():
    c = _replace_cache()
    capacity = [st.tiles.shape[1] for st in c._layers]
    contents = {0: _stream(1, 2, 64 + 20 * 64 + 10, 64, seed=36), 1: _stream(1, 2, 64 + 3 * 64 + 70, 64, seed=37)}
    assert 20 > capacity[0]  # the replacement needs more tiles than layer 0 has allocated
    c.replace_layers(contents)
    fresh = kc.KVarNCache(2, 1, 2, 64, preset="k4v2_g64", window=64, sink_tokens=64)
    for layer, (k, v) in contents.items():
        fresh.append(layer, k, v)
    _assert_same_state(_valid_state(fresh), _valid_state(c))
    assert [c.seq_len(i) for i in range(2)] == [64 + 20 * 64 + 10, 64 + 3 * 64 + 70]
    assert c._layers[0].tiles.shape[1] >= 20
