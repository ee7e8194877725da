"""CPU mirror of the cache's device append (the append section of ``csrc/compress.cu``), block by block.

``EmulatedAppender`` replays what the two append kernels do on a CPU cache's tensors, from the lengths
they read on the "device" (``cache.device_lengths()``): which stream position each tile token and
window token comes from, the in-place window rewrite in rounds (asserting that no round reads a
window position it writes, the race the rounds exist to prevent), the raw-bit input checks, the error
flag protocol (a block that sees the flag set does nothing; the last commit block commits only on a
clean flag) and the window backups. It plugs in where ``ops.append.DeviceAppender`` does, so the
cache's device path (host bookkeeping, deferred blocks, restore, step graphs) runs on the CPU and is
checked against the cache's host path, the reference. Every block of a launch is emulated as reading
the flag when the launch starts (all blocks running at once: the case where failing appends still do
their invisible writes).

The C arithmetic itself (``csrc/append_plan.cuh``) is compiled for the host with g++ and compared
with ``ops.append.plan_append``.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvarn_cutlass as kc
from kvarn_cutlass import codec
from kvarn_cutlass.ops import append as A
from kvarn_cutlass.ops import compress as C
from kvarn_cutlass.runtime.spec import CSRC_DIR
from kvarn_cutlass.step_graph import StepAppends

from _append_scenarios import assert_same_state, error_scenario, feed_and_compare, lengths_consistent, scenario_chunks, state
from _helpers import realistic_kv


# ---- the C plan, on the host -------------------------------------------------------------------------
_PLAN_MAIN = r"""
#include <cstdio>
#include "append_plan.cuh"
int main() {
  int sl, wl, n, sink, window, T;
  while (std::scanf("%d %d %d %d %d %d", &sl, &wl, &n, &sink, &window, &T) == 6) {
    const KvaPlan p = kva_plan(sl, wl, n, sink, window, T);
    std::printf("%d %d %d %d %d\n", p.n_sink, p.n_new, p.keep, p.stream_len, kva_rounds(p, T));
  }
  return 0;
}
"""


def _rounds(n_new: int, keep: int, T: int) -> int:
    s = n_new * T
    return -(-keep // s) if n_new else 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the header for the host")
def test_plan_header_matches_python(tmp_path):
    src = tmp_path / "plan.cpp"
    src.write_text(_PLAN_MAIN)
    exe = tmp_path / "plan"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{CSRC_DIR}", str(src), "-o", str(exe)], check=True)
    seed = 1234
    rng = random.Random(seed)
    cases = []
    for _ in range(3000):
        T = rng.choice([64, 128])
        window = T * rng.randint(1, 8)
        sink = T * rng.randint(0, 2)
        sl = rng.randint(0, sink)
        wl = 0 if sl < sink else rng.randint(0, window)  # the window fills only after the sink
        n = rng.choice([1, 2, rng.randint(1, 3 * T), rng.randint(1, 20000)])
        cases.append((sl, wl, n, sink, window, T))
    out = subprocess.run([str(exe)], input="\n".join(" ".join(map(str, c)) for c in cases), capture_output=True,
                         text=True, check=True).stdout.split("\n")
    for case, line in zip(cases, out, strict=False):
        got = tuple(int(x) for x in line.split())
        n_sink, n_new, keep = A.plan_append(*case)
        want = (n_sink, n_new, keep, case[1] + case[2] - n_sink, _rounds(n_new, keep, case[5]))
        assert got == want, f"seed {seed}: {case}: header {got}, python {want}"
        assert 0 <= keep <= case[4] and (n_new == 0 or keep > case[4] - case[5])


# ---- the kernels, emulated -----------------------------------------------------------------------------
def _bits_of_codec_error(e: ValueError) -> int:
    text = str(e)
    for bit, what in C.ERROR_BITS:
        if text.startswith(what):
            return bit
    raise AssertionError(f"unmapped codec error {text!r}")


_RAW_LIMITS = {torch.float16: (0x7C00, 0x7BFF, 0x7BFF), torch.bfloat16: (0x7F80, 0x5780, 0x5480)}


def _check_rows(x: torch.Tensor, compressed: bool, is_v: bool, f16_scales: bool) -> int:
    """check_vec of compress.cu over token rows x [..., D]: raw-bit comparisons in the cache dtype."""
    if not x.numel():
        return 0
    inf, above48, above42 = _RAW_LIMITS[x.dtype]
    m = x.contiguous().view(torch.int16).to(torch.int32) & 0x7FFF
    finite = m < inf
    nonfinite, rng, bound = A.INPUT_ORDER[1 if is_v else 0]
    bits = nonfinite if bool((~finite).any()) else 0
    if compressed and bool((finite & (m > above48)).any()):
        bits |= rng
    if compressed and f16_scales and bool((finite & (m > above42)).any()):
        bits |= bound
    return bits


def _back_up(backup, st, b: int, wl: int) -> None:
    """The aux CTAs' copy of sequence b's window into the backup: the live rows only, the rest stays as
    allocated (poison)."""
    for bk, win in ((backup.window_k, st.window_k), (backup.window_v, st.window_v)):
        bk[b, :, :wl] = win[b, :, :wl]
        bk[b, :, wl:] = float("nan")


class EmulatedAppender:
    """The append kernels (compress.cu), emulated on a CPU cache; the interface of ops.append.DeviceAppender."""

    def __init__(self, cache):
        self.cache = cache
        self.launches = []  # kernel names, in order, for tests of the launch count

    def append(self, st, k, v, n, n_new, backup, stream=None, fuse=False, after_prefill=False):
        assert stream is None, "the emulation runs on the CPU: no overlapped block"
        if n_new and fuse:
            self._compress(st, k, v, n, n_new, backup, fused=True)
            return
        if n_new:
            self._compress(st, k, v, n, n_new, backup)
        self._commit(st, k, v, n)

    def prepare_step(self, st, k, v, backup):
        n = k.shape[2]
        max_new = -(-n // self.cache.spec.tile_tokens)

        def enqueue():
            self._compress(st, k, v, n, max_new, backup)
            self._commit(st, k, v, n)

        return enqueue

    def prepare_snapshot(self, saved):
        c = self.cache

        def launch():
            self.launches.append("snapshot")
            if int(c._errors) == 0:
                saved.copy_(c._lens)

        return types.SimpleNamespace(launch=launch)

    def _plan(self, st, b, n):
        c = self.cache
        nt, wl, sl = (int(x) for x in st.lens[:, b])
        return nt, wl, sl, A.plan_append(sl, wl, n, c.sink_tokens, c.window, c.spec.tile_tokens)

    def _compress(self, st, k, v, n, max_new, backup, fused=False):
        """append_compress; ``fused``: its fused form, whose (b, half) groups each write their sink and window once
        the group's own CTAs are done, if the flag is clean then (here: each group right after its own checks,
        before the next sequence's, the order in which a later group's error finds earlier windows rewritten),
        and whose last CTA commits the lengths on a clean flag."""
        self.launches.append("append_compress_fused" if fused else "append_compress")
        c = self.cache
        T, H, nb = c.spec.tile_tokens, c.num_kv_heads, c.spec.tile_nbytes
        f16_scales = c.spec.scale_dtype == torch.float16
        clean = int(c._errors) == 0
        bits = 0
        for b in range(c.batch_size):
            nt, wl, sl, (n_sink, n_new, keep) = self._plan(st, b, n)
            if fused and n_new and backup is not None:  # the fused form's aux CTAs: whatever the flag says
                _back_up(backup, st, b, wl)
            if not clean or n_new == 0:
                continue
            assert max_new >= n_new, "the launch has fewer compress blocks than tiles complete"
            if nt + n_new > st.tiles.shape[1]:
                bits |= A.CAPACITY
            else:
                for i in range(n_new):
                    p = torch.arange(i * T, (i + 1) * T)
                    from_window = p < wl

                    def tile(win, chunk):
                        out = torch.empty(H, T, c.head_dim, dtype=c.dtype)
                        out[:, from_window] = win[b][:, p[from_window]]
                        out[:, ~from_window] = chunk[b][:, p[~from_window] - wl + n_sink]
                        return out

                    try:
                        rec = codec.encode_tiles(tile(st.window_k, k), tile(st.window_v, v), c.spec)
                    except ValueError as e:
                        bits |= _bits_of_codec_error(e)
                        continue
                    slot = int(st.tile_table[b, nt + i])
                    st.tiles.view(-1, H, nb)[slot] = rec
            for x, win, sink, is_v in ((k, st.window_k, st.sink_k, False), (v, st.window_v, st.sink_v, True)):
                # the aux blocks: every chunk token
                bits |= _check_rows(x[b, :, :n_sink], False, is_v, f16_scales)
                bits |= _check_rows(x[b, :, n_sink:n], True, is_v, f16_scales)
                if fused:
                    c._errors |= bits
                    if int(c._errors) == 0:  # the group's last CTA: the flag as it finds it
                        sink[b, :, sl : sl + n_sink] = x[b, :, :n_sink]
                        self._rewrite(win[b], x[b], wl, n_sink, n_new, keep, 1)
            if backup is not None and not fused:
                _back_up(backup, st, b, wl)
        c._errors |= bits
        if fused:
            self._commit_lengths(st, n)

    def _rewrite(self, win, chunk, wl, n_sink, n_new, keep, parts):
        """append_plan's in-place rewrite of one (sequence, half)'s window [H, window, D], window[j] = stream[s + j]
        for j < keep: one round's rows split over ``parts`` blocks in any order (here the last first); more
        rounds on one block, round after round; asserting that no round reads a position it writes."""
        c = self.cache
        T = c.spec.tile_tokens
        s = n_new * T
        rounds = _rounds(n_new, keep, T)
        spans = ([(keep * z // parts, keep * (z + 1) // parts) for z in reversed(range(parts))] if rounds == 1
                 else [(q * s, min((q + 1) * s, keep)) for q in range(rounds)])
        for lo, hi in spans:
            j = torch.arange(lo, hi)
            src = s + j
            read = set(src[src < wl].tolist())
            written = set(range(keep)) if rounds == 1 else set(j.tolist())
            assert not read & written, f"rows {lo}..{hi} read window positions that are written"
            vals = torch.empty(c.num_kv_heads, len(j), c.head_dim, dtype=c.dtype)
            w = src < wl
            vals[:, w] = win[:, src[w]]
            vals[:, ~w] = chunk[:, src[~w] - wl + n_sink]
            win[:, j] = vals  # every read of the round happened before its writes

    def _commit_lengths(self, st, n):
        """The last block's commit: the new lengths of every sequence, on a clean flag."""
        if int(self.cache._errors) == 0:
            for b in range(self.cache.batch_size):
                nt, wl, sl, (n_sink, n_new, keep) = self._plan(st, b, n)
                st.lens[:, b] = torch.tensor([nt + n_new, keep, sl + n_sink], dtype=torch.int32)

    def _commit(self, st, k, v, n):
        self.launches.append("append_commit")
        c = self.cache
        T = c.spec.tile_tokens
        f16_scales = c.spec.scale_dtype == torch.float16
        clean = int(c._errors) == 0
        bits = 0
        parts = A.commit_parts(n, c.window, c.batch_size * c.num_kv_heads)
        for b in range(c.batch_size):
            nt, wl, sl, (n_sink, n_new, keep) = self._plan(st, b, n)
            if not clean:
                continue
            for x, win, sink, is_v in ((k, st.window_k, st.sink_k, False), (v, st.window_v, st.sink_v, True)):
                chunk = x[b]
                sink[b, :, sl : sl + n_sink] = chunk[:, :n_sink]
                if n_new == 0:
                    bits |= _check_rows(chunk[:, :n_sink], False, is_v, f16_scales)
                    bits |= _check_rows(chunk[:, n_sink:n], True, is_v, f16_scales)
                    win[b, :, wl:keep] = chunk[:, n_sink:n]
                    continue
                self._rewrite(win[b], chunk, wl, n_sink, n_new, keep, parts)
        c._errors |= bits
        self._commit_lengths(st, n)


