"""SnapKV compaction (kvarn_cutlass.compact) on the CPU.

References: the kept tokens' values come from an independent float64 decode (the record fields
through an explicit Hadamard matrix, not the codec's butterfly), the kept set from a loop-level
float64 re-implementation of scoring, pooling and top-k, and the compacted layer must be byte for
byte what a fresh cache holds after appending [sink | kept tokens | window] in random chunks.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import codec
from kvarn_cutlass.compact import Compaction, QueryRecorder, snapkv_compact, snapkv_scores

from _helpers import SHARED, assert_same_snapshot, hadamard64, realistic_kv, snapshot


def _filled_cache(preset, head_dim, n, *, layers=2, batch=2, kv_heads=2, window=None, sink=None, seed=0,
                  quantizer="uniform"):
    spec = kc.TileSpec(preset, head_dim)
    T = spec.tile_tokens
    window = T if window is None else window
    sink = T if sink is None else sink
    cache = kc.KVarNCache(layers, batch, kv_heads, head_dim, preset=preset, window=window, sink_tokens=sink,
                          quantizer=quantizer)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for layer in range(layers):
        k = realistic_kv(batch, kv_heads, n, head_dim, generator=g)
        v = realistic_kv(batch, kv_heads, n, head_dim, generator=g)
        _append_in_chunks(cache, layer, k, v, rng)
    return cache


def _append_in_chunks(cache, layer, k, v, rng):
    pos, n = 0, k.shape[2]
    while pos < n:
        c = min(n - pos, rng.choice([1, 7, 64, 100, 333]))
        cache.append(layer, k[:, :, pos : pos + c], v[:, :, pos : pos + c])
        pos += c


def _queries(cache, obs, group=2, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(cache.batch_size, cache.num_kv_heads * group, obs, cache.head_dim, generator=g).to(dtype)
            for _ in range(cache.num_layers)]


def _decode64(rec, spec):
    """Records [B, nt, H, nbytes] -> k, v float64 [B, H, nt*T, D] in the original domain, from the
    documented field formulas (codes through the quantizer's codebook) and an explicit Hadamard matrix."""
    f = codec.unpack_fields(rec, spec)
    d = lambda x: x.double()  # noqa: E731
    kval = torch.tensor(spec.k_codebook, dtype=torch.float64)[f.k_codes.long()].transpose(-1, -2)
    vval = torch.tensor(spec.v_codebook, dtype=torch.float64)[f.v_codes.long()]
    k_rot = d(f.row_scale)[..., :, None] * (d(f.chan_min)[..., None, :] + d(f.chan_step)[..., None, :] * kval)
    v_rot = d(f.col_scale)[..., None, :] * (d(f.tok_min)[..., :, None] + d(f.tok_step)[..., :, None] * vval)
    Hm = hadamard64(spec.head_dim)
    B, nt, H, T, D = k_rot.shape
    flat = lambda x: (x @ Hm).permute(0, 2, 1, 3, 4).reshape(B, H, nt * T, D)  # noqa: E731
    return flat(k_rot), flat(v_rot)


def _gather(x, idx):
    return torch.stack([torch.stack([x[b, h, idx[b, h]] for h in range(x.shape[1])]) for b in range(x.shape[0])])


def _layer_state(cache, layer):
    return (cache.positions(layer), cache.tile_bytes(layer).clone(), *[t.clone() for t in cache.sink_kv(layer)],
            *[t.clone() for t in cache.window_kv(layer)])


def _assert_same_layer(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:]):
        assert x.shape == y.shape and torch.equal(x, y)


