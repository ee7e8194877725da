"""Appends overlapped with the caller's work: ``KVarNCache.deferred_checks(overlap_appends=True)``.

Inside such a block a CUDA cache runs its appends on a second stream. What must hold, and what each test
checks against a cache fed the same inputs without the option (the host path's byte identity is
tests/test_append_gpu.py's):

* the bytes: records, windows, sinks and lengths, and every prefill_attention / decode_attention /
  dequantize_layer output read in between, equal bit for bit;
* the append waits for its inputs: k, v written on the caller's stream behind a long kernel;
* the caller's reads wait for the append: a layer read at once through the library after its append;
* the inputs stay alive: k, v freed and their memory rewritten with NaN on the caller's stream while the
  append has not started yet (the write stream held back by a long kernel);
* a growing pool, a failed append (the block's error raised at its end, the cache restored), and the
  transformers prefill with the option on equal to it off.

CPU: the option is validated and has no effect on a CPU cache.
"""

from __future__ import annotations

import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass.cache import KVarNCache

from _append_scenarios import assert_same_state, state
from _helpers import needs_ref_model

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

KW = dict(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=128, window=256)
HQ = 8
# the long kernel's length (torch.cuda._sleep cycles, ~1 ms at 1.5-2 GHz): far longer than an append
SLEEP = 2_000_000


def _chunks(g, device, sizes, B=2, H=2, D=128):
    return [(torch.randn(B, HQ, n, D, generator=g, device=device, dtype=torch.float16) * 0.3,
             torch.randn(B, H, n, D, generator=g, device=device, dtype=torch.float16),
             torch.randn(B, H, n, D, generator=g, device=device, dtype=torch.float16)) for n in sizes]


def _prefill_run(cache, chunks, overlap: bool, reads: bool = True) -> list:
    """prefill_attention of every chunk in every layer inside one deferred block; with ``reads``, each
    layer's dequantized contents and a decode step read right after its append."""
    outs = []
    with cache.deferred_checks(overlap_appends=overlap):
        for q, k, v in chunks:
            for layer in range(cache.num_layers):
                outs.append(kc.prefill_attention(q, k, v, cache, layer).clone())
                if reads:
                    outs.extend(t.clone() for t in kc.dequantize_layer(cache, layer))
                    outs.append(kc.decode_attention(q[:, :, -1:].contiguous(), cache, layer).clone())
    torch.cuda.synchronize()
    return outs


