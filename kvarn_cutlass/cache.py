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
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from . import codec
from ._validate import check_device
from .format import DEFAULT_QUANTIZER, DEFAULT_SINKHORN_ITERS, TileSpec

CACHE_DTYPES = (torch.float16, torch.bfloat16)


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

    @property
    def seq_len(self) -> int:
        return self.sink_len + self.n_tiles * self.tile_tokens + self.window_len


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
        sinkhorn_iters: variance-normalization iterations of the codec.
        max_seq_len: optional capacity in tokens; preallocates the tile pool (needed to capture
            decode in CUDA graphs, since a growing pool moves). ``None`` grows the pool by doubling.
        quantizer: ``uniform`` (default) or ``lloyd_max`` (see ``kvarn_cutlass.format.QUANTIZERS``):
            how tile values are coded; stored in ``spec``.
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
        self.max_seq_len = max_seq_len
        capacity = 0 if max_seq_len is None else max(0, math.ceil((max_seq_len - sink_tokens) / T))
        self._layers = [self._new_layer(capacity) for _ in range(num_layers)]
        # int32 [2] error bits (inputs, compression) while a deferred_checks block is open, else None
        self._deferred: torch.Tensor | None = None

    # --- construction helpers ------------------------------------------------------------------
    def _new_layer(self, tile_capacity: int) -> _Layer:
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        z = lambda n: torch.zeros(B, H, n, D, dtype=self.dtype, device=self.device)  # noqa: E731
        tiles = torch.zeros(B, tile_capacity, H, self.spec.tile_nbytes, dtype=torch.uint8, device=self.device)
        return _Layer(tiles, self._identity_table(tile_capacity), 0, z(self.window), z(self.window), 0, z(self.sink_tokens), z(self.sink_tokens), 0,
                      self.spec.tile_tokens)

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

    def seq_len(self, layer: int) -> int:
        """Tokens held by ``layer`` (the same for every sequence of the batch)."""
        return self._layer(layer).seq_len

    def num_tiles(self, layer: int) -> int:
        return self._layer(layer).n_tiles

    def tile_bytes(self, layer: int) -> torch.Tensor:
        """uint8 [batch, n_tiles, num_kv_heads, tile_nbytes]: a view of the live records."""
        st = self._layer(layer)
        return st.tiles[:, : st.n_tiles]

    def tile_pool(self, layer: int) -> torch.Tensor:
        """The whole preallocated pool, uint8 [batch, tile_capacity, num_kv_heads, tile_nbytes]."""
        return self._layer(layer).tiles

    def tile_table(self, layer: int) -> torch.Tensor:
        """int32 [batch, tile_capacity]: the record slot of tile g of sequence b, ``tile_table[b, g] = s``, so
        that record (b, g, h) is ``tile_pool(layer).view(-1, num_kv_heads, tile_nbytes)[s, h]``.

        Kernels read tiles through this table (today the identity, ``s = b * tile_capacity + g``), so that
        a paged pool needs no kernel change. Moves with the pool when an unpreallocated pool grows."""
        return self._layer(layer).tile_table

    def buffers(self, layer: int) -> dict[str, torch.Tensor]:
        """The whole preallocated buffers of ``layer`` (stable addresses, for kernels and graphs):
        ``window_k``/``window_v`` [batch, num_kv_heads, window, head_dim] and ``sink_k``/``sink_v``
        [batch, num_kv_heads, sink_tokens, head_dim]; only their first window_len / sink_len tokens
        are live (``positions``)."""
        st = self._layer(layer)
        return {"window_k": st.window_k, "window_v": st.window_v, "sink_k": st.sink_k, "sink_v": st.sink_v}

    def window_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [batch, num_kv_heads, window_len, head_dim] of the newest unquantized tokens."""
        st = self._layer(layer)
        return st.window_k[:, :, : st.window_len], st.window_v[:, :, : st.window_len]

    def sink_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [batch, num_kv_heads, sink_len, head_dim] of the sink tokens."""
        st = self._layer(layer)
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
        return sum(
            t.numel() * t.element_size()
            for st in self._layers
            for t in (st.tiles, st.window_k, st.window_v, st.sink_k, st.sink_v)
        )

    # --- mutation ------------------------------------------------------------------------------
    def check_kv(self, name: str, x) -> None:
        """Raise TypeError/ValueError naming ``name`` unless x is a float [batch, num_kv_heads, n>=1, head_dim]
        tensor on the cache's device (what :meth:`append` accepts)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in codec.FLOAT_INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported: {list(codec.FLOAT_INPUT_DTYPES)}")
        want = (self.batch_size, self.num_kv_heads, self.head_dim)
        if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != want or x.shape[2] < 1:
            raise ValueError(
                f"{name} must have shape [batch={want[0]}, num_kv_heads={want[1]}, n_new>=1, head_dim={want[2]}], "
                f"got {list(x.shape)}"
            )
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but the cache is on {self.device}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n_new tokens to ``layer``.

        k, v: [batch, num_kv_heads, n_new, head_dim], float16/bfloat16/float32 on the cache's
        device, finite once converted to the cache dtype. On any error nothing is changed.
        """
        st = self._layer(layer)
        self.check_kv("k", k)
        self.check_kv("v", v)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        n = k.shape[2]
        if self.max_seq_len is not None and st.seq_len + n > self.max_seq_len:
            raise ValueError(
                f"appending {n} tokens to layer {layer} (holding {st.seq_len}) exceeds max_seq_len={self.max_seq_len}"
            )
        k = k.to(self.dtype)
        v = v.to(self.dtype)
        if self._deferred is None:
            if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):  # one host sync for both
                name = "k" if not torch.isfinite(k).all() else "v"
                raise ValueError(f"{name} contains NaN or Inf (after conversion to {self.dtype})")
        else:  # noted on the device, raised when the deferred_checks block ends
            bad = (~torch.isfinite(k).all()).to(torch.int32) + 2 * (~torch.isfinite(v).all()).to(torch.int32)
            self._deferred[0].bitwise_or_(bad)

        # Everything below computes new state first and commits only after compression succeeded.
        n_sink = min(self.sink_tokens - st.sink_len, n)
        rest_k, rest_v = k[:, :, n_sink:], v[:, :, n_sink:]
        stream_k = torch.cat((st.window_k[:, :, : st.window_len], rest_k), dim=2)
        stream_v = torch.cat((st.window_v[:, :, : st.window_len], rest_v), dim=2)
        T = self.spec.tile_tokens
        n_new_tiles = max(0, math.ceil((stream_k.shape[2] - self.window) / T))
        records = None
        if n_new_tiles:
            records = self._compress(stream_k[:, :, : n_new_tiles * T], stream_v[:, :, : n_new_tiles * T])
            if st.n_tiles + n_new_tiles > st.tiles.shape[1]:
                self._grow(st, st.n_tiles + n_new_tiles)

        if n_sink:
            st.sink_k[:, :, st.sink_len : st.sink_len + n_sink] = k[:, :, :n_sink]
            st.sink_v[:, :, st.sink_len : st.sink_len + n_sink] = v[:, :, :n_sink]
            st.sink_len += n_sink
        if records is not None:
            st.tiles[:, st.n_tiles : st.n_tiles + n_new_tiles] = records
            st.n_tiles += n_new_tiles
        keep = stream_k.shape[2] - n_new_tiles * T
        st.window_k[:, :, :keep] = stream_k[:, :, n_new_tiles * T :]
        st.window_v[:, :, :keep] = stream_v[:, :, n_new_tiles * T :]
        st.window_len = keep

    def _compress(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [B, H, n_tiles*T, D] -> records uint8 [B, n_tiles, H, tile_nbytes].

        On CUDA: one launch of the GPU compression kernel (byte-identical to the codec); it reads
        back a 4-byte error flag, so a codec error (e.g. float16 scale overflow) raises here,
        before the caller changes any state (inside ``deferred_checks``: the kernel ORs the error
        into the block's flag and nothing is read back).
        """
        if self.device.type == "cuda":
            from .ops.compress import compress_layer

            flag = None if self._deferred is None else self._deferred[1:]
            return compress_layer(k, v, self.spec, error_flag=flag)
        B, H, n, D = k.shape
        T = self.spec.tile_tokens
        to_tiles = lambda x: x.reshape(B, H, n // T, T, D).transpose(1, 2)  # noqa: E731
        return codec.encode_tiles(to_tiles(k), to_tiles(v), self.spec)

    def _grow(self, st: _Layer, needed: int) -> None:
        if self.max_seq_len is not None:
            raise AssertionError("a preallocated pool never grows (max_seq_len is checked first)")
        new_cap = max(needed, 2 * st.tiles.shape[1], 8)
        pool = torch.zeros(
            self.batch_size, new_cap, self.num_kv_heads, self.spec.tile_nbytes, dtype=torch.uint8, device=self.device
        )
        pool[:, : st.n_tiles] = st.tiles[:, : st.n_tiles]
        st.tiles, st.tile_table = pool, self._identity_table(new_cap)

    @contextlib.contextmanager
    def deferred_checks(self):
        """A block of appends that does not synchronize with the device.

        ``append`` normally checks its inputs for NaN/Inf and reads back the compression kernel's
        error flag before it changes anything: on a CUDA cache that is a host synchronization per
        call (per layer and chunk in a model's forward pass). Inside this block the same checks
        only set bits of a device-side flag, read once when the block ends. If a check failed, or
        the block raises, every layer is restored to its state at the start of the block and the
        error is raised then (ValueError, naming the input, for a failed check). Host-side checks
        (shapes, dtypes, devices, lengths) still raise at once. Blocks do not nest.
        """
        if self._deferred is not None:
            raise RuntimeError("deferred_checks blocks do not nest")
        saved = [
            (st.n_tiles, st.sink_len, st.window_len, st.sink_k[:, :, : st.sink_len].clone(),
             st.sink_v[:, :, : st.sink_len].clone(), st.window_k[:, :, : st.window_len].clone(),
             st.window_v[:, :, : st.window_len].clone())
            for st in self._layers
        ]

        def restore() -> None:
            for st, (n_tiles, sink_len, window_len, sk, sv, wk, wv) in zip(self._layers, saved):
                st.n_tiles, st.sink_len, st.window_len = n_tiles, sink_len, window_len
                st.sink_k[:, :, :sink_len] = sk
                st.sink_v[:, :, :sink_len] = sv
                st.window_k[:, :, :window_len] = wk
                st.window_v[:, :, :window_len] = wv

        self._deferred = flags = torch.zeros(2, dtype=torch.int32, device=self.device)
        try:
            yield self
            inputs, compression = flags.tolist()  # the block's one synchronization
        except BaseException:
            restore()
            raise
        finally:
            self._deferred = None
        if inputs or compression:
            restore()
            if inputs:
                what = f"{'k' if inputs & 1 else 'v'} contains NaN or Inf (after conversion to {self.dtype})"
            else:
                from .ops.compress import error_message

                what = error_message(compression, self.spec.scale_dtype, self.spec.quantizer)
            raise ValueError(f"{what}, in an append of a deferred_checks block; the cache is restored to its "
                             "state at the start of the block")

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

    def truncate(self, layer_or_all: int | None, new_len: int) -> None:
        """Drop the newest tokens so that the layer (or every layer, for ``None``) holds ``new_len``.

        Only tokens still unquantized can be dropped: rewinding into compressed tiles raises
        ValueError, and then no layer is changed.
        """
        layers = range(self.num_layers) if layer_or_all is None else [layer_or_all]
        states = [self._layer(i) for i in layers]
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
        for st in states:
            if new_len >= st.sink_len + st.n_tiles * self.spec.tile_tokens:
                st.window_len = new_len - st.sink_len - st.n_tiles * self.spec.tile_tokens
            else:  # no tiles yet: the cut falls inside the sink
                st.window_len = 0
                st.sink_len = new_len

    def __repr__(self) -> str:
        return (
            f"KVarNCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, preset={self.preset!r}, quantizer={self.quantizer!r}, window={self.window}, "
            f"sink={self.sink_tokens}, "
            f"dtype={self.dtype}, device={self.device})"
        )