def _pair(**kw):
    """(host-path cache, device-path cache on the emulated kernels), same configuration."""
    host = kc.KVarNCache(**kw)
    dev = kc.KVarNCache(**kw)
    dev._writer = EmulatedAppender(dev)
    return host, dev


_state, _assert_same, _lengths_consistent = state, assert_same_state, lengths_consistent


# ---- device path == host path -------------------------------------------------------------------------
CONFIGS = [
    dict(preset="k4v2_g64", head_dim=64, window=64, sink_tokens=0, dtype=torch.float16),
    dict(preset="k4v4_g64", head_dim=64, window=192, sink_tokens=64, dtype=torch.bfloat16),
    dict(preset="k4v2_g128", head_dim=128, window=256, sink_tokens=128, dtype=torch.float16, quantizer="lloyd_max"),
]


@settings(max_examples=12, deadline=None)
@given(config=st.sampled_from(range(len(CONFIGS))), chunks=st.lists(st.sampled_from([1, 1, 1, 2, 63, 64, 65, 130, 300]),
                                                                     min_size=1, max_size=8),
       seed=st.integers(0, 2**31 - 1))
def test_device_path_equals_host_path(config, chunks, seed):
    kw = dict(num_layers=1, batch_size=2, num_kv_heads=2, device="cpu", **CONFIGS[config])
    host, dev = _pair(**kw)
    g = torch.Generator().manual_seed(seed)
    D = kw["head_dim"]
    for n in chunks:
        k = realistic_kv(2, 2, n, D, generator=g, dtype=kw["dtype"])
        v = realistic_kv(2, 2, n, D, generator=g, dtype=kw["dtype"])
        host.append(0, k, v)
        dev.append(0, k, v)
        _assert_same(_state(host), _state(dev), f"seed {seed}, chunks {chunks}")
        _lengths_consistent(dev)


