"""GPU tests of the cache's device append (``ops.append``, the append section of ``csrc/compress.cu``) and of
step graphs (``kvarn_cutlass.step_graph``). All marked ``gpu``.

* Byte identity: a CUDA cache and a CPU cache (host path: the codec) fed the same chunks hold the same
  records, windows, sinks and lengths after every append: every preset x head_dim x scale dtype x
  quantizer, both cache dtypes, chunks on and off tile boundaries, single tokens into a full window,
  a chunk longer than the window, sink tokens, batch 2, strided and float32 inputs, growing and
  preallocated pools, eager and inside deferred blocks (where a tile-completing append is one launch,
  append_compress's fused form, or two with KVARN_FUSED_APPEND=0).
* Errors: NaN/Inf, |x| > 2^48, |x| > 2^42 with float16 scales, in window, tile and sink tokens, and
  compression overflows: the host path's message, eager and deferred, and no visible change.
* Step graphs: 1000 replayed decode steps bit-identical to eager appends and decode_attention,
  across tile boundaries; a failed step restored; a multi-token step graph (up to two tiles per step)
  byte-identical to the host path.
* Both forms of the compression launch (``append_compress_cluster``, a thread-block cluster per record
  half on sm_90, and ``append_compress``, one CTA): the tests above run under ops.append's own choice
  (at their small batch x heads mostly the cluster form); the ``form`` tests force each
  (``DeviceAppender.cluster_tiles``) for byte identity with chunks completing 1 to 12 tiles at batch 3,
  the input and scale errors of either half, a failed append's error surviving a later one (the
  compressing halves' check of the flag at entry), and step-graph replays.

The scenarios run on emulated kernels in tests/test_append_emulation.py (CPU).
"""

from __future__ import annotations

import contextlib
import itertools
import zlib

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass.cache import KVarNCache
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, QUANTIZERS
from kvarn_cutlass.ops.append import plan_append

from _append_scenarios import (assert_same_state, error_scenario, feed_and_compare, inputs, lengths_consistent,
                               scenario_chunks, state)

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


def _pair(**kw):
    return KVarNCache(**kw, device="cpu"), KVarNCache(**kw, device="cuda")


FORMS = ("cluster", "cta")


def _force(cache, form: str):
    """Make ``cache``'s appends (and step graphs prepared after this) compress in ``form``: "cluster" (any tile
    count; skips the test where the GPU has no cluster form) or "cta" (one CTA per record half)."""
    from kvarn_cutlass.ops.append import DeviceAppender

    if cache._writer is None:
        cache._writer = DeviceAppender(cache)
    w = cache._writer
    if form == "cluster":
        if w._cluster is None:
            pytest.skip("no cluster form of append_compress on this GPU (sm_90 and later)")
        w.cluster_tiles = 1 << 30  # clusters need not all be resident at once: correct at any count
    else:
        w.cluster_tiles = 0
    return cache


def _forced_pair(form: str, **kw):
    host, dev = _pair(**kw)
    return host, _force(dev, form)


COMBOS = [
    (q, p, D, sd, (torch.float16, torch.bfloat16)[i % 2])
    for i, (q, p, D, sd) in enumerate(itertools.product(QUANTIZERS, PRESETS, HEAD_DIMS, (torch.float16, torch.float32)))
]


@pytest.mark.parametrize("quantizer,preset,D,scale_dtype,dtype", COMBOS)
def test_gpu_append_is_byte_identical_to_the_host_path(quantizer, preset, D, scale_dtype, dtype):
    T = PRESETS[preset][2]
    seed = zlib.crc32(repr((quantizer, preset, D, scale_dtype, dtype)).encode())
    chunks = scenario_chunks(T, 2 * T)
    kw = dict(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=D, preset=preset, window=2 * T, sink_tokens=T,
              dtype=dtype, scale_dtype=scale_dtype, quantizer=quantizer,
              max_seq_len=None if seed % 2 else T + sum(chunks))  # growing and preallocated pools
    host, dev = _pair(**kw)
    feed_and_compare(host, dev, chunks, seed)
    assert dev.num_tiles(0) >= 8