def _assert_equal_outputs(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs: max |diff| {(x.float() - y.float()).abs().max().item()}"


# ---- CPU ---------------------------------------------------------------------------------------------------
def test_overlap_appends_is_validated_and_a_cpu_cache_ignores_it():
    c = KVarNCache(**KW, device="cpu")
    with pytest.raises(TypeError, match="overlap_appends"):
        with c.deferred_checks(overlap_appends=1):
            pass
    assert c._deferred is None  # the rejected block left nothing open
    g = torch.Generator().manual_seed(0)
    ref = KVarNCache(**KW, device="cpu")
    for n in (300, 200, 1):
        k, v = torch.randn(2, 2, n, 128, generator=g), torch.randn(2, 2, n, 128, generator=g)
        with c.deferred_checks(overlap_appends=True):
            c.append(0, k, v)
            assert not c._overlap
        ref.append(0, k, v)
    assert_same_state(state(c), state(ref))
    c.await_writes()  # outside a block: nothing to wait for


def test_hf_prefill_validates_overlap_appends(monkeypatch):
    import importlib

    P = importlib.import_module("kvarn_cutlass.hf.prefill")  # (the package exports the function under that name)
    with pytest.raises(TypeError, match="overlap_appends"):
        P.prefill(None, torch.zeros(1, 4, dtype=torch.long), None, overlap_appends="yes")
    monkeypatch.setenv(P.OVERLAP_ENV, "0")
    assert P.overlap_appends_default() is False
    monkeypatch.setenv(P.OVERLAP_ENV, "on")
    with pytest.raises(ValueError, match=P.OVERLAP_ENV):
        P.overlap_appends_default()
    monkeypatch.delenv(P.OVERLAP_ENV)
    assert P.overlap_appends_default() is True


# ---- GPU ---------------------------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("max_seq_len", [None, 4096])
def test_gpu_overlapped_appends_equal_serial_ones_bit_for_bit(max_seq_len):
    """prefill_attention chunks (on and off tile boundaries, one longer than the window, one token) in
    two layers with reads of each layer right after its append: same outputs, same cache."""
    g = torch.Generator(device="cuda").manual_seed(3)
    chunks = _chunks(g, "cuda", [512, 300, 1, 777, 128])
    ser = KVarNCache(**KW, device="cuda", max_seq_len=max_seq_len)
    ovl = KVarNCache(**KW, device="cuda", max_seq_len=max_seq_len)
    a = _prefill_run(ser, chunks, overlap=False)
    b = _prefill_run(ovl, chunks, overlap=True)
    assert ovl._write_stream is not None and not ovl._overlap
    _assert_equal_outputs(a, b)
    assert_same_state(state(ovl), state(ser), "overlapped")


def _against_serial(seed: int, sizes, append_overlapped) -> tuple[list, list]:
    """Chunks of ``sizes`` tokens appended to layer 0 of a cache as usual and, by ``append_overlapped(cache, k, v)``,
    to one inside an overlapped block: (serial state, overlapped state) after the block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ser, ovl = KVarNCache(**KW, device="cuda"), KVarNCache(**KW, device="cuda")
    with ovl.deferred_checks(overlap_appends=True):
        for n in sizes:
            k, v = (torch.randn(2, 2, n, 128, generator=g, device="cuda", dtype=torch.float16) for _ in range(2))
            ser.append(0, k, v)
            append_overlapped(ovl, k, v)
    return state(ser), state(ovl)


@gpu
@needs_cuda
def test_gpu_overlapped_append_waits_for_its_inputs():
    """k, v are written on the caller's stream behind a ~1 ms kernel: the append must read them after it."""
    def late_inputs(cache, k, v):
        kk, vv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        torch.cuda._sleep(SLEEP)
        kk.copy_(k)
        vv.copy_(v)
        cache.append(0, kk, vv)

    ser, ovl = _against_serial(4, (512, 384), late_inputs)
    assert_same_state(ovl, ser, "inputs written behind a long kernel")


@gpu
@needs_cuda
def test_gpu_overlapped_append_keeps_its_inputs_alive():
    """The write stream is held back by a ~1 ms kernel while the caller frees k, v and rewrites their memory
    with NaN: the append must still read the values it was given (the caching allocator must not hand the
    memory out before the append ran)."""
    def freed_inputs(cache, k, v):
        kk, vv = k.clone(), v.clone()
        with torch.cuda.stream(cache._write_stream):
            torch.cuda._sleep(SLEEP)
        cache.append(0, kk, vv)
        del kk, vv
        junk = [torch.full_like(k, float("nan")) for _ in range(4)]  # likely the freed blocks
        del junk

    ser, ovl = _against_serial(5, (640, 512), freed_inputs)
    assert_same_state(ovl, ser, "inputs freed while the append waited")


@gpu
@needs_cuda
def test_gpu_reads_wait_for_an_append_held_back_on_the_write_stream():
    """The write stream is held back by a ~1 ms kernel: a read of the layer right after its append (the
    library's dequantize_layer and decode_attention, the cache's accessors) must see the appended tokens."""
    g = torch.Generator(device="cuda").manual_seed(6)
    ser, ovl = KVarNCache(**KW, device="cuda"), KVarNCache(**KW, device="cuda")
    (q, k, v), = _chunks(g, "cuda", [700])
    ser.append(1, k, v)
    want = [t.clone() for t in kc.dequantize_layer(ser, 1)]
    want_dec = kc.decode_attention(q[:, :, -1:].contiguous(), ser, 1)
    with ovl.deferred_checks(overlap_appends=True):
        with torch.cuda.stream(ovl._write_stream):
            torch.cuda._sleep(SLEEP)
        ovl.append(1, k, v)
        got = [t.clone() for t in kc.dequantize_layer(ovl, 1)]
        got_dec = kc.decode_attention(q[:, :, -1:].contiguous(), ovl, 1)
        lens = ovl.device_lengths().clone()
        win = ovl.window_kv(1)[0].clone()
    _assert_equal_outputs(want + [want_dec], got + [got_dec])
    assert torch.equal(lens, ser.device_lengths())
    assert torch.equal(win, ser.window_kv(1)[0])


@gpu
@needs_cuda
def test_gpu_a_failed_overlapped_append_raises_at_the_end_and_restores():
    """A NaN in the second of three overlapped appends: the block raises the input's error at its end and every
    layer is back at its state before the block."""
    g = torch.Generator(device="cuda").manual_seed(7)
    kv = lambda n: [torch.randn(2, 2, n, 128, generator=g, device="cuda", dtype=torch.float16) for _ in range(2)]  # noqa: E731
    ovl = KVarNCache(**KW, device="cuda")
    ovl.append(0, *kv(600))
    before = state(ovl)
    bad, bad_v = kv(512)
    bad[1, 0, 300, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        with ovl.deferred_checks(overlap_appends=True):
            ovl.append(0, *kv(512))
            ovl.append(0, bad, bad_v)
            ovl.append(1, *kv(512))
    assert not ovl._overlap
    assert_same_state(state(ovl), before, "restored")


@gpu
@needs_cuda
@needs_ref_model
def test_gpu_hf_prefill_with_overlapped_appends_equals_serial():
    """The transformers prefill of the reference model, 3 chunks of 200 tokens: the last logits and the
    cache bit for bit the same with the appends overlapped."""
    import kvarn_cutlass.hf as kh
    from _helpers import ref_model_on_cuda
    from kvarn_cutlass.hf.prefill import prefill

    model, text = ref_model_on_cuda()
    ids = torch.cat([text[:, :600], text[:, 1000:1600]])
    runs = []
    for overlap in (False, True):
        cache = kh.KVarNCache(model.config, window=128)
        out = prefill(model, ids, cache, chunk_size=200, overlap_appends=overlap)
        runs.append((out.logits.clone(), state(cache.library)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_state(runs[1][1], runs[0][1], "hf prefill")
