"""The write path of a CUDA :class:`~kvarn_cutlass.cache.KVarNCache`: ``append`` in one or two launches.

Kernels (the append section of ``csrc/compress.cu``; arithmetic of where tokens go in
``csrc/append_plan.cuh``, mirrored by :func:`plan_append`), both reading the layer's lengths from the
device (``lens`` int32 [3, batch]: n_tiles, window_len, sink_len), so that one launch serves every
length and a CUDA graph can replay it while the sequence grows:

* ``append_compress``, only when a tile completes: compresses the completed tiles straight from
  (window, chunk) into their pool slots (byte-identical to :func:`kvarn_cutlass.codec.encode_tiles`;
  the compression arithmetic is the one of :func:`kvarn_cutlass.ops.compress.compress_layer`), checks
  every chunk token and, given backup buffers, copies the window into them. Two forms, chosen per
  launch like the layer kernel's (:func:`kvarn_cutlass.ops.compress.cluster_halves`): a thread-block
  cluster of ``tile_tokens / 16`` CTAs per record half (``append_compress_cluster``, sm_90) while the
  launch's halves fit as clusters (at batch 1 with 8 KV heads up to 4 tiles per head at T=128: a
  512-token chunk), else one CTA per half (``append_compress``);
* ``append_commit``: writes the sink and the window (checking the tokens itself when no tile
  completes; the rows split over ``commit_parts`` blocks per sequence, head and half) and commits the
  new lengths unless the error flag is set.
* the fused form, inside a ``deferred_checks`` block (``fuse``): ``append_compress`` alone, given the
  group counts ``KVarNCache._groups``, does the commit's work too: each (sequence, head, half)'s sink and
  window are written by the CTA that completes the count of the group's CTAs done reading the window, the
  lengths by the launch's last CTA (on a clean flag); a failure may leave windows rewritten, which the
  block's restore copies back from the backups (always written in this form).

Errors go into an int32 flag on the device (``ERROR_BITS``). The kernels never clear it, do nothing
once it is set and commit nothing then, so a failed append changes no length and no live token. The
cache decides when the flag is read (at once, or at the end of a ``deferred_checks`` block).

Host cost per call (the FlashInfer model: plan once, then only launch): a cache prepares each kernel's
launch once, at the first append that needs it (every argument packed), for all its layers; a call
rewrites only the inputs' addresses and strides and the layer's buffers, in two ``struct.pack_into``
per launch (:meth:`PreparedLaunch.writer`), then makes one ``cuLaunchKernelEx`` (two when a tile
completes, the compression in the form that call's tile count picks); no torch op, allocation or
synchronization, unless
an input must be copied first (rows not 16-byte aligned, or a view of the cache's own buffers; the
cache converts inputs of another dtype to its own before).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch

from ..format import TileSpec
from ..runtime.compiler import default_backend
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
    "commit_parts",
    "error_message",
    "Backup",
    "ClusterForm",
    "DeviceAppender",
]

AUX_ROWS = 256  # chunk rows one aux CTA of append_compress checks (either form)
COMMIT_THREADS = 256  # KVA_COMMIT_THREADS in compress.cu
# append_commit splits a (sequence, head, half)'s rows over blocks of about this many rows, while the launch
# stays within COMMIT_BLOCKS blocks: a 512-token chunk's 256 window rows a head took ~7 us as one block's
# serial copy at batch 1 (16 blocks on 132 SMs).
COMMIT_ROWS_PER_BLOCK = 64
COMMIT_BLOCKS = 128
PDL_ENV = "KVARN_APPEND_PDL"  # 0: no programmatic launch after the fused prefill kernel (DeviceAppender.programmatic)

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


def commit_parts(n: int, window: int, pairs: int) -> int:
    """Blocks per (sequence, head, half) of append_commit (its grid's z) for appends of ``n`` tokens with
    ``pairs`` = batch * heads: min(n, window) rows in shares of ``COMMIT_ROWS_PER_BLOCK``, within
    ``COMMIT_BLOCKS`` blocks. That is the rows a growing window takes, and for a chunk of at least ``window``
    tokens the rows a rewrite keeps (a shorter chunk's rewrite may keep more rows than it has blocks for; the
    split is a cost choice, any count is correct). One token (a decode step) gives 1."""
    by_rows = -(-min(n, window) // COMMIT_ROWS_PER_BLOCK)
    return max(1, min(by_rows, COMMIT_BLOCKS // (2 * pairs)))


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
    "ptr sink_k", "ptr sink_v", "ptr counter", "ptr groups",
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
_B = _index(APPEND_COMMIT_SIGNATURE)
# k, v, k_sb .. v_st: the leading arguments of both kernels, rewritten per call (one writer each)
_KV_ARGS = 8
# then the layer's buffers, rewritten per call too (one writer each): append_compress's win_k, win_v, pool, table,
# lens and append_commit's win_k, win_v, sink_k, sink_v, lens
_LAYER_ARGS = 5
assert _A["win_k"] == _B["win_k"] == _KV_ARGS and _A["lens"] == _B["lens"] == _KV_ARGS + _LAYER_ARGS - 1
# append_compress's last arguments, the fused form's (sink_k, sink_v, counter, groups; groups 0: two launches),
# rewritten per call by one writer
_FUSED_ARGS = 4
assert _A["groups"] == len(APPEND_COMPRESS_SIGNATURE) - 1 == _A["sink_k"] + _FUSED_ARGS - 1
_SECTIONS = ("k_codes", "chan_step", "chan_min", "row_scale", "v_codes", "tok_step", "tok_min", "col_scale")


@dataclass
class Backup:
    """A layer's copy of its window (and sink), [batch, num_kv_heads, window / sink_tokens, head_dim]:
    what a failed deferred block or step graph restores."""

    window_k: torch.Tensor
    window_v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor


@dataclass(frozen=True)
class ClusterForm:
    """append_compress on thread-block clusters (``append_compress_cluster``, sm_90): ``kernel`` (a
    :class:`~kvarn_cutlass.runtime.Kernel` with :data:`APPEND_COMPRESS_SIGNATURE`), ``ranks`` CTAs of
    ``threads`` per record half, ``smem`` bytes of dynamic shared memory per CTA, and ``max_halves``, the
    most record halves one launch runs as clusters (:func:`kvarn_cutlass.ops.compress.cluster_halves`)."""

    kernel: Any
    ranks: int
    threads: int
    smem: int
    max_halves: int


def _compress_grid_x(bh: int, n_new: int, aux_parts: int, ranks: int) -> int:
    """append_compress's grid width: ``ranks`` CTAs for each of the bh * n_new record halves of a
    blockIdx.y, then bh * aux_parts aux CTAs, padded to whole clusters (compress.cu's layout)."""
    return bh * n_new * ranks + -(-bh * aux_parts // ranks) * ranks


class _Launch:
    """One kernel's prepared launch, shared by a cache's layers: ``kv`` and ``layer`` write the leading
    input arguments and the layer's buffers (``_KV_ARGS`` and ``_LAYER_ARGS`` of them) per call; ``fused``
    (append_compress only) its last ``_FUSED_ARGS``."""

    __slots__ = ("launch", "kv", "layer", "fused")

    def __init__(self, launch, compress: bool = False):
        self.launch = launch
        self.kv = launch.writer(0, _KV_ARGS)
        self.layer = launch.writer(_KV_ARGS, _LAYER_ARGS)
        self.fused = launch.writer(_A["sink_k"], _FUSED_ARGS) if compress else None


class _LayerBuffers:
    """A layer's fixed buffer addresses (its window, sink and lens never move, unlike the tile pool), read once:
    ``bounds``, their sorted [start, end) addresses flattened, so that an address lies inside one of the window and
    sink buffers iff ``bisect_right(bounds, p)`` is odd (separate allocations, hence disjoint); ``commit``,
    append_commit's layer arguments; ``window_k``, ``window_v`` and ``lens``, append_compress's."""

    __slots__ = ("bounds", "commit", "window_k", "window_v", "lens", "sink_k", "sink_v")

    def __init__(self, st):
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                       for t in (st.window_k, st.window_v, st.sink_k, st.sink_v) if t.numel())
        self.bounds = [p for span in spans for p in span]
        self.window_k, self.window_v, self.lens = st.window_k.data_ptr(), st.window_v.data_ptr(), st.lens.data_ptr()
        self.sink_k, self.sink_v = st.sink_k.data_ptr(), st.sink_v.data_ptr()
        self.commit = (self.window_k, self.window_v, self.sink_k, self.sink_v, self.lens)


_SETUPS: dict[tuple, tuple] = {}  # DeviceAppender's kernels and launch shapes, by what picks them


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
    and ``cluster`` the cluster form to launch with them (None: one CTA per record half only), for
    running the host side without a GPU (tests, ``tools/host_overhead.py``).

    ``programmatic``: whether :meth:`append` honours ``after_prefill`` (programmatic dependent launch of
    append_compress after the fused prefill kernel): where there are clusters (sm_90, the architectures with
    programmatic launches) unless ``$KVARN_APPEND_PDL`` is 0 (A/B runs). A plain attribute.

    ``cluster_tiles``: the most tiles per sequence and head an append compresses in the cluster form
    (``cluster.max_halves // (2 * batch * heads)``; 0 without clusters): an append completing more, or
    a step graph that can, takes the one-CTA form. A plain attribute: 0 forces the one-CTA form (eager
    appends from the next call on, step graphs prepared after it: the bench's step-graph comparison, the
    GPU tests, which also force clusters at any count: correct, only slower past one wave).
    """

    def __init__(self, cache, kernels=None, cluster: ClusterForm | None = None) -> None:
        spec: TileSpec = cache.spec
        if cache.dtype not in C.APPEND_DTYPES:
            raise TypeError(f"the device append needs a float16 or bfloat16 cache, got {cache.dtype}")
        self.cache = cache
        self.spec = spec
        self.device = cache.device
        # stand-in kernels have no module to report their shared memory and CTA size, and launch nothing
        self.smem = 0
        self.cta_threads = 32 * C.default_cta_warps(spec.tile_tokens, spec.head_dim)
        if kernels is None:
            cw, ow = C.cluster_warps(), C.cta_warps(spec.tile_tokens, spec.head_dim)
            key = (spec, cache.dtype, self.device.index, cw, ow, default_backend())
            setup = _SETUPS.get(key)
            if setup is None:
                setup = _SETUPS[key] = self._setup(spec, cache.dtype, self.device.index, cw, ow)
            kernels, self.smem, self.cta_threads, cluster = setup
        self._compress, self._commit, self._snapshot = kernels
        self._cluster = cluster
        self._bh = cache.batch_size * cache.num_kv_heads
        self.cluster_tiles = 0 if cluster is None else cluster.max_halves // (2 * self._bh)
        self._offsets = tuple(spec.offset(s) for s in _SECTIONS)
        self._inv_sqrt_d = C._inv_sqrt(spec.head_dim)
        self._inputs_ready = None  # the event an append on another stream waits for (made at the first)
        self._counter = cache._counter.data_ptr()
        self._groups = cache._groups.data_ptr()
        # the prepared launches, shared by the layers (made by prepare_launches, or at the first append that needs
        # one): append_commit's, and append_compress's by (cluster form, programmatic)
        self._commit_launch = None
        self._compress_forms: dict[tuple[bool, bool], _Launch] = {}
        self.programmatic = cluster is not None and os.environ.get(PDL_ENV, "1").strip() != "0"
        self._commit_n = 0  # the chunk length the commit launch holds

    @staticmethod
    def _setup(spec: TileSpec, dtype: torch.dtype, idx: int, cluster_warps: int, cta_warps: int):
        """(kernels, one-CTA shared memory, one-CTA threads, cluster form) of the compiled kernels."""
        kspec = C.compress_spec(spec.tile_tokens, spec.head_dim, dtype, spec.scale_dtype, spec.v_bits,
                                spec.quantizer, cluster_warps, cta_warps)
        name = lambda role: C.kernel_name(spec.tile_tokens, spec.head_dim, dtype,  # noqa: E731
                                          spec.scale_dtype, spec.v_bits, spec.quantizer, role)
        kernels = (get_kernel(kspec, name("append_compress"), APPEND_COMPRESS_SIGNATURE, idx),
                   get_kernel(kspec, name("append_commit"), APPEND_COMMIT_SIGNATURE, idx),
                   get_kernel(kspec, name("append_snapshot"), SNAPSHOT_SIGNATURE, idx))
        smem = C._module_smem_bytes(kspec, idx)
        cta_smem = smem["compress_cta"]  # append_compress is one-CTA compression
        cta_threads = C._layer_layout(kernels[0])[1]
        limit = C._smem_limit(idx)
        if cta_smem > limit:
            raise ValueError(f"compression of T={spec.tile_tokens}, D={spec.head_dim} needs {cta_smem} bytes "
                             f"of shared memory per block, cuda:{idx} has {limit}")
        form = get_kernel(kspec, name("append_compress_cluster"), APPEND_COMPRESS_SIGNATURE, idx)
        ranks, threads = C._layer_layout(form)
        # sm_90 (the kernel asks for a cluster); its CTAs' shared memory stays under 48 KB (tests/test_compress.py)
        cluster = None if ranks == 1 else ClusterForm(form, ranks, threads, smem["compress"],
                                                      C.cluster_halves(ranks, idx, threads))
        return kernels, cta_smem, cta_threads, cluster

    # --- launches ----------------------------------------------------------------------------------
    def _prepare_compress(self, form: ClusterForm | None, st, k: torch.Tensor, v: torch.Tensor, n: int,
                          max_new: int, backup: Backup | None, programmatic: bool = False):
        """append_compress in ``form`` (None: one CTA per record half) for up to ``max_new`` tiles per
        sequence and head; ``programmatic``: a programmatic dependent launch (see :meth:`append`)."""
        c = self.cache
        kernel, ranks, threads, smem = ((self._compress, 1, self.cta_threads, self.smem) if form is None
                                        else (form.kernel, form.ranks, form.threads, form.smem))
        aux_parts = -(-n // AUX_ROWS)
        return kernel.prepare(
            (_compress_grid_x(self._bh, max_new, aux_parts, ranks), 2), threads,
            (k, v, *k.stride()[:3], *v.stride()[:3], st.window_k, st.window_v, st.tiles, st.tile_table, st.lens,
             c._errors, None if backup is None else backup.window_k, None if backup is None else backup.window_v,
             c.batch_size, n, c.sink_tokens, c.window, c.num_kv_heads, st.tiles.shape[1], max_new, aux_parts,
             AUX_ROWS, self.spec.sinkhorn_iters, *self._offsets, self._inv_sqrt_d,
             st.sink_k, st.sink_v, c._counter, None),  # groups None: the two-launch form (a call may fuse)
            shared_mem=smem, programmatic=programmatic,
        )

    def _prepare_commit(self, st, k: torch.Tensor, v: torch.Tensor, n: int):
        c = self.cache
        return self._commit.prepare(
            (self._bh, 2, commit_parts(n, c.window, self._bh)), COMMIT_THREADS,
            (k, v, *k.stride()[:3], *v.stride()[:3], st.window_k, st.window_v, st.sink_k, st.sink_v, st.lens,
             c._errors, c._counter, c.batch_size, n, c.sink_tokens, c.window, c.num_kv_heads),
        )

    def prepare_launches(self, st) -> None:
        """Prepare append_commit and append_compress in each form now, from layer ``st`` (every argument a call
        changes is written by that call), so that no append pays for it."""
        k = st.window_k[:, :, :1]  # a stand-in of the inputs' layout: each call writes its own k, v
        self._launch_of(None, st, k, k, 1)
        for cluster in (False,) if self._cluster is None else (False, True):
            for programmatic in (False, True) if self.programmatic else (False,):
                self._launch_of((cluster, programmatic), st, k, k, 1)

    def _launch_of(self, form: tuple[bool, bool] | None, st, k, v, n: int) -> _Launch:
        """The cache's prepared launch of append_commit (``form`` None) or of append_compress in ``form``
        (cluster or one-CTA, programmatic or not), made now (a ``Kernel.prepare`` costs ~30-40 us of host time on
        the dev CPU): by :meth:`prepare_launches`, or at the first use of a launch it did not make."""
        if form is None:
            launch = self._commit_launch = _Launch(self._prepare_commit(st, k, v, n))
            self._commit_n = n
        else:
            cluster, programmatic = form
            launch = self._compress_forms[form] = _Launch(self._prepare_compress(
                self._cluster if cluster else None, st, k, v, n, 1, None, programmatic), True)
        return launch

    def append(self, st, k: torch.Tensor, v: torch.Tensor, n: int, n_new: int, backup: Backup | None,
               stream: torch.cuda.Stream | None = None, fuse: bool = False, after_prefill: bool = False) -> None:
        """Enqueue the append of k, v [batch, heads, n, head_dim] (cache dtype, on the device) to the layer
        ``st``, of which ``n_new`` tiles complete (``plan_append``; 0: one launch). ``backup``: buffers
        that append_compress fills with the window before the append, when a tile completes. ``stream``:
        launch there (after the work queued so far on the current stream, and with k, v kept alive for it)
        instead of on the current stream. ``fuse`` (with ``n_new``): append_compress writes the sink and window
        and commits the lengths itself, one launch instead of two; a failure may then leave windows rewritten,
        and ``backup`` (here, or the layer's earlier one in the same block) is what restores them, whatever the
        lengths say (the caller's to guarantee: ``KVarNCache`` fuses inside deferred blocks only).
        ``after_prefill`` (without ``stream``, where :attr:`programmatic`): the last kernel queued on the current
        stream is the fused prefill kernel, whose early trigger lets append_compress launch while that kernel's
        last CTAs run (append_compress reads nothing it writes, and waits for it before rewriting the window it
        reads); any other kernel queued after it makes the launch a plain one in effect."""
        lb = st.buffers
        if lb is None:
            lb = st.buffers = _LayerBuffers(st)
        bounds = lb.bounds
        # The layout the kernels read (16-byte aligned rows, contiguous channels), and not a view of the
        # cache's own buffers, which the kernels rewrite while reading the input; else a copy. One
        # condition for both tensors (this is the whole per-call cost of the checks).
        kp, vp = k.data_ptr(), v.data_ptr()
        k0, k1, k2, k3 = k.stride()
        v0, v1, v2, v3 = v.stride()
        if (k3 != 1 or v3 != 1 or (kp | vp) % 16 or (k0 | k1 | k2 | v0 | v1 | v2) % 8
                or (bisect_right(bounds, kp) | bisect_right(bounds, vp)) & 1):
            k, kp, (k0, k1, k2, _) = _kernel_ready(k, bounds)
            v, vp, (v0, v1, v2, _) = _kernel_ready(v, bounds)
        if stream is not None:
            # the current stream has queued what wrote k, v and what reads the window the append rewrites
            ready = self._inputs_ready = self._inputs_ready or torch.cuda.Event()
            ready.record()
            stream.wait_event(ready)
            k.record_stream(stream)  # freed on the current stream, reused only after the append has read them
            v.record_stream(stream)
        if n_new:
            cluster = n_new <= self.cluster_tiles
            form = (cluster, after_prefill and stream is None and self.programmatic)
            f = self._compress_forms.get(form)
            if f is None:
                f = self._launch_of(form, st, k, v, n)
            ranks = self._cluster.ranks if cluster else 1
            a = f.launch
            f.kv(kp, vp, k0, k1, k2, v0, v1, v2)
            f.layer(lb.window_k, lb.window_v, st.tiles.data_ptr(), st.tile_table.data_ptr(), lb.lens)
            aux_parts = -(-n // AUX_ROWS)
            a.set_arg(_A["cap"], st.tiles.shape[1])
            a.set_arg(_A["n"], n)
            a.set_arg(_A["max_new"], n_new)
            a.set_arg(_A["aux_parts"], aux_parts)
            a.set_arg(_A["backup_k"], 0 if backup is None else backup.window_k.data_ptr())
            a.set_arg(_A["backup_v"], 0 if backup is None else backup.window_v.data_ptr())
            a.set_grid(_compress_grid_x(self._bh, n_new, aux_parts, ranks), 2)
            f.fused(lb.sink_k, lb.sink_v, self._counter, self._groups if fuse else 0)
            a.launch(stream)
            if fuse:
                return
        b = self._commit_launch
        if b is None:
            b = self._launch_of(None, st, k, v, n)
        b.kv(kp, vp, k0, k1, k2, v0, v1, v2)
        b.layer(*lb.commit)
        if n != self._commit_n:  # decode appends one token per call: n rarely changes
            b.launch.set_arg(_B["n"], n)
            b.launch.set_grid(self._bh, 2, commit_parts(n, self.cache.window, self._bh))
            self._commit_n = n
        b.launch.launch(stream)

    def prepare_step(self, st, k: torch.Tensor, v: torch.Tensor, backup: Backup):
        """Launches for a step graph: append the static k, v [batch, heads, n, head_dim] with both kernels
        (append_compress sized for the most tiles n tokens can complete, its blocks predicated on the
        device lengths, in the form that tile count picks, as an eager append's) and the window backed
        up whenever a tile completes. Returns a callable that enqueues them (call it inside the capture)."""
        n = k.shape[2]
        max_new = -(-n // self.spec.tile_tokens)
        form = self._cluster if max_new <= self.cluster_tiles else None
        a = self._prepare_compress(form, st, k, v, n, max_new, backup)
        b = self._prepare_commit(st, k, v, n)

        def enqueue() -> None:
            a.launch()
            b.launch()

        return enqueue

    def prepare_snapshot(self, saved: torch.Tensor):
        """A launch copying the cache's lens [num_layers, 3, batch] into ``saved`` unless the error flag is
        set (a step graph's record of the lengths before its last clean step)."""
        c = self.cache
        return self._snapshot.prepare(1, 256, (c._lens, saved, c._errors, c._lens.numel()))