@pytest.mark.parametrize("cluster_warps", [4, 16])
def test_gpu_append_cluster_warps_variants_are_byte_identical(monkeypatch, cluster_warps):
    # the append's cluster form with 4 or 16 warps per CTA ($KVARN_COMPRESS_CLUSTER_WARPS), forced at every count
    from kvarn_cutlass.ops import compress as C

    monkeypatch.setenv(C.CLUSTER_WARPS_ENV, str(cluster_warps))
    host, dev = _forced_pair("cluster", num_layers=1, batch_size=2, num_kv_heads=3, head_dim=128, window=256,
                             sink_tokens=128, dtype=torch.float16)
    assert dev._writer._cluster.threads == 32 * cluster_warps
    feed_and_compare(host, dev, scenario_chunks(128, 256), seed=cluster_warps)
    assert dev.num_tiles(0) >= 4


@pytest.mark.parametrize("warps", [16, 32])
def test_gpu_append_cta_warps_variant_is_byte_identical(monkeypatch, warps):
    # the append's one-CTA form at each width ($KVARN_COMPRESS_CTA_WARPS), forced at every count
    from kvarn_cutlass.ops import compress as C

    monkeypatch.setenv(C.CTA_WARPS_ENV, str(warps))
    host, dev = _forced_pair("cta", num_layers=1, batch_size=2, num_kv_heads=3, head_dim=128, window=256,
                             sink_tokens=128, dtype=torch.float16)
    assert dev._writer.cta_threads == 32 * warps
    feed_and_compare(host, dev, scenario_chunks(128, 256), seed=warps)
    assert dev.num_tiles(0) >= 4


@pytest.mark.parametrize("quantizer,preset,D", [("uniform", "k4v2_g128", 128), ("lloyd_max", "k4v4_g64", 256),
                                                ("uniform", "k4v2_g64", 64)])
def test_gpu_append_in_a_deferred_block_is_byte_identical(quantizer, preset, D):
    T = PRESETS[preset][2]
    host, dev = _pair(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=D, preset=preset, window=2 * T, sink_tokens=0,
                      dtype=torch.bfloat16, quantizer=quantizer)
    with dev.deferred_checks():
        feed_and_compare(host, dev, scenario_chunks(T, 2 * T), seed=21)
    assert_same_state(state(host), state(dev), "after the block")


@pytest.mark.parametrize("preset,D,dtype", [("k4v2_g128", 128, torch.float16), ("k4v4_g64", 256, torch.bfloat16)])
def test_gpu_first_chunk_fills_the_sink_and_completes_tiles(preset, D, dtype):
    # one append that fills the sink and compresses tiles from the same chunk, then single tokens
    T = PRESETS[preset][2]
    host, dev = _pair(num_layers=1, batch_size=3, num_kv_heads=2, head_dim=D, preset=preset, window=T, sink_tokens=2 * T,
                      dtype=dtype)
    feed_and_compare(host, dev, [2 * T + 3 * T + 17, 1, 1, T - 17, 1, 300], seed=D)
    assert dev.num_tiles(0) >= 6 and dev.positions(0)["sink"] == (0, 2 * T)