@pytest.mark.parametrize("preset,D,scale_dtype,quantizer,dtype", [
    ("k4v2_g64", 64, torch.float16, "uniform", torch.float16),
    ("k4v4_g64", 64, torch.float32, "lloyd_max", torch.bfloat16),
])
def test_gpu_scenario_on_emulated_kernels(preset, D, scale_dtype, quantizer, dtype):
    # the scenario of tests/test_append_gpu.py's byte-identity test, on the emulated kernels
    T = kc.format.PRESETS[preset][2]
    host, dev = _pair(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=D, preset=preset, window=2 * T,
                      sink_tokens=T, dtype=dtype, scale_dtype=scale_dtype, quantizer=quantizer, device="cpu")
    feed_and_compare(host, dev, scenario_chunks(T, 2 * T), seed=3)
    assert dev.num_tiles(0) >= 8


def test_device_path_token_by_token_across_tile_boundaries_and_launch_count():
    kw = dict(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=128, sink_tokens=64,
              device="cpu")
    host, dev = _pair(**kw)
    g = torch.Generator().manual_seed(5)
    for t in range(64 + 128 + 3 * 64 + 5):
        k, v = realistic_kv(1, 2, 1, 64, generator=g), realistic_kv(1, 2, 1, 64, generator=g)
        before = len(dev._writer.launches)
        tiles = dev.num_tiles(0)
        host.append(0, k, v)
        dev.append(0, k, v)
        launched = dev._writer.launches[before:]
        # one launch per append, two when a tile completes
        assert launched == (["append_compress", "append_commit"] if dev.num_tiles(0) > tiles else ["append_commit"]), t
    assert dev.num_tiles(0) == 4
    _assert_same(_state(host), _state(dev))


