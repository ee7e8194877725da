"""A whole decode step -- for every layer: append the new token's K/V, then decode attention -- in one
CUDA graph, replayed while the sequence grows across tile boundaries.

::

    graph = StepGraph(cache, num_q_heads=32)        # cache: CUDA, max_seq_len set
    for _ in range(steps):
        graph.k.copy_(k_new); graph.v.copy_(v_new)  # [num_layers, batch, num_kv_heads, 1, head_dim]
        graph.q.copy_(q_new)                        # [num_layers, batch, num_q_heads, 1, head_dim]
        out = graph.replay()                        # graph.out; no host synchronization
    graph.check()                                   # raises a failed step's error (see below)

A real model computes layer l + 1's q, k, v from layer l's output; this graph holds the attention
part of every layer (what ``kvarn_cutlass`` owns) back to back, which is what a model's step graph
would contain between its own kernels.

Topology (fixed): a snapshot of the device lengths (``cache.device_lengths()``, taken only while the
error flag is clean), then per layer ``append_compress`` (at most one tile per sequence and head, its
blocks predicated on the lengths the kernels read on the device, and a copy of the window into the
layer's backup when a tile completes), ``append_commit``, and the two decode kernels, which read the
same device lengths (and the layer's ``tile_table``). The host keeps its copy of the lengths by replaying the same arithmetic
(:func:`kvarn_cutlass.ops.append.plan_append`) after each replay.

Errors: the append kernels set the cache's device-side error flag, and once it is set every later
append of every replay commits nothing, and the snapshot stops: the snapshot then holds the lengths
before the failed step and the backups the windows it rewrote. :meth:`StepGraph.check` reads the
flag (one synchronization) and, if set, restores the cache to its state before the failed step and
raises ValueError. Until then the cache refuses eager writes (``RuntimeError``); outputs of steps
from the failed one on are meaningless.
"""

from __future__ import annotations

import torch

from ._validate import resolve_scale
from .cache import KVarNCache
from .ops.append import error_message, plan_append

__all__ = ["StepGraph", "StepAppends"]


class StepAppends:
    """The append half of a step graph: ``n`` static tokens per layer, appended to every layer.

    Args:
        cache: the cache (its writer: :class:`kvarn_cutlass.ops.append.DeviceAppender` on CUDA).
        k, v: static inputs [num_layers, batch, num_kv_heads, n, head_dim] in the cache dtype.

    :meth:`enqueue_snapshot` and :meth:`enqueue` (per layer) enqueue the device work (what a graph
    captures); :meth:`advance` updates the host-side lengths after the work of one step ran;
    :meth:`check` reads the error flag and restores a failed step.
    """

    def __init__(self, cache: KVarNCache, k: torch.Tensor, v: torch.Tensor):
        if cache._writer is None:  # a CUDA cache's constructor makes its appender
            raise ValueError(f"cache is on {cache.device}: a step graph's appends need a CUDA cache")
        self.cache = cache
        self.n = k.shape[3]
        # the lengths before the last step that started with a clean error flag
        self.saved = cache.device_lengths().clone()
        self._snapshot = cache._writer.prepare_snapshot(self.saved)
        self._layers = [
            cache._writer.prepare_step(cache._layers[i], k[i], v[i], cache._backup(i)) for i in range(cache.num_layers)
        ]

    def enqueue_snapshot(self) -> None:
        self._snapshot.launch()

    def enqueue(self, layer: int) -> None:
        self._layers[layer]()

    def check_capacity(self) -> None:
        """Raise ValueError (before any work) if a step would exceed ``max_seq_len``."""
        c = self.cache
        for i, st in enumerate(c._layers):
            if st.seq_len + self.n > c.max_seq_len:
                raise ValueError(f"a step appends {self.n} tokens to layer {i} (holding {st.seq_len}), "
                                 f"exceeding max_seq_len={c.max_seq_len}")

    def advance(self) -> None:
        """The host-side lengths of every layer after one step (as the device computes them)."""
        c = self.cache
        n, sink, window, T = self.n, c.sink_tokens, c.window, c.spec.tile_tokens
        for st in c._layers:
            keep = st.window_len + n
            if st.sink_len == sink and keep <= window:
                st.window_len = keep  # plan_append's answer when the sink is full and no tile completes (no call)
                continue
            n_sink, n_new, keep = plan_append(st.sink_len, st.window_len, n, sink, window, T)
            st.n_tiles += n_new
            st.sink_len += n_sink
            st.window_len = keep
        c._unchecked = self

    def check(self) -> None:
        """Read the error flag (one synchronization); on an error restore the cache to its state before the
        failed step and raise ValueError."""
        c = self.cache
        if c._unchecked is not self:
            return
        c._unchecked = None
        bits = int(c._errors.item())
        if bits:
            lengths = self.saved[:, :, 0].tolist()
            c._restore(lengths, {i: "device" for i in range(c.num_layers)})
            raise ValueError(f"{error_message(bits, c.dtype, c.spec)}, in a replayed step; the cache is restored to "
                             "its state before that step")