# --- byte identity with a fresh encoding -------------------------------------------------------
@pytest.mark.parametrize(
    "preset, head_dim, window_tiles, keep_frac, pool, quantizer",
    [
        ("k4v4_g128", 128, 2, 0.5, "avg", "uniform"),
        ("k4v2_g64", 64, 1, 0.35, "max", "uniform"),
        ("k4v2_g128", 64, 1, 0.4, "avg", "uniform"),
        ("k4v4_g64", 128, 3, 0.5, "max", "uniform"),
        ("k4v2_g128", 128, 2, 0.5, "avg", "lloyd_max"),
    ],
)
def test_compacted_layers_equal_a_fresh_encoding_of_the_kept_tokens(preset, head_dim, window_tiles, keep_frac, pool,
                                                                    quantizer):
    T = kc.TileSpec(preset, head_dim).tile_tokens
    n = T + 9 * T + window_tiles * T - 5  # sink, 9 tiles, a window 5 tokens short of full
    cache = _filled_cache(preset, head_dim, n, layers=3, window=window_tiles * T, sink=T, seed=len(preset) + head_dim,
                          quantizer=quantizer)
    before = [_layer_state(cache, layer) for layer in range(3)]
    L = cache.seq_len(0)
    keep = int(keep_frac * L)
    queries = _queries(cache, obs=16)
    res = snapkv_compact(cache, {0: queries[0], 2: queries[2]}, keep, pool=pool)
    assert isinstance(res, Compaction) and set(res.kept) == {0, 2} and set(res.evicted) == {0, 2}
    _assert_same_layer(_layer_state(cache, 1), before[1])  # not named: untouched

    for layer in (0, 2):
        pos, rec, sink_k, sink_v, win_k, win_v = before[layer]
        n_keep = T * ((keep - sink_k.shape[2] - win_k.shape[2]) // T)
        assert n_keep > 0  # the case keeps some tiles
        kept = res.kept[layer]
        assert kept.shape == (2, 2, n_keep) and kept.dtype == torch.int64
        assert torch.all(kept[..., 1:] > kept[..., :-1])  # original order, no repeats
        assert kept.min() >= pos["tiles"][0] and kept.max() < pos["tiles"][1]
        assert res.evicted[layer] == L - cache.seq_len(layer) == (pos["tiles"][1] - pos["tiles"][0]) - n_keep
        assert cache.seq_len(layer) <= keep

        tile_k, tile_v = _decode64(rec, cache.spec)
        idx = kept - pos["tiles"][0]
        big = torch.finfo(torch.float16).max
        kept_k = _gather(tile_k, idx).clamp(-big, big).half()
        kept_v = _gather(tile_v, idx).clamp(-big, big).half()
        fresh = kc.KVarNCache(1, 2, 2, head_dim, preset=preset, window=window_tiles * T, sink_tokens=T, quantizer=quantizer)
        _append_in_chunks(fresh, 0, torch.cat((sink_k, kept_k, win_k), 2), torch.cat((sink_v, kept_v, win_v), 2),
                          random.Random(layer))
        _assert_same_layer(_layer_state(cache, layer), _layer_state(fresh, 0))
        # the window is the old one, and the new tiles are exactly encode_tiles of the kept tokens
        assert torch.equal(cache.window_kv(layer)[0], win_k)
        tiles = lambda x: x.reshape(2, 2, n_keep // T, T, head_dim).transpose(1, 2)  # noqa: E731
        if n_keep:
            assert torch.equal(cache.tile_bytes(layer), kc.encode_tiles(tiles(kept_k), tiles(kept_v), cache.spec))


@pytest.mark.parametrize("preset", sorted(kc.PRESETS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_never_refuses_a_kvarn_cache(preset, head_dim):
    """Every preset x head_dim, with and without a sink, batch 1, one layer, a partial window."""
    T = kc.TileSpec(preset, head_dim).tile_tokens
    for sink in (0, T):
        cache = _filled_cache(preset, head_dim, sink + 4 * T + T // 2, layers=1, batch=1, kv_heads=1, window=T,
                              sink=sink, seed=sink)
        L, win = cache.seq_len(0), cache.window_kv(0)[0].clone()
        res = snapkv_compact(cache, _queries(cache, obs=T // 2, group=1), sink + T + win.shape[2], kernel_size=1)
        assert cache.num_tiles(0) == 1 and cache.seq_len(0) == L - res.evicted[0] == sink + T + win.shape[2]
        assert torch.equal(cache.window_kv(0)[0], win)


# --- the kept set against an independent float64 implementation ---------------------------------
def _kept_reference(cache, queries, keep, pool, kernel_size, scale=None):
    """Loop-level float64 SnapKV selection for one layer; returns [B][H] lists of kept positions."""
    B, Hq, n_obs, D = queries.shape
    H = cache.num_kv_heads
    group = Hq // H
    scale = 1 / math.sqrt(D) if scale is None else scale
    pos = cache.positions(0)
    t0, t1 = pos["tiles"]
    tile_k, _ = _decode64(cache.tile_bytes(0), cache.spec)
    sink_k, _ = cache.sink_kv(0)
    win_k, _ = cache.window_kv(0)
    L = cache.seq_len(0)
    T = cache.spec.tile_tokens
    n_keep = T * ((keep - (L - (t1 - t0))) // T)
    out = []
    for b in range(B):
        row = []
        for h in range(H):
            keys = torch.cat((sink_k[b, h].double(), tile_k[b, h], win_k[b, h].double()))  # [L, D]
            votes = [0.0] * (t1 - t0)
            for qh in range(h * group, (h + 1) * group):
                for i in range(n_obs):
                    visible = L - n_obs + i + 1
                    logits = (keys[:visible] @ queries[b, qh, i].double()) * scale
                    p = torch.exp(logits - logits.max())
                    p = p / p.sum()
                    for t in range(t0, min(t1, visible)):
                        votes[t - t0] += p[t].item()
            r = kernel_size // 2
            pooled = []
            for t in range(len(votes)):
                near = votes[max(0, t - r) : t + r + 1]
                pooled.append(max(near) if pool == "max" else sum(near) / kernel_size)
            best = sorted(range(len(pooled)), key=lambda t: (-pooled[t], t))[:n_keep]
            row.append(sorted(t + t0 for t in best))
        out.append(row)
    return out, pooled


@pytest.mark.parametrize("pool, kernel_size", [("avg", 7), ("max", 7), ("max", 3), ("avg", 1)])
def test_kept_set_matches_float64_reimplementation(pool, kernel_size):
    cache = _filled_cache("k4v2_g64", 64, 64 + 6 * 64 + 50, layers=1, window=64, sink=64, seed=11)
    # obs 80 > window_len 50: some observation queries sit on tile tokens (the causal mask matters)
    q = _queries(cache, obs=80, seed=int(kernel_size))[0] * 3.0
    keep = cache.seq_len(0) // 2
    expected, _ = _kept_reference(cache, q, keep, pool, kernel_size, scale=0.2)
    pooled = snapkv_scores(cache, 0, q, pool=pool, kernel_size=kernel_size, scale=0.2, score_dtype=torch.float64)
    assert pooled.shape == (2, 2, 6 * 64) and pooled.dtype == torch.float64
    res = snapkv_compact(cache, [q], keep, pool=pool, kernel_size=kernel_size, scale=0.2, score_dtype=torch.float64)
    assert res.kept[0].tolist() == expected
    if pool == "max" and kernel_size == 7:  # max pooling makes ties: the earlier token must win them
        vals = torch.sort(pooled[0, 0], descending=True).values
        assert bool((vals[1:] == vals[:-1]).any())


def test_pooled_scores_match_reference_values():
    cache = _filled_cache("k4v4_g64", 64, 64 + 3 * 64 + 64, layers=1, batch=1, window=64, sink=64, seed=5)
    q = _queries(cache, obs=8, seed=9)[0]
    _, pooled_ref = _kept_reference(cache, q, cache.seq_len(0), "avg", 5)  # last (b, h) = (0, 1)
    got = snapkv_scores(cache, 0, q, pool="avg", kernel_size=5, score_dtype=torch.float64)[0, 1]
    torch.testing.assert_close(got, torch.tensor(pooled_ref, dtype=torch.float64), rtol=1e-12, atol=0)
    got32 = snapkv_scores(cache, 0, q, pool="avg", kernel_size=5)  # float32 default
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32[0, 1].double(), got, rtol=1e-4, atol=1e-7)


# --- attention over the compacted cache --------------------------------------------------------
def test_attention_over_compacted_cache_matches_attention_over_the_kept_subset():
    """A query aimed at one kept and one evicted token: over the compacted cache it equals float64
    attention over the original cache with the evicted tokens masked, up to the re-quantization."""
    # isotropic keys (nearly orthogonal in 128 dims), so that a query can single out two of them
    cache = kc.KVarNCache(1, 2, 2, 128, preset="k4v4_g128", window=256, sink_tokens=128)
    g = torch.Generator().manual_seed(3)
    cache.append(0, torch.randn(2, 2, 128 + 8 * 128 + 200, 128, generator=g), torch.randn(2, 2, 1352, 128, generator=g))
    L = cache.seq_len(0)
    tile_k, tile_v = _decode64(cache.tile_bytes(0), cache.spec)
    sink_k, sink_v = cache.sink_kv(0)
    win_k, win_v = cache.window_kv(0)
    keys = torch.cat((sink_k.double(), tile_k, win_k.double()), 2)  # [B, H, L, D] original cache
    vals = torch.cat((sink_v.double(), tile_v, win_v.double()), 2)
    res = snapkv_compact(cache, _queries(cache, obs=32, seed=4), L // 2)
    kept = res.kept[0]
    t0, t1 = 128, 128 + 8 * 128
    keep_mask = torch.zeros(2, 2, L, dtype=torch.bool)
    keep_mask[..., :t0] = keep_mask[..., t1:] = True
    keep_mask.scatter_(2, kept, True)
    # the newest token's query (it sits at the last position either way): kept key + evicted key
    evicted = torch.stack([torch.stack([(~keep_mask[b, h, t0:t1]).nonzero()[3, 0] + t0 for h in range(2)]) for b in range(2)])
    target = lambda idx: keys.gather(2, idx[..., None, None].expand(-1, -1, 1, 128))[:, :, 0]  # noqa: E731
    unit = lambda x: x / (x * x).sum(-1, keepdim=True)  # noqa: E731  (q . x = 1 for q = unit(x))
    q = 12 * math.sqrt(128) * (unit(target(kept[..., 5])) + unit(target(evicted)))  # [B, H, D], logits ~12 on both
    q = q.repeat_interleave(2, 1)[:, :, None].float()  # 4 q heads, 1 query
    scores = torch.einsum("bhd,bhkd->bhk", q[:, :, 0].double(), keys.repeat_interleave(2, 1)) / math.sqrt(128)
    p = torch.softmax(scores, -1)
    full = torch.einsum("bhk,bhkd->bhd", p, vals.repeat_interleave(2, 1))
    p_sub = torch.softmax(scores.masked_fill(~keep_mask.repeat_interleave(2, 1), float("-inf")), -1)
    subset = torch.einsum("bhk,bhkd->bhd", p_sub, vals.repeat_interleave(2, 1))
    got = kc.reference.attention(q, cache, 0)[:, :, 0]
    err, gap = (got - subset).norm(), (full - subset).norm()
    assert gap > 0.2 * subset.norm()  # the evicted token mattered
    assert err < 0.2 * gap  # the compacted cache reads the kept subset, up to re-quantization (~10%)
    # exactly: the original cache with evicted tokens masked and the kept tile tokens replaced by
    # their re-quantized values (the new records, in the order of ``kept``)
    new_k, new_v = _decode64(cache.tile_bytes(0), cache.spec)
    idx = kept[..., None].expand(-1, -1, -1, 128)
    keys_rq, vals_rq = keys.scatter(2, idx, new_k), vals.scatter(2, idx, new_v)
    s_rq = torch.einsum("bhd,bhkd->bhk", q[:, :, 0].double(), keys_rq.repeat_interleave(2, 1)) / math.sqrt(128)
    p_rq = torch.softmax(s_rq.masked_fill(~keep_mask.repeat_interleave(2, 1), float("-inf")), -1)
    exact = torch.einsum("bhk,bhkd->bhd", p_rq, vals_rq.repeat_interleave(2, 1))
    torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-9)


# --- errors and no-ops ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(keep=0), ValueError, "keep"),
        (dict(keep=-5), ValueError, "keep"),
        (dict(keep=True), ValueError, "keep"),
        (dict(keep=100.0), ValueError, "keep"),
        (dict(pool="median"), ValueError, "pool"),
        (dict(kernel_size=4), ValueError, "kernel_size"),
        (dict(kernel_size=0), ValueError, "kernel_size"),
        (dict(scale=-1.0), ValueError, "scale"),
        # inf used to keep the first tokens instead of the top-scoring ones (every logit inf or NaN)
        (dict(scale=math.inf), ValueError, "scale must be a positive finite number, got inf"),
        (dict(scale=-math.inf), ValueError, "scale must be a positive finite number"),
        (dict(scale=math.nan), ValueError, "scale must be a positive finite number, got nan"),
        (dict(scale=0.0), ValueError, "scale must be a positive finite number, got 0.0"),
        (dict(scale="0.1"), TypeError, "scale must be a positive finite number, got str"),
        (dict(scale=True), TypeError, "scale must be"),
        (dict(score_dtype=torch.float16), ValueError, "score_dtype"),
        (dict(queries="bad_batch"), ValueError, r"queries\[1\]"),
        (dict(queries="bad_heads"), ValueError, r"queries\[0\]"),
        (dict(queries="bad_dim"), ValueError, r"queries\[0\]"),
        (dict(queries="too_many_obs"), ValueError, r"queries\[0\]"),
        (dict(queries="nan"), ValueError, r"queries\[1\].*NaN"),
        (dict(queries="int"), TypeError, r"queries\[0\]"),
        (dict(queries="one_short"), ValueError, "queries has 1 entries"),
        (dict(queries="bad_layer"), ValueError, r"layer must be an int in \[0, 2\), got 2"),
        (dict(queries="empty"), ValueError, "queries is empty"),
        (dict(queries="tensor"), TypeError, "queries must be"),
        (dict(cache="not_a_cache"), TypeError, "cache must be"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(kwargs, exc, match):
    cache = _filled_cache("k4v2_g64", 64, 64 + 5 * 64 + 30, layers=2, window=64, sink=64)
    good = _queries(cache, obs=8)
    bad_q = {
        "bad_batch": [good[0], good[1][:1]],
        "bad_heads": [good[0][:, :3], good[1]],
        "bad_dim": [good[0][..., :32], good[1]],
        "too_many_obs": [torch.randn(2, 4, cache.seq_len(0) + 1, 64), good[1]],
        "nan": [good[0], good[1].clone().index_fill_(2, torch.tensor([3]), float("nan"))],
        "int": [good[0].long(), good[1]],
        "one_short": good[:1],
        "bad_layer": {2: good[0]},
        "empty": {},
        "tensor": good[0],
    }
    args = dict(cache=cache, queries=good, keep=200)
    args.update(kwargs)
    if isinstance(args["queries"], str):
        args["queries"] = bad_q[args["queries"]]
    if args["cache"] == "not_a_cache":
        args["cache"] = object()
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        snapkv_compact(args.pop("cache"), args.pop("queries"), args.pop("keep"), **args)
    assert_same_snapshot(snapshot(cache), before)


def test_failure_while_re_encoding_changes_no_layer(monkeypatch):
    cache = _filled_cache("k4v2_g64", 64, 64 + 5 * 64 + 30, layers=3, window=64, sink=64)
    before = snapshot(cache)
    calls = []
    real = cache._compress

    def fail_on_third_layer(k, v):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("K row_scale overflows torch.float16 (injected)")
        return real(k, v)

    monkeypatch.setattr(cache, "_compress", fail_on_third_layer)
    with pytest.raises(ValueError, match="injected"):
        snapkv_compact(cache, _queries(cache, obs=8), 64 + 128 + 64)
    assert len(calls) == 3
    assert_same_snapshot(snapshot(cache), before)


def test_inside_deferred_checks_raises_and_changes_nothing():
    cache = _filled_cache("k4v2_g64", 64, 64 + 5 * 64 + 30, layers=1, window=64, sink=64)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="deferred_checks"):
        with cache.deferred_checks():
            snapkv_compact(cache, _queries(cache, obs=8), 200)
    assert_same_snapshot(snapshot(cache), before)


def test_no_op_cases():
    cache = _filled_cache("k4v2_g64", 64, 64 + 5 * 64 + 30, layers=2, window=64, sink=64)
    before = snapshot(cache)
    L = cache.seq_len(0)
    for keep in (L, L + 1, 10**9):
        res = snapkv_compact(cache, _queries(cache, obs=8), keep)
        assert res.kept == {} and res.evicted == {0: 0, 1: 0}
        assert_same_snapshot(snapshot(cache), before)
    # a layer without tiles (everything still in the sink and window) is left alone too
    short = _filled_cache("k4v2_g64", 64, 64 + 50, layers=1, window=64, sink=64)
    before = snapshot(short)
    res = snapkv_compact(short, _queries(short, obs=8), 10)
    assert res.evicted == {0: 0} and short.num_tiles(0) == 0
    assert_same_snapshot(snapshot(short), before)


def test_keep_below_sink_plus_window_drops_every_tile():
    for keep in (1, 64 + 30 + 63):  # budget < one tile: rounded down to zero kept tile tokens
        cache = _filled_cache("k4v4_g64", 64, 64 + 5 * 64 + 30, layers=1, window=64, sink=64)  # fresh per keep
        sink, win = [t.clone() for t in cache.sink_kv(0)], [t.clone() for t in cache.window_kv(0)]
        assert cache.num_tiles(0) == 5
        res = snapkv_compact(cache, _queries(cache, obs=8), keep)
        assert cache.num_tiles(0) == 0 and cache.seq_len(0) == 64 + 30
        assert all(torch.equal(a, b) for a, b in zip(cache.sink_kv(0), sink))
        assert all(torch.equal(a, b) for a, b in zip(cache.window_kv(0), win))
        assert res.evicted == {0: 5 * 64}
        assert res.kept[0].shape == (2, 2, 0)  # [batch, kv_heads, kept tile tokens]
    # appending after compaction continues exactly like a fresh cache
    more = realistic_kv(2, 2, 100, 64, generator=torch.Generator().manual_seed(2))
    fresh = kc.KVarNCache(1, 2, 2, 64, preset="k4v4_g64", window=64, sink_tokens=64)
    fresh.append(0, torch.cat((sink[0], win[0]), 2), torch.cat((sink[1], win[1]), 2))
    for c in (cache, fresh):
        c.append(0, more, more.flip(2))
    _assert_same_layer(_layer_state(cache, 0), _layer_state(fresh, 0))


def test_preallocated_pool_keeps_its_address():
    spec_T = 64
    cache = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, sink_tokens=64, max_seq_len=1024)
    k = realistic_kv(1, 2, 700, 64, generator=torch.Generator().manual_seed(7))
    cache.append(0, k, k * 0.5)
    ptrs = [cache.tile_pool(0).data_ptr()] + [t.data_ptr() for t in cache.buffers(0).values()]
    snapkv_compact(cache, _queries(cache, obs=4), 64 + 3 * spec_T + 60)
    assert cache.num_tiles(0) == 3
    assert ptrs == [cache.tile_pool(0).data_ptr()] + [t.data_ptr() for t in cache.buffers(0).values()]


def test_query_recorder_keeps_the_last_obs_across_calls():
    rec = QueryRecorder(5)
    a, b = torch.randn(1, 4, 3, 64), torch.randn(1, 4, 4, 64)
    rec.record(0, a)
    assert torch.equal(rec.queries()[0], a)
    rec.record(0, b)
    assert torch.equal(rec.queries()[0], torch.cat((a, b), 2)[:, :, -5:])
    with pytest.raises(ValueError, match="obs"):
        QueryRecorder(0)


# --- transformers: positions continue after compaction ----------------------------------------
MODEL_DIR = SHARED / "models" / "kvarn-ref-lm"
TEXT = SHARED / "data" / "code_eval.txt"


@pytest.fixture(scope="module")
def model_ids():
    transformers = pytest.importorskip("transformers")
    if not (MODEL_DIR / "config.json").exists() or not TEXT.exists():
        pytest.skip(f"reference model/data not found under {SHARED}")
    import kvarn_cutlass.hf  # noqa: F401  (registers the kvarn attention)

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="kvarn").eval()
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = tok(TEXT.read_text(encoding="utf-8")[:20000], return_tensors="pt", add_special_tokens=False).input_ids
    return model, ids


def _hf_prefill_compact(model, ids, keep, obs=16):
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf._compat import cache_kwarg

    cache = kh.KVarNCache(model.config, preset="k4v2_g64", window=64, cpu_attention="dequant")
    rec = QueryRecorder(obs)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, kvarn_queries=rec, **{cache_kwarg(model): cache})
    res = snapkv_compact(cache, rec, keep)
    return cache, rec, res


def test_query_recorder_gets_post_rope_queries(model_ids):
    """The recorded queries are q_norm(q_proj(h)) rotated at the tokens' positions (Qwen3)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    model, ids = model_ids
    attn = model.model.layers[2].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        rec = QueryRecorder(6)
        with torch.no_grad():
            model(input_ids=ids[:, :40], use_cache=False, kvarn_queries=rec)
    finally:
        hook.remove()
    h = seen["hidden_states"]
    with torch.no_grad():
        q = attn.q_norm(attn.q_proj(h).view(1, 40, -1, 128)).transpose(1, 2)
        k = torch.zeros_like(q)
        q, _ = apply_rotary_pos_emb(q, k, *seen["position_embeddings"])
    assert rec.queries()[2].shape == (1, 8, 6, 128)
    torch.testing.assert_close(rec.queries()[2], q[:, :, -6:], rtol=1e-6, atol=1e-6)


def test_hf_positions_continue_after_compaction(model_ids):
    """After compaction new tokens keep absolute positions: same logits as explicit position_ids
    over the same compacted contents, and not those of positions restarted at the compacted length."""
    from kvarn_cutlass.hf._compat import cache_kwarg

    model, ids = model_ids
    P, n = 400, 24
    cont = ids[:, P : P + n]
    a, _, res = _hf_prefill_compact(model, ids[:, :P], keep=200)
    b, _, _ = _hf_prefill_compact(model, ids[:, :P], keep=200)
    c, _, _ = _hf_prefill_compact(model, ids[:, :P], keep=200)
    held = a.library.seq_len(0)
    assert held <= 200 and all(res.evicted[i] == P - held for i in range(model.config.num_hidden_layers))
    assert a.get_seq_length() == P and torch.equal(a.library.tile_bytes(3), b.library.tile_bytes(3))
    for cache in (b, c):  # same contents, but the cache now claims to hold only what it holds
        for layer in cache.layers:
            layer.evicted = 0
    kw = cache_kwarg(model)
    with torch.no_grad():
        auto = model(input_ids=cont, use_cache=True, **{kw: a}).logits
        explicit = model(input_ids=cont, use_cache=True, position_ids=torch.arange(P, P + n)[None], **{kw: b}).logits
        restarted = model(input_ids=cont, use_cache=True, **{kw: c}).logits
    assert a.get_seq_length() == P + n and a.library.seq_len(0) == held + n
    torch.testing.assert_close(auto, explicit, rtol=1e-5, atol=1e-5)
    assert (auto - restarted).abs().max() > 1e-2


def test_hf_generate_after_compaction(model_ids):
    """generate() with the full prompt continues from the compacted cache: same tokens as a greedy
    loop with explicit absolute positions."""
    from kvarn_cutlass.hf._compat import cache_kwarg

    model, ids = model_ids
    P, new = 300, 8
    a, _, _ = _hf_prefill_compact(model, ids[:, :P], keep=150)
    b, _, _ = _hf_prefill_compact(model, ids[:, :P], keep=150)
    kw = cache_kwarg(model)
    nxt = ids[:, P : P + 1]  # the prompt's next token is fed by generate first
    out = model.generate(ids[:, : P + 1], max_new_tokens=new, min_new_tokens=new, do_sample=False, **{kw: a})
    toks = []
    for layer in b.layers:
        layer.evicted = 0
    with torch.no_grad():
        for step in range(new):
            logits = model(input_ids=nxt, use_cache=True, position_ids=torch.tensor([[P + step]]), **{kw: b}).logits
            nxt = logits[:, -1:].argmax(-1)
            toks.append(nxt)
    assert torch.equal(out[:, P + 1 :], torch.cat(toks, 1))
