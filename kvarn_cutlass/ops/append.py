"""The write path of a CUDA :class:`~kvarn_cutlass.cache.KVarNCache`: ``append`` in one or two launches.

Kernels (the append section of ``csrc/compress.cu``; arithmetic of where tokens go in
``csrc/append_plan.cuh``, mirrored by :func:`plan_append`), both reading the layer's lengths from the
device (``lens`` int32 [3, batch]: n_tiles, window_len, sink_len), so that one launch serves every
length and a CUDA graph can replay it while the sequence grows:

* ``append_compress``, only when a tile completes: compresses the completed tiles straight from
  (window, chunk) into their pool slots (byte-identical to :func:`kvarn_cutlass.codec.encode_tiles`;
  the compression arithmetic is the one of :func:`kvarn_cutlass.ops.compress.compress_layer`), checks
  every chunk token and, given backup buffers, copies the window into them;
* ``append_commit``: writes the sink and the window (checking the tokens itself when no tile
  completes) and commits the new lengths unless the error flag is set.

Errors go into an int32 flag on the device (``ERROR_BITS``). The kernels never clear it, do nothing
once it is set and commit nothing then, so a failed append changes no length and no live token. The
cache decides when the flag is read (at once, or at the end of a ``deferred_checks`` block).

Host cost per call (the FlashInfer model: plan once, then only launch): the launches of a layer are
prepared at its first append (every argument packed), and a call rewrites only the inputs' addresses
and strides, in one ``struct.pack_into`` per launch (:meth:`PreparedLaunch.writer`), then makes one
``cuLaunchKernelEx`` (two when a tile completes); no torch op, allocation or synchronization, unless
an input must be copied first (rows not 16-byte aligned, or a view of the cache's own buffers; the
cache converts inputs of another dtype to its own before).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from ..format import TileSpec
from ..runtime.spec import get_kernel
from . import compress as C

__all__ = [
    "AUX_ROWS",
    "COMMIT_THREADS",
    "ERROR_BITS",
    "APPEND_COMPRESS_SIGNATURE",
    "APPEND_COMMIT_SIGNATURE",
    "SNAPSHOT_SIGNATURE",
    "plan_append",
    "error_message",
    "Backup",
    "DeviceAppender",
]

AUX_ROWS = 256  # chunk rows one aux block of append_compress checks
COMMIT_THREADS = 256  # KVA_COMMIT_THREADS in compress.cu

# Input checks of an append, in the order KVarNCache raises them (k before v; within a tensor
# non-finite values, the codec's input range, then the float16-scale bound), then the compression
# kernel's scale errors (ops.compress.error_message) and the pool capacity.
K_NONFINITE, K_RANGE, V_NONFINITE, V_RANGE = 1 << 6, 1 << 7, 1 << 8, 1 << 9
K_BOUND, V_BOUND, CAPACITY = 1 << 10, 1 << 11, 1 << 12
INPUT_ORDER = ((K_NONFINITE, K_RANGE, K_BOUND), (V_NONFINITE, V_RANGE, V_BOUND))
_INPUT_BITS = K_NONFINITE | K_RANGE | K_BOUND | V_NONFINITE | V_RANGE | V_BOUND
ERROR_BITS = _INPUT_BITS | CAPACITY | 0x3F  # 0x3F: the compression kernel's scale bits


def plan_append(sink_len: int, window_len: int, n: int, sink_tokens: int, window: int,
                tile_tokens: int) -> tuple[int, int, int]:
    """Where an append of ``n`` tokens goes (``kva_plan`` in ``csrc/append_plan.cuh``).

    Returns ``(n_sink, n_new, keep)``: chunk tokens [0, n_sink) fill the sink; the rest join the
    stream window[0, window_len) ++ chunk[n_sink, n), whose oldest ``n_new`` whole tiles are
    compressed, leaving ``keep`` tokens (at most ``window``) as the new window.
    """
    n_sink = min(n, max(0, sink_tokens - sink_len))
    stream = window_len + n - n_sink
    n_new = -(-(stream - window) // tile_tokens) if stream > window else 0
    return n_sink, n_new, stream - n_new * tile_tokens


def error_message(bits: int, cache_dtype: torch.dtype, spec: TileSpec) -> str:
    """The message of the first error among the flag ``bits`` (see ``INPUT_ORDER``)."""
    names = ("k", "v")
    for name, (nonfinite, rng, bound) in zip(names, INPUT_ORDER):
        if bits & nonfinite:
            return f"{name} contains NaN or Inf (after conversion to {cache_dtype})"
        if bits & rng:
            return f"{name} has values of magnitude > 2^48, outside the codec's float32 range"
        if bits & bound:
            return (f"{name} has values of magnitude > 2^42, which no tile stored with float16 scales can hold "
                    "(codec.MAX_INPUT_ABS_F16_SCALES; scale_dtype=torch.float32 takes up to 2^48)")
    if bits & 0x3F:
        return C.error_message(bits & 0x3F, spec.scale_dtype, spec.quantizer)
    if bits & CAPACITY:
        return "the layer's tile pool is full (more tiles than tile_capacity)"
    raise ValueError(f"error flag {bits:#x} has no known bit")


APPEND_COMPRESS_SIGNATURE = (
    "ptr k", "ptr v", "i64 k_sb", "i64 k_sh", "i64 k_st", "i64 v_sb", "i64 v_sh", "i64 v_st",
    "ptr win_k", "ptr win_v", "ptr pool", "ptr table", "ptr lens", "ptr err", "ptr backup_k", "ptr backup_v",
    "i32 batch", "i32 n", "i32 sink_cap", "i32 window", "i32 heads", "i32 cap", "i32 max_new", "i32 aux_parts",
    "i32 aux_rows", "i32 iters",
    "i32 off_k_codes", "i32 off_chan_step", "i32 off_chan_min", "i32 off_row_scale",
    "i32 off_v_codes", "i32 off_tok_step", "i32 off_tok_min", "i32 off_col_scale", "f32 inv_sqrt_d",
)
APPEND_COMMIT_SIGNATURE = (
    "ptr k", "ptr v", "i64 k_sb", "i64 k_sh", "i64 k_st", "i64 v_sb", "i64 v_sh", "i64 v_st",
    "ptr win_k", "ptr win_v", "ptr sink_k", "ptr sink_v", "ptr lens", "ptr err", "ptr counter",
    "i32 batch", "i32 n", "i32 sink_cap", "i32 window", "i32 heads",
)
SNAPSHOT_SIGNATURE = ("ptr lens", "ptr saved", "ptr err", "i32 count")


def _index(signature: tuple[str, ...]) -> dict[str, int]:
    return {entry.split()[1]: i for i, entry in enumerate(signature)}


_A = _index(APPEND_COMPRESS_SIGNATURE)
_B_N = _index(APPEND_COMMIT_SIGNATURE)["n"]
# k, v, k_sb .. v_st: the leading arguments of both kernels, rewritten per call (one writer each)
_KV_ARGS = 8
_SECTIONS = ("k_codes", "chan_step", "chan_min", "row_scale", "v_codes", "tok_step", "tok_min", "col_scale")


@dataclass
class Backup:
    """A layer's copy of its window (and sink), [batch, num_kv_heads, window / sink_tokens, head_dim]:
    what a failed deferred block or step graph restores."""

    window_k: torch.Tensor
    window_v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor


class _LayerLaunches:
    """Prepared launches of one layer's buffers; pointers refreshed when the pool moves.

    ``bounds``: the sorted [start, end) addresses of the layer's window and sink buffers, flattened, so
    that an address lies inside one of them iff ``bisect_right(bounds, p)`` is odd (the buffers are
    separate allocations, hence disjoint). ``n``: the chunk length the commit launch holds now."""

    __slots__ = ("compress", "commit", "pool", "bounds", "compress_kv", "commit_kv", "commit_n", "n")

    def __init__(self, compress, commit, pool: torch.Tensor, bounds: list[int], n: int):
        self.compress, self.commit, self.pool, self.bounds, self.n = compress, commit, pool, bounds, n
        self.compress_kv = compress.writer(0, _KV_ARGS)
        self.commit_kv = commit.writer(0, _KV_ARGS)
        self.commit_n = commit.writer(_B_N, 1)


def _kernel_ready(x: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """(x, its address, its strides) if the kernels can read x as it is, else the same for a fresh contiguous
    copy (a new allocation: 16-byte aligned, aliasing nothing): see DeviceAppender.append."""
    p, s = x.data_ptr(), x.stride()
    if s[3] != 1 or p % 16 or (s[0] | s[1] | s[2]) % 8 or bisect_right(bounds, p) & 1:
        x = x.clone(memory_format=torch.contiguous_format)
        p, s = x.data_ptr(), x.stride()
    return x, p, s


class DeviceAppender:
    """The append kernels of one CUDA :class:`~kvarn_cutlass.cache.KVarNCache` (its dtype and spec).

    The cache owns the state the kernels read and write: per layer the buffers and ``lens``; the error
    flag ``errors`` and the commit counter ``counter`` (int32 [1] each, zero between launches).

    ``kernels``: the (append_compress, append_commit, append_snapshot) kernels to launch instead of the
    compiled ones (:class:`~kvarn_cutlass.runtime.Kernel` objects with the signatures of this module),
    for running the host side without a GPU (tests, ``tools/host_overhead.py``).
    """

    def __init__(self, cache, kernels=None) -> None:
        spec: TileSpec = cache.spec
        if cache.dtype not in C.APPEND_DTYPES:
            raise TypeError(f"the device append needs a float16 or bfloat16 cache, got {cache.dtype}")
        self.cache = cache
        self.spec = spec
        self.device = cache.device
        # stand-in kernels have no module to report their shared memory, and launch nothing
        self.smem = 0
        if kernels is None:
            kspec = C.compress_spec(spec.tile_tokens, spec.head_dim, cache.dtype, spec.scale_dtype, spec.v_bits,
                                    spec.quantizer)
            name = lambda role: C.kernel_name(spec.tile_tokens, spec.head_dim, cache.dtype,  # noqa: E731
                                              spec.scale_dtype, spec.v_bits, spec.quantizer, role)
            idx = self.device.index
            kernels = (get_kernel(kspec, name("append_compress"), APPEND_COMPRESS_SIGNATURE, idx),
                       get_kernel(kspec, name("append_commit"), APPEND_COMMIT_SIGNATURE, idx),
                       get_kernel(kspec, name("append_snapshot"), SNAPSHOT_SIGNATURE, idx))
            self.smem = C._module_smem_bytes(kspec, idx)["compress_cta"]  # append_compress is one-CTA compression
            limit = C._smem_limit(idx)
            if self.smem > limit:
                raise ValueError(f"compression of T={spec.tile_tokens}, D={spec.head_dim} needs {self.smem} bytes "
                                 f"of shared memory per block, {self.device} has {limit}")
        self._compress, self._commit, self._snapshot = kernels
        self._offsets = tuple(spec.offset(s) for s in _SECTIONS)
        self._inv_sqrt_d = C._inv_sqrt(spec.head_dim)

    # --- launches ----------------------------------------------------------------------------------
    def _prepare(self, st, k: torch.Tensor, v: torch.Tensor, n: int, max_new: int, backup: Backup | None):
        c = self.cache
        B, H = c.batch_size, c.num_kv_heads
        common = (k, v, *k.stride()[:3], *v.stride()[:3])
        cap = st.tiles.shape[1]
        aux_parts = -(-n // AUX_ROWS)
        a = self._compress.prepare(
            (B * H * (max_new + aux_parts), 2), C.THREADS,
            (*common, st.window_k, st.window_v, st.tiles, st.tile_table, st.lens, c._errors,
             None if backup is None else backup.window_k, None if backup is None else backup.window_v,
             B, n, c.sink_tokens, c.window, H, cap, max_new, aux_parts, AUX_ROWS, self.spec.sinkhorn_iters,
             *self._offsets, self._inv_sqrt_d),
            shared_mem=self.smem,
        )
        b = self._commit.prepare(
            (B * H, 2), COMMIT_THREADS,
            (*common, st.window_k, st.window_v, st.sink_k, st.sink_v, st.lens, c._errors, c._counter,
             B, n, c.sink_tokens, c.window, H),
        )
        return a, b

    def _launches(self, st, k, v, n) -> _LayerLaunches:
        """The layer's prepared launches: made at its first append, re-pointed when its pool grew."""
        ls = st.device
        if ls is None:
            a, b = self._prepare(st, k, v, n, 1, None)
            spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                           for t in (st.window_k, st.window_v, st.sink_k, st.sink_v) if t.numel())
            ls = st.device = _LayerLaunches(a, b, st.tiles, [p for span in spans for p in span], n)
        if ls.pool is not st.tiles:  # the pool grew (no max_seq_len)
            ls.compress.set_arg(_A["pool"], st.tiles.data_ptr())
            ls.compress.set_arg(_A["table"], st.tile_table.data_ptr())
            ls.compress.set_arg(_A["cap"], st.tiles.shape[1])
            ls.pool = st.tiles
        return ls

    def append(self, st, k: torch.Tensor, v: torch.Tensor, n: int, n_new: int, backup: Backup | None) -> None:
        """Enqueue the append of k, v [batch, heads, n, head_dim] (cache dtype, on the device) to the layer
        ``st``, of which ``n_new`` tiles complete (``plan_append``; 0: one launch). ``backup``: buffers
        that append_compress fills with the window before the append, when a tile completes."""
        ls = st.device
        if ls is None or ls.pool is not st.tiles:
            ls = self._launches(st, k, v, n)
        # The layout the kernels read (16-byte aligned rows, contiguous channels), and not a view of the
        # cache's own buffers, which the kernels rewrite while reading the input; else a copy. One
        # condition for both tensors (this is the whole per-call cost of the checks).
        bounds = ls.bounds
        kp, vp = k.data_ptr(), v.data_ptr()
        k0, k1, k2, k3 = k.stride()
        v0, v1, v2, v3 = v.stride()
        if (k3 != 1 or v3 != 1 or (kp | vp) % 16 or (k0 | k1 | k2 | v0 | v1 | v2) % 8
                or (bisect_right(bounds, kp) | bisect_right(bounds, vp)) & 1):
            k, kp, (k0, k1, k2, _) = _kernel_ready(k, bounds)
            v, vp, (v0, v1, v2, _) = _kernel_ready(v, bounds)
        if n_new:
            a = ls.compress
            aux_parts = -(-n // AUX_ROWS)
            ls.compress_kv(kp, vp, k0, k1, k2, v0, v1, v2)
            a.set_arg(_A["n"], n)
            a.set_arg(_A["max_new"], n_new)
            a.set_arg(_A["aux_parts"], aux_parts)
            a.set_arg(_A["backup_k"], 0 if backup is None else backup.window_k.data_ptr())
            a.set_arg(_A["backup_v"], 0 if backup is None else backup.window_v.data_ptr())
            a.set_grid(self.cache.batch_size * self.cache.num_kv_heads * (n_new + aux_parts), 2)
            a.launch()
        ls.commit_kv(kp, vp, k0, k1, k2, v0, v1, v2)
        if n != ls.n:  # decode appends one token per call: n rarely changes
            ls.commit_n(n)
            ls.n = n
        ls.commit.launch()

    def prepare_step(self, st, k: torch.Tensor, v: torch.Tensor, backup: Backup):
        """Launches for a step graph: append the static k, v [batch, heads, n, head_dim] with both kernels
        (append_compress sized for the most tiles n tokens can complete, its blocks predicated on the
        device lengths) and the window backed up whenever a tile completes. Returns a callable that
        enqueues them (call it inside the capture)."""
        n = k.shape[2]
        max_new = -(-n // self.spec.tile_tokens)
        a, b = self._prepare(st, k, v, n, max_new, backup)

        def enqueue() -> None:
            a.launch()
            b.launch()

        return enqueue

    def prepare_snapshot(self, saved: torch.Tensor):
        """A launch copying the cache's lens [num_layers, 3, batch] into ``saved`` unless the error flag is
        set (a step graph's record of the lengths before its last clean step)."""
        c = self.cache
        return self._snapshot.prepare(1, 256, (c._lens, saved, c._errors, c._lens.numel()))