def test_chunk_longer_than_the_window_and_than_the_sink():
    kw = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=64, preset="k4v4_g64", window=64, sink_tokens=128,
              device="cpu")
    host, dev = _pair(**kw)
    g = torch.Generator().manual_seed(6)
    for n in (1000, 1, 333):
        k, v = realistic_kv(1, 1, n, 64, generator=g), realistic_kv(1, 1, n, 64, generator=g)
        host.append(0, k, v)
        dev.append(0, k, v)
    _assert_same(_state(host), _state(dev))
    assert dev.num_tiles(0) == (1334 - 128 - 64 + 63) // 64


# ---- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nan", "inf", "range", "bound"])
@pytest.mark.parametrize("where", ["window", "tile", "sink"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_errors_match_the_host_path_and_change_nothing(kind, where, tensor):
    error_scenario(lambda: _pair(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=128,
                                 sink_tokens=64, dtype=torch.bfloat16, device="cpu"), kind, where, tensor)


def test_f16_scale_bound_only_with_f16_scales():
    for scale_dtype, raises in ((torch.float16, True), (torch.float32, False)):
        host, dev = _pair(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=64, preset="k4v2_g64", window=64,
                          dtype=torch.bfloat16, scale_dtype=scale_dtype, device="cpu")
        k = torch.randn(1, 1, 10, 64).to(torch.bfloat16)
        k[0, 0, 4, 0] = 2.0**43
        for c in (host, dev):
            if raises:
                with pytest.raises(ValueError, match=r"^k has values of magnitude > 2\^42"):
                    c.append(0, k, k)
            else:
                c.append(0, k, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_f16_scale_bound_is_never_compressible(seed):
    # The bound's claim (codec.MAX_INPUT_ABS_F16_SCALES): no tile holding a token with |x| > 2^42 can be
    # stored with float16 scales. Adversarial tiles: the big value in one channel or spread, the rest of
    # the tile tiny, normal or also huge, K and V, every preset and quantizer.
    g = torch.Generator().manual_seed(seed)
    for preset in kc.format.PRESETS:
        for quantizer in kc.format.QUANTIZERS:
            D = [64, 128, 256][seed]
            spec = kc.TileSpec(preset=preset, head_dim=D, quantizer=quantizer)
            T = spec.tile_tokens
            for rest_scale in (0.0, 1e-3, 1.0, 1e9):
                x = torch.randn(1, T, D, generator=g, dtype=torch.float64) * rest_scale
                t = int(torch.randint(0, T, (1,), generator=g))
                big = codec.MAX_INPUT_ABS_F16_SCALES * 1.0001
                if seed == 1:
                    x[0, t] = big * torch.sign(torch.randn(D, generator=g, dtype=torch.float64))  # all channels
                else:
                    x[0, t, int(torch.randint(0, D, (1,), generator=g))] = big
                x = x.float()
                for k, v in ((x, torch.randn(1, T, D, generator=g)), (torch.randn(1, T, D, generator=g), x)):
                    with pytest.raises(ValueError, match="overflows torch.float16"):
                        codec.encode_tiles(k, v, spec)


# ---- deferred blocks ------------------------------------------------------------------------------------
def test_deferred_block_with_truncate_and_many_tiles_restores():
    kw = dict(num_layers=3, batch_size=2, num_kv_heads=1, head_dim=64, preset="k4v2_g64", window=128, sink_tokens=64,
              device="cpu")
    host, dev = _pair(**kw)
    g = torch.Generator().manual_seed(8)
    kv = lambda n: (realistic_kv(2, 1, n, 64, generator=g), realistic_kv(2, 1, n, 64, generator=g))  # noqa: E731
    for layer, n in ((0, 100), (1, 300), (2, 30)):
        a = kv(n)
        host.append(layer, *a)
        dev.append(layer, *a)
    before = _state(dev)
    bad = kv(5)
    bad[1][1, 0, 2, 0] = float("nan")
    steps = [("append", 0, kv(200)), ("truncate", 1, 250), ("append", 1, kv(90)), ("append", 2, kv(1)),
             ("append", 0, kv(64)), ("append", 2, bad), ("append", 2, kv(400)), ("append", 1, kv(1))]
    for c in (host, dev):
        with pytest.raises(ValueError, match="^v contains NaN"):
            with c.deferred_checks():
                for op, layer, arg in steps:
                    c.append(layer, *arg) if op == "append" else c.truncate(layer, arg)
        _assert_same(before, _state(c))
    _lengths_consistent(dev)
    # and without the failure the two paths agree on every step's state
    with host.deferred_checks(), dev.deferred_checks():
        for op, layer, arg in steps[:5]:
            for c in (host, dev):
                c.append(layer, *arg) if op == "append" else c.truncate(layer, arg)
            _assert_same(_state(host), _state(dev))


def test_fused_append_is_one_launch_and_a_later_groups_failure_is_undone(monkeypatch):
    """Inside a deferred block an append that completes tiles is one launch, append_compress's fused form, whose
    (sequence, half) groups each rewrite their window as they finish. With the NaN in the last sequence's V,
    the earlier groups' windows are rewritten before the failure is known (the restore is seen to have them to
    undo), and the block's restore puts the cache back as it was; outside a block the same append is two
    launches."""
    kw = dict(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=128, sink_tokens=64,
              device="cpu")
    host, dev = _pair(**kw)
    g = torch.Generator().manual_seed(12)
    kv = lambda n: (realistic_kv(2, 2, n, 64, generator=g), realistic_kv(2, 2, n, 64, generator=g))  # noqa: E731
    first = kv(150)  # the sink, and a window of 86
    for c in (host, dev):
        c.append(0, *first)
    good = kv(90)  # 176 tokens of stream: one 64-token tile completes
    for c in (host, dev):
        with c.deferred_checks():
            before = len(dev._writer.launches)
            c.append(0, *good)
    assert dev._writer.launches[before:] == ["append_compress_fused"]
    _assert_same(_state(host), _state(dev))
    state0 = _state(dev)
    bad = kv(200)
    bad[1][1, 1, 170, 5] = float("nan")  # sequence 1's V: the last group
    seen = {}
    restore = dev._restore

    def spy(lengths, backed_up):
        seen["window_k"] = dev._layers[0].window_k.clone()
        seen["kind"] = dict(backed_up)
        return restore(lengths, backed_up)

    monkeypatch.setattr(dev, "_restore", spy)
    with pytest.raises(ValueError, match="^v contains NaN"):
        with dev.deferred_checks():
            dev.append(0, *bad)
    assert seen["kind"] == {0: "fused"}
    live_k = state0[0][3]  # layer 0's window_k rows [batch, heads, window_len, D] before the failed block
    assert not torch.equal(seen["window_k"][:, :, : live_k.shape[2]], live_k), "nothing was rewritten"
    _assert_same(state0, _state(dev))
    with pytest.raises(ValueError, match="^v contains NaN"):  # outside a block: two launches, nothing rewritten
        before = len(dev._writer.launches)
        dev.append(0, *bad)
    assert dev._writer.launches[before:] == ["append_compress", "append_commit"]
    _assert_same(state0, _state(dev))


def test_deferred_block_raising_user_code_restores_device_path():
    host, dev = _pair(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=64,
                      device="cpu")
    g = torch.Generator().manual_seed(9)
    a = realistic_kv(1, 2, 100, 64, generator=g), realistic_kv(1, 2, 100, 64, generator=g)
    dev.append(0, *a)
    before = _state(dev)
    with pytest.raises(KeyError):
        with dev.deferred_checks():
            dev.append(0, *a)
            dev.append(0, *a)
            raise KeyError("user code")
    _assert_same(before, _state(dev))


# ---- step graphs: the append half, replayed eagerly --------------------------------------------------
def _step(appends: StepAppends) -> None:
    appends.check_capacity()
    appends.enqueue_snapshot()
    for layer in range(appends.cache.num_layers):
        appends.enqueue(layer)
    appends.advance()


@pytest.mark.parametrize("sink", [0, 64])
def test_step_appends_track_eager_appends_and_restore_a_failed_step(sink):
    kw = dict(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=64, preset="k4v4_g64", window=128, sink_tokens=sink,
              device="cpu", max_seq_len=2000)
    host, dev = _pair(**kw)
    g = torch.Generator().manual_seed(10 + sink)
    first = realistic_kv(2, 2, 70, 64, generator=g), realistic_kv(2, 2, 70, 64, generator=g)
    for c in (host, dev):
        for layer in range(2):
            c.append(layer, *first)
    k = torch.zeros(2, 2, 2, 1, 64, dtype=torch.float16)
    v = torch.zeros_like(k)
    appends = StepAppends(dev, k, v)
    fail_at, history = 150, []
    for step in range(400):
        new = realistic_kv(2, 2, 2, 1, 64, generator=g), realistic_kv(2, 2, 2, 1, 64, generator=g)
        k.copy_(new[0])
        v.copy_(new[1])
        if step == fail_at:
            history.append(_state(host))
            k[1, 0, 1, 0, 7] = float("inf")  # layer 1 fails: layer 0 of this step already committed
        elif step < fail_at:
            for layer in range(2):
                host.append(layer, new[0][layer], new[1][layer])
        _step(appends)
        if step == 0:
            with pytest.raises(RuntimeError, match="check"):  # eager writes wait for check()
                dev.append(0, *first)
        if step < fail_at and step % 37 == 0:
            appends.check()
            _assert_same(_state(host), _state(dev), f"step {step}")
    with pytest.raises(ValueError, match=r"^k contains NaN or Inf .*replayed step.*restored"):
        appends.check()
    _assert_same(history[0], _state(dev), "restored")
    _lengths_consistent(dev)
    tiles_at_failure = dev.num_tiles(0)
    # stepping resumes from the restored state
    for step in range(130):
        new = realistic_kv(2, 2, 2, 1, 64, generator=g), realistic_kv(2, 2, 2, 1, 64, generator=g)
        k.copy_(new[0])
        v.copy_(new[1])
        for layer in range(2):
            host.append(layer, new[0][layer], new[1][layer])
        _step(appends)
    appends.check()
    _assert_same(_state(host), _state(dev), "resumed")
    assert dev.num_tiles(0) > tiles_at_failure > 0


def test_step_appends_capacity_is_checked_before_the_step():
    _, dev = _pair(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=64, preset="k4v2_g64", window=64, device="cpu",
                   max_seq_len=130)
    k = torch.zeros(1, 1, 1, 1, 64, dtype=torch.float16)
    appends = StepAppends(dev, k, k.clone())
    for _ in range(130):
        _step(appends)
    with pytest.raises(ValueError, match="max_seq_len=130"):
        _step(appends)
    appends.check()
    assert dev.seq_len(0) == 130 and dev.num_tiles(0) == 2
