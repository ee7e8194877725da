"""Append scenarios shared by the CPU emulation (tests/test_append_emulation.py, the device path on
emulated kernels) and the GPU tests (tests/test_append_gpu.py, the real kernels): a cache on the
device path is fed exactly what a host-path (CPU, codec) cache is fed, and everything a read can see
must be equal after every call."""

from __future__ import annotations

import torch

from _helpers import realistic_kv


def scenario_chunks(T: int, window: int) -> list[int]:
    """Chunk lengths: off and on tile boundaries, single tokens into a full window (tiles completing
    with the window rewritten in rounds), one chunk longer than the window, a token-by-token run
    across a tile boundary."""
    return [1, T - 1, T, 1, 2 * T + 3, window + T + 5, *([1] * (T + 2)), 7, 3 * T]


def state(cache) -> list:
    """Everything a read can see, per layer, on the CPU: lengths, device lengths, live records,
    window and sink tokens."""
    out = []
    for i, layer in enumerate(cache._layers):
        out.append((
            (layer.n_tiles, layer.window_len, layer.sink_len),
            cache.device_lengths()[i].cpu(),
            layer.tiles[:, : layer.n_tiles].cpu(),
            *[t.cpu() for t in cache.window_kv(i) + cache.sink_kv(i)],
        ))
    return out


def assert_same_state(a: list, b: list, what: str = "") -> None:
    assert len(a) == len(b)
    for i, (la, lb) in enumerate(zip(a, b)):
        assert la[0] == lb[0], f"{what}: layer {i}: lengths {la[0]} != {lb[0]}"
        names = ("device lengths", "tile records", "window k", "window v", "sink k", "sink v")
        for name, x, y in zip(names, la[1:], lb[1:]):
            assert x.shape == y.shape, f"{what}: layer {i}: {name} shape {list(x.shape)} != {list(y.shape)}"
            if not torch.equal(x, y):
                bad = (x != y).nonzero()
                raise AssertionError(f"{what}: layer {i}: {name} differ in {len(bad)} places, first {bad[0].tolist()}")


def lengths_consistent(cache) -> None:
    """The device lengths equal the host-side lengths (every sequence of the batch)."""
    for i, layer in enumerate(cache._layers):
        want = torch.tensor([layer.n_tiles, layer.window_len, layer.sink_len], dtype=torch.int32)
        got = cache.device_lengths()[i].cpu()
        assert torch.equal(got, want[:, None].expand(3, cache.batch_size)), (i, got, want)


def inputs(cache, n: int, g: torch.Generator, form: str, device=None):
    """k, v [batch, heads, n, head_dim] in one of the forms append accepts: ``cache`` (the cache dtype,
    contiguous), ``view`` (a token range of a longer buffer: strided heads, an offset start) or
    ``float32``. On the CPU; with ``device``, also the same values on it in the same form:
    ``(k, v, k_device, v_device)``."""
    B, H, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    if form == "view":
        kb = realistic_kv(B, H, n + 9, D, generator=g, dtype=cache.dtype)
        vb = realistic_kv(B, H, n + 9, D, generator=g, dtype=cache.dtype)
        pick = lambda kb, vb: (kb[:, :, 5 : 5 + n], vb[:, :, 4 : 4 + n])  # noqa: E731
        out = pick(kb, vb)
        return out if device is None else (*out, *pick(kb.to(device), vb.to(device)))
    k = realistic_kv(B, H, n, D, generator=g, dtype=cache.dtype) * 1.5
    v = realistic_kv(B, H, n, D, generator=g, dtype=cache.dtype)
    out = (k.float(), v.float()) if form == "float32" else (k, v)
    return out if device is None else (*out, out[0].to(device), out[1].to(device))


def feed_and_compare(host, dev, chunks: list[int], seed: int, forms=("cache", "view", "float32")) -> None:
    """Append the same chunks to both caches (layer 0, then layer 1 if there is one), comparing after each."""
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(chunks):
        for layer in range(min(2, host.num_layers)):
            k, v, kd, vd = inputs(host, n, g, forms[i % len(forms)], dev.device)
            host.append(layer, k, v)
            dev.append(layer, kd, vd)
        assert_same_state(state(host), state(dev), f"seed {seed}, after chunk {i} ({n} tokens)")
        lengths_consistent(dev)


POISON = {"nan": float("nan"), "inf": float("inf"), "range": 2.0**49, "bound": 2.0**43}


def error_scenario(make_pair, kind: str, where: str, tensor: str) -> None:
    """A bad value (``POISON[kind]``) in a token that goes to the window, into a tile, or to the sink:
    the same error from both paths of ``make_pair() -> (host, dev)`` (bfloat16 caches with a sink,
    two layers), eager and in a deferred block, and no visible change. Sink tokens are never
    compressed, so there only NaN/Inf are errors."""
    host, dev = make_pair()
    T = host.spec.tile_tokens
    g = torch.Generator().manual_seed(sum(map(ord, kind + where + tensor)))
    to = lambda c, kv: tuple(x.to(c.device) for x in kv)  # noqa: E731
    other = inputs(host, 40, g, "cache")
    if where != "sink":  # fill the sink; the bad chunk then goes to the window or into tiles
        first = inputs(host, host.sink_tokens + 40, g, "cache")
        for c in (host, dev):
            c.append(0, *to(c, first))
    n = {"window": 30, "tile": host.window + 2 * T, "sink": 20}[where]
    k, v = inputs(host, n, g, "cache")
    row = {"window": n - 1, "tile": 50, "sink": 5}[where]
    (k if tensor == "k" else v)[0, 0, row, 3] = POISON[kind]
    before = [state(c) for c in (host, dev)]
    if where == "sink" and kind in ("range", "bound"):
        for c in (host, dev):
            c.append(0, *to(c, (k, v)))
        assert_same_state(state(host), state(dev), "sink token beyond the tile range")
        return
    messages = []
    for c in (host, dev):
        try:
            c.append(0, *to(c, (k, v)))
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"{kind} in a {where} token of {tensor} was accepted")
    assert messages[0] == messages[1] and messages[0].startswith(tensor), messages
    for c, b in zip((host, dev), before):
        assert_same_state(b, state(c), f"eager {kind} {where} {tensor}")
        assert int(c._errors.item()) == 0
    for c, b in zip((host, dev), before):
        try:
            with c.deferred_checks():
                c.append(1, *to(c, other))
                c.append(0, *to(c, (k, v)))
                c.append(0, *to(c, other))
                c.append(1, *to(c, other))
        except ValueError as e:
            assert str(e).startswith(messages[0]) and "restored" in str(e), str(e)
        else:
            raise AssertionError("the deferred block did not raise")
        assert_same_state(b, state(c), f"deferred {kind} {where} {tensor}")
        lengths_consistent(c)
    for c in (host, dev):  # both keep working
        c.append(0, *to(c, other))
    assert_same_state(state(host), state(dev), "after the errors")