FORM_CONFIGS = [("uniform", "k4v2_g128", 128, torch.float16, torch.float16),
                ("lloyd_max", "k4v4_g64", 64, torch.float32, torch.bfloat16),
                ("uniform", "k4v4_g64", 256, torch.float16, torch.bfloat16),
                ("lloyd_max", "k4v2_g128", 256, torch.float32, torch.float16)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("quantizer,preset,D,scale_dtype,dtype", FORM_CONFIGS)
def test_gpu_append_forms_are_byte_identical(form, quantizer, preset, D, scale_dtype, dtype):
    # batch 3, a sink; chunks completing 1, 2, 5 and 12 tiles (and none), every input form
    T = PRESETS[preset][2]
    kw = dict(num_layers=2, batch_size=3, num_kv_heads=2, head_dim=D, preset=preset, window=T, sink_tokens=T,
              dtype=dtype, scale_dtype=scale_dtype, quantizer=quantizer)
    host, dev = _forced_pair(form, **kw)
    chunks = [T // 2 + T, 1, T, 2 * T, 5 * T + 3, 12 * T - 3, 1, T - 1]
    completed, layer = [], host._layers[0]
    for i, n in enumerate(chunks):
        completed.append(plan_append(layer.sink_len, layer.window_len, n, host.sink_tokens, host.window, T)[1])
        feed_and_compare(host, dev, [n], seed=zlib.crc32(repr((form, quantizer, preset, D, i)).encode()),
                         forms=(("cache", "view", "float32")[i % 3],))
    assert {1, 2, 5, 12} <= set(completed), completed


def test_gpu_prefill_chunks_take_the_cluster_form_by_default():
    # the bench's prefill shape (batch 1, 8 KV heads, D=128, window 256, 512-token chunks): 4 tiles per head
    # and chunk, 64 record halves, which an H200 (132 SMs) runs as clusters
    host, dev = _pair(num_layers=1, batch_size=1, num_kv_heads=8, head_dim=128, window=256, dtype=torch.float16)
    feed_and_compare(host, dev, [512] * 6, seed=16)
    w = dev._writer
    if w._cluster is not None and torch.cuda.get_device_properties(dev.device).multi_processor_count >= 128:
        assert w.cluster_tiles >= 4, w.cluster_tiles
    assert dev.num_tiles(0) == (6 * 512 - 256) // 128


def test_gpu_append_of_the_caches_own_window():
    # the kernels rewrite the window while reading the chunk: a view of the window is copied first
    host, dev = _pair(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=128)
    g = torch.Generator().manual_seed(4)
    k, v = inputs(host, 128, g, "cache")
    for c in (host, dev):
        c.append(0, k.to(c.device), v.to(c.device))
        c.append(0, *c.window_kv(0))  # 128 + 128 tokens: two tiles complete, the window is rewritten
    assert_same_state(state(host), state(dev))
    assert dev.num_tiles(0) == 2


@pytest.mark.parametrize("kind", ["nan", "inf", "range", "bound"])
@pytest.mark.parametrize("where", ["window", "tile", "sink"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_gpu_append_errors_match_the_host_path_and_change_nothing(kind, where, tensor):
    error_scenario(lambda: _pair(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=128, preset="k4v2_g128",
                                 window=256, sink_tokens=128, dtype=torch.bfloat16), kind, where, tensor)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["nan", "inf", "range", "bound"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_gpu_append_tile_errors_in_either_form(form, kind, tensor):
    # a bad token that gets compressed: the compressing half (K or V) rejects its tile, the aux CTAs flag it
    error_scenario(lambda: _forced_pair(form, num_layers=2, batch_size=2, num_kv_heads=2, head_dim=128,
                                        preset="k4v2_g128", window=256, sink_tokens=128, dtype=torch.bfloat16),
                   kind, "tile", tensor)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("half", ["k", "v", "both"])
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_gpu_append_scale_overflow_of_either_half(form, half, quantizer):
    # 1e12 < 2^42 passes the aux checks; a half holding it overflows float16 scales when compressed
    host, dev = _forced_pair(form, num_layers=1, batch_size=2, num_kv_heads=2, head_dim=64, preset="k4v2_g64",
                             window=64, dtype=torch.bfloat16, quantizer=quantizer)
    g = torch.Generator().manual_seed(6)
    first = inputs(host, 100, g, "cache")
    for c in (host, dev):
        c.append(0, *[x.to(c.device) for x in first])
    k, v = inputs(host, 64, g, "cache")
    huge = torch.full_like(k, 1e12)
    k, v = (huge if half != "v" else k), (huge if half != "k" else v)
    before = state(dev)
    with pytest.raises(ValueError, match="scale_dtype=torch.float32") as want:
        host.append(0, k, v)
    with pytest.raises(ValueError) as got:
        dev.append(0, k.cuda(), v.cuda())
    assert str(got.value) == str(want.value) and str(got.value).startswith("K" if half != "v" else "V")
    assert_same_state(before, state(dev), f"{form} {half}")
    lengths_consistent(dev)


@pytest.mark.parametrize("form", FORMS)
def test_gpu_first_failed_append_of_a_block_is_the_error_reported(form):
    # The v error of the first failing append is reported, not the k error of a later one: the later
    # append's compressing halves (and aux CTAs) see the flag set and OR nothing (k's bits come first in
    # the report's order, so any bit of the later append would show)
    _, dev = _forced_pair(form, num_layers=1, batch_size=2, num_kv_heads=2, head_dim=128, preset="k4v2_g128",
                          window=256, dtype=torch.float16)
    g = torch.Generator().manual_seed(7)
    dev.append(0, *inputs(dev, 300, g, "cache", "cuda")[2:])
    before = state(dev)
    bad_v = inputs(dev, 3 * 128, g, "cache")  # completes tiles: token 5 is compressed
    bad_v[1][1, 0, 5, 0] = float("nan")
    bad_k = inputs(dev, 3 * 128, g, "cache")
    bad_k[0][0, 1, 7, 3] = float("inf")
    with pytest.raises(ValueError, match=r"^v contains NaN or Inf .*deferred_checks.*restored"):
        with dev.deferred_checks():
            dev.append(0, *[x.cuda() for x in bad_v])
            dev.append(0, *[x.cuda() for x in bad_k])
    assert_same_state(before, state(dev), form)
    lengths_consistent(dev)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_deferred_block_fused_or_not_and_a_later_groups_failure(monkeypatch, form, fused):
    """Inside a deferred block a tile-completing append is one launch (append_compress's fused form; with
    KVARN_FUSED_APPEND=0, two): a 16k-style prompt of 512-token chunks at batch 2 is byte-identical to the host
    path, and a chunk whose NaN sits in the last sequence's V (the earlier (sequence, half) groups may have
    rewritten their windows by then) leaves the cache as before the block, in either form."""
    monkeypatch.setenv("KVARN_FUSED_APPEND", "1" if fused else "0")
    host, dev = _forced_pair(form, num_layers=2, batch_size=2, num_kv_heads=2, head_dim=128, preset="k4v2_g128",
                             window=256, sink_tokens=128, dtype=torch.float16)
    assert dev._fuse_appends is fused
    g = torch.Generator().manual_seed(31)
    with dev.deferred_checks():
        for n in (512, 512, 300, 1, 700):
            kv = inputs(host, n, g, "cache")
            for layer in range(2):
                host.append(layer, *kv)
                dev.append(layer, *[x.cuda() for x in kv])
    assert_same_state(state(host), state(dev), f"{form} fused={fused}")
    before = state(dev)
    bad = inputs(host, 512, g, "cache")
    bad[1][1, 1, 400, 5] = float("nan")
    with pytest.raises(ValueError, match=r"^v contains NaN or Inf .*deferred_checks.*restored"):
        with dev.deferred_checks():
            dev.append(0, *[x.cuda() for x in inputs(host, 512, g, "cache")])
            dev.append(1, *[x.cuda() for x in bad])
    assert_same_state(before, state(dev), f"{form} fused={fused} restored")
    lengths_consistent(dev)
    assert int(dev._groups.abs().sum()) == 0 and int(dev._counter.item()) == 0  # every count reset


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["eager", "fused block", "two-launch block"])
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_prefill_appends_launched_during_the_attention(monkeypatch, form, mode, D):
    """prefill_attention's append is a programmatic dependent launch after the fused prefill kernel (sm_90): the
    compression may run while the attention's last CTAs still read the window and the records, and waits for
    them before it rewrites the window (fused form) or before its launch ends (then the commit). Chunks of 512
    tokens at 8 KV heads (grids that fill the GPU) give the same outputs and caches, bit for bit, with the
    programmatic launch as without it, and caches equal to the host path's appends; eager and in deferred
    blocks, fused or not, in either compression form; and a NaN in a later chunk of a block restores it."""
    monkeypatch.setenv("KVARN_FUSED_APPEND", "0" if mode == "two-launch block" else "1")
    kw = dict(num_layers=1, batch_size=1, num_kv_heads=8, head_dim=D, preset="k4v2_g128", window=256,
              dtype=torch.float16)
    host, dev = _forced_pair(form, **kw)
    plain = _force(KVarNCache(**kw, device="cuda"), form)
    if not dev._writer.programmatic:
        pytest.skip("no programmatic dependent launch of the append here (sm_90 and later)")
    plain._writer.programmatic = False
    g = torch.Generator().manual_seed(zlib.crc32(repr((form, mode, D)).encode()))
    chunks = [512, 512, 512, 300, 700, 512]
    block = (lambda c: c.deferred_checks()) if mode != "eager" else (lambda c: contextlib.nullcontext())
    qs = [(torch.randn(1, 32, n, D, generator=g) * 0.3).half() for n in chunks]
    kvs = [inputs(host, n, g, "cache") for n in chunks]
    outs = {}
    for name, c in (("programmatic", dev), ("plain", plain)):
        with block(c):
            outs[name] = [kc.prefill_attention(q.cuda(), k.cuda(), v.cuda(), c, 0).cpu() for q, (k, v) in zip(qs, kvs)]
    for k, v in kvs:
        host.append(0, k, v)
    for i, (a, b) in enumerate(zip(outs["programmatic"], outs["plain"])):
        assert torch.equal(a, b), f"chunk {i}: the outputs differ with the programmatic launch"
    assert_same_state(state(host), state(dev), f"{form} {mode} D={D} programmatic")
    assert_same_state(state(host), state(plain), f"{form} {mode} D={D} plain")
    if mode == "eager":
        return
    before = state(dev)
    bad = inputs(host, 512, g, "cache")
    bad[1][0, 5, 300, 7] = float("nan")
    with pytest.raises(ValueError, match=r"^v contains NaN or Inf .*deferred_checks.*restored"):
        with dev.deferred_checks():
            for k, v in (inputs(host, 512, g, "cache"), bad, inputs(host, 512, g, "cache")):
                kc.prefill_attention(qs[0].cuda(), k.cuda(), v.cuda(), dev, 0)
    assert_same_state(before, state(dev), f"{form} {mode} D={D} restored")
    lengths_consistent(dev)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_gpu_append_compression_overflow(quantizer):
    # 1e12 < 2^42 passes the arrival checks; its tile overflows float16 scales when compressed
    host, dev = _pair(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=64,
                      dtype=torch.bfloat16, quantizer=quantizer)
    g = torch.Generator().manual_seed(5)
    first = inputs(host, 100, g, "cache")
    for c in (host, dev):
        c.append(0, *[x.to(c.device) for x in first])
    huge = torch.full((1, 2, 64, 64), 1e12, dtype=torch.bfloat16)
    before = state(dev)
    with pytest.raises(ValueError, match="scale_dtype=torch.float32") as want:
        host.append(0, huge, huge)
    with pytest.raises(ValueError) as got:
        dev.append(0, huge.cuda(), huge.cuda())
    assert str(got.value) == str(want.value)
    assert_same_state(before, state(dev), "eager")
    with pytest.raises(ValueError, match="overflows torch.float16.*deferred_checks.*restored"):
        with dev.deferred_checks():
            dev.append(0, *[x.cuda() for x in first])
            dev.append(0, huge.cuda(), huge.cuda())
            dev.append(0, *[x.cuda() for x in first])
    assert_same_state(before, state(dev), "deferred")
    lengths_consistent(dev)


# ---- step graphs ------------------------------------------------------------------------------------------
STEP_CASES = [("k4v2_g128", 128, 0, "uniform", torch.float16), ("k4v4_g64", 64, 64, "lloyd_max", torch.bfloat16)]


def _step_caches(preset, D, sink, quantizer, dtype, steps):
    T = PRESETS[preset][2]
    kw = dict(num_layers=3, batch_size=2, num_kv_heads=2, head_dim=D, preset=preset, window=2 * T, sink_tokens=sink,
              dtype=dtype, quantizer=quantizer, device="cuda", max_seq_len=sink + 300 + steps)
    eager, graphed = KVarNCache(**kw), KVarNCache(**kw)
    g = torch.Generator().manual_seed(D + sink)
    for layer in range(3):
        k, v = inputs(eager, sink + 300, g, "cache")
        for c in (eager, graphed):
            c.append(layer, k.cuda(), v.cuda())
    return eager, graphed


def _step_inputs(graph, g):
    L, B, Hq, _, D = graph.q.shape
    H = graph.k.shape[2]
    q = torch.randn(L, B, Hq, 1, D, generator=g, device="cuda").to(graph.q.dtype)
    k = (torch.randn(L, B, H, 1, D, generator=g, device="cuda") * 2).to(graph.k.dtype)
    v = torch.randn(L, B, H, 1, D, generator=g, device="cuda").to(graph.k.dtype)
    return q, k, v


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("preset,D,sink,quantizer,dtype", STEP_CASES)
def test_gpu_step_graph_replays_bit_identical_to_eager(preset, D, sink, quantizer, dtype, form):
    steps = 1000
    eager, graphed = _step_caches(preset, D, sink, quantizer, dtype, steps)
    _force(graphed, form)
    graph = kc.StepGraph(graphed, num_q_heads=8, dtype=dtype)
    assert_same_state(state(eager), state(graphed), "capture changed the cache")
    g = torch.Generator(device="cuda").manual_seed(7)
    tiles = eager.num_tiles(0)
    for step in range(steps):
        _replay_matches_eager(graph, eager, *_step_inputs(graph, g), step)
        if step % 97 == 0:
            graph.check()
            assert_same_state(state(eager), state(graphed), f"step {step}")
            lengths_consistent(graphed)
    graph.check()
    assert_same_state(state(eager), state(graphed), "end")
    assert eager.num_tiles(0) >= tiles + steps // PRESETS[preset][2] - 1


def _replay_matches_eager(graph, eager, q, k, v, step):
    """One replayed step of ``graph`` against the same appends and decode_attention on ``eager``, bit for bit."""
    graph.q.copy_(q)
    graph.k.copy_(k)
    graph.v.copy_(v)
    out = graph.replay()
    for layer in range(3):
        eager.append(layer, k[layer], v[layer])
        want = kc.decode_attention(q[layer], eager, layer)
        assert torch.equal(out[layer], want), f"step {step}, layer {layer}: graph and eager outputs differ"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("preset,D,sink,quantizer,dtype", STEP_CASES[:1])
def test_gpu_step_graph_failed_step_is_restored(preset, D, sink, quantizer, dtype, form):
    T = PRESETS[preset][2]
    eager, graphed = _step_caches(preset, D, sink, quantizer, dtype, 600)
    _force(graphed, form)
    graph = kc.StepGraph(graphed, num_q_heads=4, dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(8)
    failed = None
    for step in range(400):
        q, k, v = _step_inputs(graph, g)
        full = graphed._layers[0].window_len == graphed.window  # this step completes a tile in every layer
        if failed is None and full and step > T:
            failed = step
            before = state(graphed)
            graph.k.copy_(k)
            graph.k[1, 0, 1, 0, 5] = float("inf")  # layer 1 fails; layer 0 rewrote its window already
            graph.replay()
            for _ in range(5):  # later steps commit nothing
                graph.replay()
            with pytest.raises(RuntimeError, match="check"):
                graphed.append(0, k[0], v[0])
            with pytest.raises(ValueError, match=r"^k contains NaN or Inf .*replayed step.*restored"):
                graph.check()
            assert_same_state(before, state(graphed), f"restored before step {step}")
            lengths_consistent(graphed)
            continue
        _replay_matches_eager(graph, eager, q, k, v, step)
    assert failed is not None
    graph.check()
    assert_same_state(state(eager), state(graphed), "end")


@pytest.mark.parametrize("form", FORMS)
def test_gpu_multi_token_step_graph_matches_the_host_path(form):
    # n = T + 6 tokens per layer and step: append_compress is sized for 2 tiles per head and step; its
    # replays complete 1 or 2 (the device lengths decide), byte for byte what the host path does
    from kvarn_cutlass.step_graph import StepAppends

    T, L, B, H, D, n, steps = 64, 2, 2, 2, 64, 70, 40
    kw = dict(num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, preset="k4v4_g64", window=2 * T,
              sink_tokens=T, dtype=torch.bfloat16, max_seq_len=200 + n * steps)
    host, dev = _forced_pair(form, **kw)
    g = torch.Generator().manual_seed(9)
    for layer in range(L):
        k, v, kd, vd = inputs(host, 200, g, "cache", "cuda")
        host.append(layer, k, v)
        dev.append(layer, kd, vd)
    k = torch.zeros(L, B, H, n, D, dtype=dev.dtype, device="cuda")
    v = torch.zeros_like(k)
    appends = StepAppends(dev, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        appends.enqueue_snapshot()
        for layer in range(L):
            appends.enqueue(layer)
    completed = set()
    for step in range(steps):
        new = [inputs(host, n, g, "cache") for _ in range(L)]
        k.copy_(torch.stack([kv[0] for kv in new]))
        v.copy_(torch.stack([kv[1] for kv in new]))
        st = host._layers[0]
        completed.add(plan_append(st.sink_len, st.window_len, n, host.sink_tokens, host.window, T)[1])
        appends.check_capacity()
        graph.replay()
        appends.advance()
        for layer in range(L):
            host.append(layer, *new[layer])
        if step % 7 == 0 or step == steps - 1:
            appends.check()
            assert_same_state(state(host), state(dev), f"{form}, step {step}")
            lengths_consistent(dev)
    assert completed == {1, 2}, completed


def test_gpu_step_graph_runs_the_plans_kernel():
    """A StepGraph launches the kernel variant and grid that decode_attention's plan picks (``decode.plan_variant``):
    at batch 1 with 8 KV heads and a 16k capacity (65 splits) the two-level merge, whose sums are grouped
    differently from the one-level kernel's, so a replay equals the eager decode bit for bit only if both run it."""
    kw = dict(num_layers=1, batch_size=1, num_kv_heads=8, head_dim=128, window=256, device="cuda", max_seq_len=16384)
    eager, graphed = KVarNCache(**kw), KVarNCache(**kw)
    g = torch.Generator(device="cuda").manual_seed(12)
    k = (torch.randn(1, 8, 5000, 128, generator=g, device="cuda") * 2).half()
    v = torch.randn(1, 8, 5000, 128, generator=g, device="cuda").half()
    for c in (eager, graphed):
        c.append(0, k, v)
    graph = kc.StepGraph(graphed, num_q_heads=32)
    ws = kc.decode.get_plan(eager).workspace(4)
    assert graph._workspace.variant == ws.variant == kc.decode.MERGE_GROUP_VARIANT
    assert (graph._workspace.splits, graph._workspace.exact) == (ws.splits, ws.exact)
    for step in range(5):
        q, k1, v1 = _step_inputs(graph, g)
        graph.q.copy_(q)
        graph.k.copy_(k1)
        graph.v.copy_(v1)
        out = graph.replay()
        eager.append(0, k1[0], v1[0])
        assert torch.equal(out[0], kc.decode_attention(q[0], eager, 0)), f"step {step}"
    graph.check()


def test_gpu_step_graph_bad_arguments():
    c = KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, device="cuda")
    with pytest.raises(ValueError, match="max_seq_len"):
        kc.StepGraph(c, num_q_heads=4)
    c = KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, device="cuda", max_seq_len=256)
    with pytest.raises(ValueError, match="num_q_heads"):
        kc.StepGraph(c, num_q_heads=3)
    with c.deferred_checks():
        with pytest.raises(RuntimeError, match="deferred_checks"):
            kc.StepGraph(c, num_q_heads=4)