class StepGraph:
    """One decode step of every layer of ``cache`` (append one token, then decode attention) captured in a
    CUDA graph.

    Args:
        cache: a :class:`KVarNCache` on CUDA with ``max_seq_len`` set (preallocated pools, stable
            addresses) and room for at least one tile.
        num_q_heads: query heads (a multiple of num_kv_heads, group <= 8).
        dtype: query dtype, float16 or bfloat16.
        scale: softmax scale, default 1/sqrt(head_dim).

    Attributes (static tensors the graph reads and writes): ``q`` [num_layers, batch, num_q_heads, 1,
    head_dim] in ``dtype``; ``k``, ``v`` [num_layers, batch, num_kv_heads, 1, head_dim] in the cache
    dtype; ``out`` like ``q``; ``graph`` (``torch.cuda.CUDAGraph``).

    Capturing neither reads nor changes the cache (the decode kernels are warmed up on a side stream,
    the append kernels only prepared); allocate it outside any ``deferred_checks`` block.
    """

    def __init__(self, cache: KVarNCache, num_q_heads: int, dtype: torch.dtype = torch.float16,
                 scale: float | None = None):
        from . import decode as dec

        if not isinstance(cache, KVarNCache):
            raise TypeError(f"cache must be a KVarNCache, got {type(cache).__name__}")
        if cache.device.type != "cuda":
            raise ValueError(f"cache must be on a CUDA device, got {cache.device}")
        if cache.max_seq_len is None:
            raise ValueError("cache must be created with max_seq_len (preallocated pools) to capture a step graph")
        if cache.tile_pool(0).shape[1] == 0:
            raise ValueError(f"max_seq_len={cache.max_seq_len} leaves no room for a tile; a step graph needs one")
        if cache._deferred is not None:
            raise RuntimeError("a StepGraph cannot be built inside a deferred_checks block")
        cache._require_checked()
        if dtype not in dec.Q_DTYPES:
            raise TypeError(f"dtype must be one of {list(dec.Q_DTYPES)}, got {dtype}")
        H = cache.num_kv_heads
        if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < H or num_q_heads % H \
                or num_q_heads // H > dec.MAX_GROUP:
            raise ValueError(f"num_q_heads must be num_kv_heads={H} x group 1..{dec.MAX_GROUP}, got {num_q_heads!r}")
        self.cache = cache
        self.scale = resolve_scale(scale, cache.head_dim)
        L, B, D, dev = cache.num_layers, cache.batch_size, cache.head_dim, cache.device
        self.q = torch.zeros(L, B, num_q_heads, 1, D, dtype=dtype, device=dev)
        self.k = torch.zeros(L, B, H, 1, D, dtype=cache.dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.appends = StepAppends(cache, self.k, self.v)
        buf0 = cache.buffers(0)
        cap = cache.tile_pool(0).shape[1]
        # a workspace like the one decode_attention's plan makes (DecodePlan.workspace: the same variant, grid and
        # kernel), its own so that the graph and eager calls on other streams never share one
        W, SC = buf0["window_k"].shape[2], buf0["sink_k"].shape[2]
        variant = dec.plan_variant(B, H, cap, W, SC, dev, cache.spec)
        workspace = dec.DecodeWorkspace(
            dev, B, H, num_q_heads // H, D, dec.choose_splits(B, H, cap, dev, cache.spec, variant=variant),
            dec.exact_blocks(cache.spec, W, SC, dev, variant), variant=variant,
        )
        prepared: dict = {}
        lens = cache.device_lengths()

        def attend(layer: int) -> None:
            buf = cache.buffers(layer)
            dec.decode_attention_ragged(
                self.q[layer], cache.tile_pool(layer), buf["window_k"], buf["window_v"], buf["sink_k"], buf["sink_v"],
                lens[layer, 0], lens[layer, 1], lens[layer, 2], cache.spec, scale=self.scale, out=self.out[layer],
                workspace=workspace, tile_table=cache.tile_table(layer), _prepared=prepared,
            )

        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # loads the decode module and prepares its launches; writes only out
            for layer in range(L):
                attend(layer)
        torch.cuda.current_stream(dev).wait_stream(side)
        self._workspace = workspace  # the graph holds its pointers
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.appends.enqueue_snapshot()
            for layer in range(L):
                self.appends.enqueue(layer)
                attend(layer)

    def replay(self) -> torch.Tensor:
        """Run one step (no host synchronization); returns the static ``out``."""
        c = self.cache
        if c._deferred is not None:
            raise RuntimeError("StepGraph.replay cannot run inside a deferred_checks block")
        if c._unchecked is not None and c._unchecked is not self.appends:
            raise RuntimeError("another StepGraph of this cache has unchecked replays: call its check() first")
        self.appends.check_capacity()
        self.graph.replay()
        self.appends.advance()
        return self.out

    def check(self) -> None:
        """Raise the error of the first failed step since the last check (ValueError), with the cache restored
        to its state before that step; a no-op if no step ran since."""
        self.appends.check()
