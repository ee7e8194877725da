"""KVarNCache: a per-layer KV cache of [sink tokens] [KVarN tiles ...] [fp16 window].

Token order in a layer: the first ``sink_tokens`` tokens stay unquantized for the sequence's
lifetime; then come compressed tiles of ``tile_tokens`` tokens each; the newest tokens (at most
``window``) are kept in the cache dtype. After every ``append`` the window holds at most ``window``
tokens: whenever it would hold more, its oldest full tiles are compressed, so the number of tiles
after n tokens is ``max(0, ceil((n - sink_tokens - window) / tile_tokens))`` whatever the split of
the ``append`` calls, and the tile records are byte-identical for any split.

Storage per layer (all on ``device``):

* ``tiles``: uint8 [batch, tile_capacity, num_kv_heads, tile_nbytes], records [b, i, h] of tile i
  (tokens ``sink + i*T .. sink + (i+1)*T - 1``); a pool laid out so that one KV head's walk over its
  tiles reads records ``tile_nbytes * num_kv_heads`` apart.
* ``window_k`` / ``window_v``: [batch, num_kv_heads, window, head_dim] in ``dtype``, valid prefix
  ``window_len`` (oldest first).
* ``sink_k`` / ``sink_v``: [batch, num_kv_heads, sink_tokens, head_dim], valid prefix ``sink_len``.

Lengths are kept twice, always equal between calls: on the host (every sequence of the batch has the
same lengths) and on the device, int32 ``device_lengths()`` [num_layers, 3, batch] (n_tiles,
window_len, sink_len), which the kernels read, so that CUDA graphs stay valid while a sequence grows.

Writes on CUDA (:mod:`kvarn_cutlass.ops.append`): ``append`` is one kernel launch, two when a tile
completes outside a :meth:`KVarNCache.deferred_checks` block (compressed on the GPU straight from the
window and the chunk), with no torch op; its checks set bits of a device-side error flag. Outside a
block the flag is read back at once (one 4-byte copy, the call's only synchronization) and a failed
append commits nothing: lengths and live tokens stay as they were (bytes past the live lengths, e.g.
unused pool slots, may change). Inside one the flag is read when the block ends, a tile-completing
append is one launch that also rewrites the window (a failed one may leave windows rewritten), and a
failure restores every layer from the backups the block took. ``deferred_checks(overlap_appends=True)``
runs the block's appends on a second stream of the cache, so that a tile's compression overlaps the
caller's later work (the rest of a model's forward pass); every read of a layer through the cache's
methods and the library's kernels waits for that layer's appends.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from . import codec
from ._validate import check_device
from .format import DEFAULT_QUANTIZER, DEFAULT_SINKHORN_ITERS, TileSpec
from .ops.append import INPUT_ORDER, Backup, DeviceAppender, error_message, plan_append

CACHE_DTYPES = (torch.float16, torch.bfloat16)
# "0": appends that complete tiles inside deferred_checks blocks take two launches, as outside them (A/B runs)
FUSED_APPEND_ENV = "KVARN_FUSED_APPEND"


@dataclass
class _Layer:
    tiles: torch.Tensor
    tile_table: torch.Tensor
    n_tiles: int
    window_k: torch.Tensor
    window_v: torch.Tensor
    window_len: int
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_len: int
    tile_tokens: int
    lens: torch.Tensor  # int32 [3, batch] on the device: n_tiles, window_len, sink_len
    buffers: object = None  # the window, sink and lens addresses the append kernels take (ops.append, at the first append)
    # inside deferred_checks(overlap_appends=True): the event of the layer's last append on the cache's write
    # stream, and the handle of the stream that last waited for it
    written: object = None
    awaited: int | None = None

    @property
    def seq_len(self) -> int:
        return self.sink_len + self.n_tiles * self.tile_tokens + self.window_len


@dataclass
class _Block:
    """An open deferred_checks block: the lengths at its start, the layers whose window (and sink) got
    a backup and by whom ("host": copied by the host, valid; "device": append_compress was given the
    buffers, valid only if that layer committed a tile since), and errors the host found."""

    lengths: list
    backed_up: dict
    host_bits: int = 0


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class KVarNCache:
    """Quantized KV cache for ``num_layers`` attention layers of one batch of sequences.

    Args:
        num_layers, batch_size, num_kv_heads: positive ints.
        head_dim: 64, 128 or 256.
        preset: tile preset (see ``kvarn_cutlass.format.PRESETS``), default ``k4v2_g128``.
        window: fp16 window in tokens: a multiple of the tile size, at least one tile (default 256).
        sink_tokens: 0 or a multiple of the tile size; the first tokens kept unquantized.
        dtype: float16 or bfloat16, the dtype of the window and sink.
        device: where every tensor of the cache lives (``cpu``, ``cpu:0``, ``cuda``, ``cuda:1``, a
            ``torch.device``); stored normalized in ``device`` (``cpu``, ``cuda:<index>``).
        scale_dtype: float16 (default) or float32 for the scales inside tile records.
        sinkhorn_iters: variance-normalization iterations of the codec (default 2; docs/accuracy.md has what the
            count buys).
        max_seq_len: optional capacity in tokens; preallocates the tile pool (needed to capture
            decode in CUDA graphs, since a growing pool moves). ``None`` grows the pool by doubling.
        quantizer: ``uniform`` (default) or ``lloyd_max`` (see ``kvarn_cutlass.format.QUANTIZERS``):
            how tile values are coded; stored in ``spec``.

    A cache is used from one host thread at a time: on CUDA its appends share one prepared launch per
    kernel across the layers (``ops.append``), rewritten by each call.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        preset: str = "k4v2_g128",
        window: int = 256,
        sink_tokens: int = 0,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        scale_dtype: torch.dtype = torch.float16,
        sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS,
        max_seq_len: int | None = None,
        quantizer: str = DEFAULT_QUANTIZER,
    ) -> None:
        self.num_layers = _positive_int("num_layers", num_layers)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.spec = TileSpec(preset=preset, head_dim=head_dim, scale_dtype=scale_dtype, sinkhorn_iters=sinkhorn_iters,
                             quantizer=quantizer)
        T = self.spec.tile_tokens
        if isinstance(window, bool) or not isinstance(window, int) or window < T or window % T:
            raise ValueError(f"window must be a multiple of the tile size {T} and at least {T}, got {window!r}")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0 or sink_tokens % T:
            raise ValueError(f"sink_tokens must be 0 or a multiple of the tile size {T}, got {sink_tokens!r}")
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {list(CACHE_DTYPES)}, got {dtype}")
        if max_seq_len is not None:
            _positive_int("max_seq_len", max_seq_len)
        self.window = window
        self.sink_tokens = sink_tokens
        self.dtype = dtype
        self.device = check_device(device)
        self._on_cuda = self.device.type == "cuda"
        self.max_seq_len = max_seq_len
        capacity = 0 if max_seq_len is None else max(0, math.ceil((max_seq_len - sink_tokens) / T))
        self._lens = torch.zeros(num_layers, 3, batch_size, dtype=torch.int32, device=self.device)
        self._layers = [self._new_layer(capacity, self._lens[i]) for i in range(num_layers)]
        self._init_write_state()
        # inside deferred_checks blocks, an append that completes tiles is one launch (ops.append's fused form)
        self._fuse_appends = os.environ.get(FUSED_APPEND_ENV, "1") != "0"
        if self._on_cuda:
            # plan once: the append kernels' lookups and prepared launches (~0.3 ms of host time on an H200
            # host), here rather than in the first append, where the GPU would wait for them
            self._writer = DeviceAppender(self)
            self._writer.prepare_launches(self._layers[0])

    # --- construction helpers ------------------------------------------------------------------
    def _init_write_state(self) -> None:
        # int32 error bits of the device-side checks (zero unless an append failed and is not yet raised)
        self._errors = torch.zeros(1, dtype=torch.int32, device=self.device)
        # append_commit's count of finished blocks (the last one commits; it resets the count)
        self._counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        # the fused append's per-(sequence, head, half) counts of CTAs done reading the window (each reset by the
        # CTA that completes it; ops.append.DeviceAppender.append)
        self._groups = torch.zeros(2 * self.batch_size * self.num_kv_heads, dtype=torch.int32, device=self.device)
        self._writer = None  # ops.append.DeviceAppender (on CUDA: built by the constructor)
        self._backups: dict[int, Backup] = {}  # per layer, allocated when a block or step graph needs one
        self._deferred: _Block | None = None
        # inside deferred_checks(overlap_appends=True) on CUDA: the stream the appends run on (made at the first
        # such block, kept for the cache's lifetime)
        self._overlap = False
        self._write_stream = None
        self._decode_plan = None  # kvarn_cutlass.decode.DecodePlan, made at the first decode (decode.get_plan)
        self._unchecked = None  # a step graph (kvarn_cutlass.step_graph) with replays not yet checked
        # (shape, dtype) of the last k, v that append accepted: the same again needs no full check
        self._accepted = None, None

    def _new_layer(self, tile_capacity: int, lens: torch.Tensor | None = None) -> _Layer:
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        z = lambda n: torch.zeros(B, H, n, D, dtype=self.dtype, device=self.device)  # noqa: E731
        tiles = torch.zeros(B, tile_capacity, H, self.spec.tile_nbytes, dtype=torch.uint8, device=self.device)
        if lens is None:
            lens = torch.zeros(3, B, dtype=torch.int32, device=self.device)
        return _Layer(tiles, self._identity_table(tile_capacity), 0, z(self.window), z(self.window), 0,
                      z(self.sink_tokens), z(self.sink_tokens), 0, self.spec.tile_tokens, lens)

    def _identity_table(self, tile_capacity: int) -> torch.Tensor:
        B = self.batch_size
        return torch.arange(B * tile_capacity, dtype=torch.int32, device=self.device).view(B, tile_capacity)

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def preset(self) -> str:
        return self.spec.preset

    @property
    def quantizer(self) -> str:
        return self.spec.quantizer

    # --- queries -------------------------------------------------------------------------------
    def _layer(self, layer) -> _Layer:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return self._layers[layer]

    def _layer_tensors(self, layer) -> _Layer:
        """``_layer`` for the accessors of a layer's device tensors: inside an overlapped block the current
        stream first waits for the layer's appends, so whatever reads the tensors next runs after them."""
        st = self._layer(layer)
        if self._overlap:
            self._await_layer(st)
        return st

    def _await_layer(self, st: _Layer) -> None:
        """Make the current stream wait for ``st``'s overlapped appends (once per stream and append)."""
        ev = st.written
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            if st.awaited != cur.cuda_stream:
                cur.wait_event(ev)
                st.awaited = cur.cuda_stream

    def await_writes(self) -> None:
        """Make the current stream wait for every overlapped append (``deferred_checks(overlap_appends=True)``)
        queued so far; a no-op outside such a block."""
        if self._overlap:
            for st in self._layers:
                self._await_layer(st)

    def seq_len(self, layer: int) -> int:
        """Tokens held by ``layer`` (the same for every sequence of the batch)."""
        return self._layer(layer).seq_len

    def num_tiles(self, layer: int) -> int:
        return self._layer(layer).n_tiles

    def tile_bytes(self, layer: int) -> torch.Tensor:
        """uint8 [batch, n_tiles, num_kv_heads, tile_nbytes]: a view of the live records."""
        st = self._layer_tensors(layer)
        return st.tiles[:, : st.n_tiles]

    def tile_pool(self, layer: int) -> torch.Tensor:
        """The whole preallocated pool, uint8 [batch, tile_capacity, num_kv_heads, tile_nbytes]."""
        return self._layer_tensors(layer).tiles

    def tile_table(self, layer: int) -> torch.Tensor:
        """int32 [batch, tile_capacity]: the record slot of tile g of sequence b, ``tile_table[b, g] = s``, so
        that record (b, g, h) is ``tile_pool(layer).view(-1, num_kv_heads, tile_nbytes)[s, h]``.

        Kernels read tiles through this table (today the identity, ``s = b * tile_capacity + g``), so that
        a paged pool needs no kernel change. Moves with the pool when an unpreallocated pool grows."""
        return self._layer_tensors(layer).tile_table

    def buffers(self, layer: int) -> dict[str, torch.Tensor]:
        """The whole preallocated buffers of ``layer`` (stable addresses, for kernels and graphs):
        ``window_k``/``window_v`` [batch, num_kv_heads, window, head_dim] and ``sink_k``/``sink_v``
        [batch, num_kv_heads, sink_tokens, head_dim]; only their first window_len / sink_len tokens
        are live (``positions``)."""
        st = self._layer_tensors(layer)
        return {"window_k": st.window_k, "window_v": st.window_v, "sink_k": st.sink_k, "sink_v": st.sink_v}

    def device_lengths(self) -> torch.Tensor:
        """int32 [num_layers, 3, batch] on the cache's device: (n_tiles, window_len, sink_len) of each layer
        and sequence, as the kernels read them (stable address; equal to the host-side lengths after
        every call, and updated by the append kernels in stream order)."""
        self.await_writes()
        return self._lens

    def window_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [batch, num_kv_heads, window_len, head_dim] of the newest unquantized tokens."""
        st = self._layer_tensors(layer)
        return st.window_k[:, :, : st.window_len], st.window_v[:, :, : st.window_len]

    def sink_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [batch, num_kv_heads, sink_len, head_dim] of the sink tokens."""
        st = self._layer_tensors(layer)
        return st.sink_k[:, :, : st.sink_len], st.sink_v[:, :, : st.sink_len]

    def positions(self, layer: int) -> dict[str, tuple[int, int]]:
        """Token ranges ``[start, stop)`` of the sink, tiles and window of ``layer``."""
        st = self._layer(layer)
        tiles_end = st.sink_len + st.n_tiles * self.spec.tile_tokens
        return {"sink": (0, st.sink_len), "tiles": (st.sink_len, tiles_end), "window": (tiles_end, st.seq_len)}

    def nbytes(self) -> int:
        """Bytes of live data: tile records plus unquantized sink and window tokens, all layers."""
        per_token = 2 * self.head_dim * self.dtype.itemsize * self.batch_size * self.num_kv_heads
        total = 0
        for st in self._layers:
            total += st.n_tiles * self.batch_size * self.num_kv_heads * self.spec.tile_nbytes
            total += (st.sink_len + st.window_len) * per_token
        return total

    def allocated_nbytes(self) -> int:
        """Bytes allocated by the cache's tensors (pool capacity, window and sink buffers)."""
        total = sum(
            t.numel() * t.element_size()
            for st in self._layers
            for t in (st.tiles, st.window_k, st.window_v, st.sink_k, st.sink_v)
        )
        return total + sum(
            t.numel() * t.element_size() for bk in self._backups.values()
            for t in (bk.window_k, bk.window_v, bk.sink_k, bk.sink_v)
        )

    # --- mutation ------------------------------------------------------------------------------
    def check_kv(self, name: str, x) -> None:
        """Raise TypeError/ValueError naming ``name`` unless x is a float [batch, num_kv_heads, n>=1, head_dim]
        tensor on the cache's device (what :meth:`append` accepts)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in codec.FLOAT_INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported: {list(codec.FLOAT_INPUT_DTYPES)}")
        s = x.shape
        if len(s) != 4 or s[0] != self.batch_size or s[1] != self.num_kv_heads or s[3] != self.spec.head_dim or s[2] < 1:
            want = (self.batch_size, self.num_kv_heads, self.head_dim)
            raise ValueError(
                f"{name} must have shape [batch={want[0]}, num_kv_heads={want[1]}, n_new>=1, head_dim={want[2]}], "
                f"got {list(x.shape)}"
            )
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but the cache is on {self.device}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n_new tokens to ``layer``.

        k, v: [batch, num_kv_heads, n_new, head_dim], float16/bfloat16/float32 on the cache's device,
        stored in the cache dtype. Rejected (ValueError naming the input): NaN/Inf after conversion to
        the cache dtype; for tokens that will be compressed (all but sink tokens) magnitudes above 2^48
        (the codec's input range) and, with float16 scales, above 2^42 (``codec.MAX_INPUT_ABS_F16_SCALES``:
        no tile holding one can be stored). Compression errors (float16 scale overflow) raise too. On
        any error nothing is changed.

        On CUDA: one kernel launch (two when a tile completes outside a :meth:`deferred_checks` block)
        and, outside a block, one read of the device-side error flag (the only host sync).
        """
        self._append(layer, k, v, False)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor, after_prefill: bool) -> None:
        """:meth:`append`; ``after_prefill``: the last kernel queued on the current stream is the fused prefill
        kernel of this chunk (``prefill_attention``), after which a tile-completing append on that stream is a
        programmatic dependent launch (:meth:`DeviceAppender.append`)."""
        # The hot path (a decode step's one token per layer) costs a few comparisons: a layer that is a
        # plain int in range, and k, v plain tensors of the shape and dtype of the last accepted pair on
        # the cache's device; anything else takes the full checks, which name the bad argument.
        st = self._layers[layer] if type(layer) is int and 0 <= layer < self.num_layers else self._layer(layer)
        if self._unchecked is not None:
            self._require_checked()
        shape, dtype = self._accepted
        if not (type(k) is torch.Tensor and type(v) is torch.Tensor and k.shape == shape and v.shape == shape
                and k.dtype is dtype and v.dtype is dtype and k.device == self.device and v.device == self.device):
            self._check_pair(k, v)
            shape, dtype = k.shape, None  # (k and v may differ in dtype: each is converted on its own)
        n = shape[2]
        if self.max_seq_len is not None and st.seq_len + n > self.max_seq_len:
            raise ValueError(
                f"appending {n} tokens to layer {layer} (holding {st.seq_len}) exceeds max_seq_len={self.max_seq_len}"
            )
        if dtype is not self.dtype:
            if k.dtype is not self.dtype:
                k = k.to(self.dtype)
            if v.dtype is not self.dtype:
                v = v.to(self.dtype)
        keep = st.window_len + n
        if st.sink_len == self.sink_tokens and keep <= self.window:
            n_sink = n_new = 0  # plan_append's answer when the sink is full and no tile completes (no call)
        else:
            n_sink, n_new, keep = plan_append(st.sink_len, st.window_len, n, self.sink_tokens, self.window,
                                              self.spec.tile_tokens)
        writer = self._writer
        if writer is None:  # a CPU cache (a CUDA cache's constructor builds its appender)
            self._append_host(layer, st, k, v, (n_sink, n_new, keep))
            return
        # the device path (kept inline: it is the hot path)
        blk = self._deferred
        backup = None
        fuse = False
        if n_new:
            if st.n_tiles + n_new > st.tiles.shape[1]:
                self._grow(st, st.n_tiles + n_new)
            if blk is not None:
                kind = blk.backed_up.get(layer)
                if kind is None:
                    backup = self._backup(layer)
                    fuse = self._fuse_appends
                    if not fuse:
                        blk.backed_up[layer] = "device"
                else:
                    fuse = kind == "fused"
        stream = self._write_stream if self._overlap else None
        writer.append(st, k, v, n, n_new, backup, stream, fuse, after_prefill)
        if fuse and backup is not None:  # launched: the backup is written whatever the append's checks find
            blk.backed_up[layer] = "fused"
        if stream is not None:
            ev = st.written = st.written or torch.cuda.Event()
            ev.record(stream)
            st.awaited = None
        if blk is None:
            self._raise_device_errors()
        st.n_tiles += n_new
        st.sink_len += n_sink
        st.window_len = keep

    def _check_pair(self, k, v) -> None:
        """The full checks of append's k and v (raising an error that names the argument); remembers the
        shape and dtype of a pair that passes, for the next calls' fast check."""
        self.check_kv("k", k)
        if not (isinstance(v, torch.Tensor) and v.shape == k.shape and v.dtype == k.dtype and v.device == k.device):
            self.check_kv("v", v)  # (v like k passes whenever k does)
            if k.shape != v.shape:
                raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        self._accepted = k.shape, k.dtype

    def _raise_device_errors(self) -> None:
        bits = int(self._errors.item())  # the call's one synchronization
        if bits:
            self._errors.zero_()
            raise ValueError(error_message(bits, self.dtype, self.spec))

    def _input_errors(self, k: torch.Tensor, v: torch.Tensor, n_sink: int) -> int:
        """The append kernels' input checks (ops.append.INPUT_ORDER bits) in torch, for the CPU path."""
        bits = 0
        f16_scales = self.spec.scale_dtype == torch.float16
        for x, (nonfinite, out_of_range, bound) in zip((k, v), INPUT_ORDER):
            x = x.detach()  # a check, not part of any graph (a model's k, v may require grad)
            if not bool(torch.isfinite(x).all()):
                bits |= nonfinite
            rest = x[:, :, n_sink:]
            if rest.numel():
                m = float(rest.abs().amax())
                if m > codec.MAX_INPUT_ABS:
                    bits |= out_of_range
                if f16_scales and m > codec.MAX_INPUT_ABS_F16_SCALES:
                    bits |= bound
        return bits

    def _append_host(self, layer: int, st: _Layer, k: torch.Tensor, v: torch.Tensor, plan) -> None:
        n_sink, n_new, keep = plan
        blk = self._deferred
        # after a failed append of the block, later ones are not checked: the device kernels see the flag set and
        # skip them, so the block's error names the first failing append's problems on either path
        bits = 0 if blk is not None and blk.host_bits else self._input_errors(k, v, n_sink)
        if bits:
            if blk is None:
                raise ValueError(error_message(bits, self.dtype, self.spec))
            blk.host_bits |= bits  # raised when the block ends, as on the device
        if blk is not None and blk.host_bits:
            # as on the device: a failed append, and every later one of the block, writes nothing; the
            # host-side lengths move on as if it had succeeded (the block restores them)
            if st.n_tiles + n_new > st.tiles.shape[1]:
                self._grow(st, st.n_tiles + n_new)
            st.n_tiles, st.sink_len, st.window_len = st.n_tiles + n_new, st.sink_len + n_sink, keep
            return
        # Everything below computes new state first and commits only after compression succeeded.
        rest_k, rest_v = k[:, :, n_sink:], v[:, :, n_sink:]
        T = self.spec.tile_tokens
        if n_new:
            stream_k = torch.cat((st.window_k[:, :, : st.window_len], rest_k), dim=2)
            stream_v = torch.cat((st.window_v[:, :, : st.window_len], rest_v), dim=2)
            records = self._compress(stream_k[:, :, : n_new * T], stream_v[:, :, : n_new * T])
            if st.n_tiles + n_new > st.tiles.shape[1]:
                self._grow(st, st.n_tiles + n_new)
            if blk is not None and layer not in blk.backed_up:
                self._backup_host(layer)
                blk.backed_up[layer] = "host"
        if n_sink:
            st.sink_k[:, :, st.sink_len : st.sink_len + n_sink] = k[:, :, :n_sink]
            st.sink_v[:, :, st.sink_len : st.sink_len + n_sink] = v[:, :, :n_sink]
            st.sink_len += n_sink
        if n_new:
            st.tiles[:, st.n_tiles : st.n_tiles + n_new] = records
            st.n_tiles += n_new
            st.window_k[:, :, :keep] = stream_k[:, :, n_new * T :]
            st.window_v[:, :, :keep] = stream_v[:, :, n_new * T :]
        else:
            st.window_k[:, :, st.window_len : keep] = rest_k
            st.window_v[:, :, st.window_len : keep] = rest_v
        st.window_len = keep
        self._store_lengths(st)

    def _compress(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [B, H, n_tiles*T, D] -> records uint8 [B, n_tiles, H, tile_nbytes] with the codec (the host path)."""
        B, H, n, D = k.shape
        T = self.spec.tile_tokens
        to_tiles = lambda x: x.reshape(B, H, n // T, T, D).transpose(1, 2)  # noqa: E731
        return codec.encode_tiles(to_tiles(k), to_tiles(v), self.spec)

    def _store_lengths(self, st: _Layer) -> None:
        """The host-side lengths of ``st`` into its device lengths (host paths: CPU appends, truncate)."""
        st.lens[0].fill_(st.n_tiles)
        st.lens[1].fill_(st.window_len)
        st.lens[2].fill_(st.sink_len)

    def _grow(self, st: _Layer, needed: int) -> None:
        if self.max_seq_len is not None:
            raise AssertionError("a preallocated pool never grows (max_seq_len is checked first)")
        if self._overlap:
            self._await_layer(st)  # the copy below reads tiles that queued appends write
        new_cap = max(needed, 2 * st.tiles.shape[1], 8)
        pool = torch.zeros(
            self.batch_size, new_cap, self.num_kv_heads, self.spec.tile_nbytes, dtype=torch.uint8, device=self.device
        )
        pool[:, : st.n_tiles] = st.tiles[:, : st.n_tiles]
        st.tiles, st.tile_table = pool, self._identity_table(new_cap)

    # --- failure recovery ----------------------------------------------------------------------
    def _backup(self, layer: int) -> Backup:
        """The backup buffers of ``layer`` (allocated on first use)."""
        bk = self._backups.get(layer)
        if bk is None:
            # uninitialized: every read of a backup follows its write (a full copy on the host path; on the
            # device path the append's window rows, and _restore copies back only those)
            B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
            e = lambda n: torch.empty(B, H, n, D, dtype=self.dtype, device=self.device)  # noqa: E731
            bk = self._backups[layer] = Backup(e(self.window), e(self.window), e(self.sink_tokens), e(self.sink_tokens))
        return bk

    def _backup_host(self, layer: int) -> None:
        st, bk = self._layers[layer], self._backup(layer)
        for name in ("window_k", "window_v", "sink_k", "sink_v"):
            getattr(bk, name).copy_(getattr(st, name))

    def _restore(self, lengths: list, backed_up: dict) -> None:
        """Put every layer back to ``lengths`` [(n_tiles, window_len, sink_len)] per layer, with the windows
        (and sinks) of ``backed_up`` layers from their backups where they changed; clear the error flag."""
        device_tiles = self._lens[:, 0, 0].tolist()  # what the device committed (a synchronization)
        for i, (st, (n_tiles, window_len, sink_len)) in enumerate(zip(self._layers, lengths)):
            kind = backed_up.get(i)
            # a fused append may have rewritten the window and failed (no length moved): copied back always
            if kind in ("host", "fused") or (kind == "device" and device_tiles[i] != n_tiles):
                bk = self._backups[i]
                # the device backup holds the window rows of the append that wrote it, at least window_len
                # of them (a layer's window only shrinks when a tile completes, and the first such append
                # of the block or step wrote the backup); the rows past window_len hold nothing anyone reads
                rows = slice(None) if kind == "host" else slice(0, window_len)
                st.window_k[:, :, rows].copy_(bk.window_k[:, :, rows])
                st.window_v[:, :, rows].copy_(bk.window_v[:, :, rows])
                if kind == "host":
                    st.sink_k.copy_(bk.sink_k)
                    st.sink_v.copy_(bk.sink_v)
            st.n_tiles, st.window_len, st.sink_len = n_tiles, window_len, sink_len
        want = torch.tensor(lengths, dtype=torch.int32)[:, :, None].expand(self._lens.shape)
        self._lens.copy_(want)
        self._errors.zero_()

    def _require_checked(self) -> None:
        if self._unchecked is not None:
            raise RuntimeError(
                "this cache has replayed decode steps whose errors were not checked yet: call check() on the "
                "StepGraph first (kvarn_cutlass.step_graph)"
            )

    @contextlib.contextmanager
    def deferred_checks(self, overlap_appends: bool = False):
        """A block of appends that does not synchronize with the device.

        ``append`` normally checks its inputs and the compression's scales before it changes anything:
        on a CUDA cache the checks run on the device and their error flag is read back per call (per
        layer and chunk in a model's forward pass), a host synchronization. Inside this block the flag
        is read once, when the block ends. If a check failed, or the block raises, every layer is
        restored to its state at the start of the block (lengths, sink and window tokens, tiles) and
        the error is raised then (ValueError naming the input for a failed check). Host-side checks
        (shapes, dtypes, devices, lengths) still raise at once. Blocks do not nest.

        How: an append that fails, and every append after it in the block, commits nothing (the device
        skips them); before the first append of a layer that rewrites its window (a tile completes;
        or a ``truncate``) the window is copied into a per-layer backup (the first use allocates the
        backup: two window-sized and two sink-sized buffers per layer), and the restore copies back the
        backups of layers that changed.

        overlap_appends: on a CUDA cache, the block's appends run on a second stream of the cache (made
        at the first such block, the device's default priority), each after the work queued so far on
        the caller's stream (what produced k, v and what reads the layer's window), so that compressing
        a layer's completed tiles overlaps the caller's next kernels instead of delaying them. Every
        read of a layer through this cache (its buffer accessors, ``device_lengths``, the library's
        prefill, decode and dequantize calls) makes the current stream wait for that layer's appends;
        at the end of the block the current stream waits for all of them. Work that reads the
        cache's tensors by other means inside the block must call :meth:`await_writes` first. No
        effect on a CPU cache.
        """
        if self._deferred is not None:
            raise RuntimeError("deferred_checks blocks do not nest")
        if not isinstance(overlap_appends, bool):
            raise TypeError(f"overlap_appends must be a bool, got {type(overlap_appends).__name__}")
        self._require_checked()
        blk = self._deferred = _Block([(st.n_tiles, st.window_len, st.sink_len) for st in self._layers], {})
        if overlap_appends and self._on_cuda:
            if self._write_stream is None:
                self._write_stream = torch.cuda.Stream(self.device)
            self._overlap = True
        try:
            yield self
            self._end_overlap()
            bits = blk.host_bits | int(self._errors.item())  # the block's one synchronization
        except BaseException:
            self._end_overlap()
            self._deferred = None
            self._restore(blk.lengths, blk.backed_up)
            raise
        self._deferred = None
        if bits:
            self._restore(blk.lengths, blk.backed_up)
            raise ValueError(f"{error_message(bits, self.dtype, self.spec)}, in an append of a deferred_checks block; "
                             "the cache is restored to its state at the start of the block")

    def _end_overlap(self) -> None:
        """The current stream waits for every overlapped append; later work needs no wait."""
        self.await_writes()
        self._overlap = False
        for st in self._layers:
            st.written = st.awaited = None

    def replace_layers(self, contents: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace the contents of layers, all or nothing (what SnapKV compaction re-assembles).

        contents: ``{layer: (k, v)}``, k and v as for :meth:`append`. Afterwards each layer holds
        exactly what an empty layer holds after ``append(layer, k, v)``: the same sink, tile records
        (byte for byte) and window. The data is copied into the layer's existing buffers, so their
        addresses stay (a preallocated pool is never reallocated). On any error (bad input,
        max_seq_len, compression) no layer is changed. Not allowed inside ``deferred_checks`` (its
        restore would not know the new contents).
        """
        if self._deferred is not None:
            raise RuntimeError("replace_layers cannot run inside a deferred_checks block")
        self._require_checked()
        if not isinstance(contents, dict):
            raise TypeError(f"contents must be a dict {{layer: (k, v)}}, got {type(contents).__name__}")
        staged = {}
        for layer, kv in contents.items():
            old = self._layer(layer)
            if not isinstance(kv, tuple) or len(kv) != 2:
                raise TypeError(f"contents[{layer}] must be a (k, v) tuple")
            # stage the layer: append to an empty stand-in (the same checks and encoder as append)
            # whose pool holds exactly the tiles that append makes (a max_seq_len pool never grows)
            n = kv[0].shape[2] if isinstance(kv[0], torch.Tensor) and kv[0].dim() == 4 else 0
            self._layers[layer] = self._new_layer(max(0, math.ceil((n - self.sink_tokens - self.window) / self.spec.tile_tokens)))
            try:
                self.append(layer, *kv)
            finally:
                staged[layer], self._layers[layer] = self._layers[layer], old
        # every allocation (a pool that must grow) before the first copy: an out-of-memory error
        # here leaves every layer's contents as they were (a grown pool holds the same tiles)
        for layer, new in staged.items():
            if new.n_tiles > self._layers[layer].tiles.shape[1]:
                self._grow(self._layers[layer], new.n_tiles)
        for layer, new in staged.items():
            st = self._layers[layer]
            st.tiles[:, : new.n_tiles] = new.tiles[:, : new.n_tiles]
            for name in ("window_k", "window_v", "sink_k", "sink_v"):
                getattr(st, name).copy_(getattr(new, name))
            st.n_tiles, st.window_len, st.sink_len = new.n_tiles, new.window_len, new.sink_len
            st.lens.copy_(new.lens)

    def truncate(self, layer_or_all: int | None, new_len: int) -> None:
        """Drop the newest tokens so that the layer (or every layer, for ``None``) holds ``new_len``.

        Only tokens still unquantized can be dropped: rewinding into compressed tiles raises
        ValueError, and then no layer is changed.
        """
        self._require_checked()
        layers = range(self.num_layers) if layer_or_all is None else [layer_or_all]
        states = [self._layer_tensors(i) for i in layers]  # (the copies below read and write them)
        if isinstance(new_len, bool) or not isinstance(new_len, int) or new_len < 0:
            raise ValueError(f"new_len must be a non-negative int, got {new_len!r}")
        for i, st in zip(layers, states):
            if new_len > st.seq_len:
                raise ValueError(f"new_len={new_len} exceeds layer {i}'s length {st.seq_len}")
            tiles_end = st.sink_len + st.n_tiles * self.spec.tile_tokens
            if st.n_tiles and new_len < tiles_end:
                raise ValueError(
                    f"new_len={new_len} rewinds layer {i} into compressed tiles (they end at token {tiles_end}); "
                    "only the fp16 window can be truncated"
                )
        blk = self._deferred
        for i, st in zip(layers, states):
            if blk is not None and i not in blk.backed_up:  # later appends overwrite what is cut off
                self._backup_host(i)
                blk.backed_up[i] = "host"
            if new_len >= st.sink_len + st.n_tiles * self.spec.tile_tokens:
                st.window_len = new_len - st.sink_len - st.n_tiles * self.spec.tile_tokens
            else:  # no tiles yet: the cut falls inside the sink
                st.window_len = 0
                st.sink_len = new_len
            self._store_lengths(st)

    def __repr__(self) -> str:
        return (
            f"KVarNCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, preset={self.preset!r}, quantizer={self.quantizer!r}, window={self.window}, "
            f"sink={self.sink_tokens}, "
            f"dtype={self.dtype}, device={self.device})"
        )
