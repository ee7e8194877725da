"""The host side of the append hot path, on the CPU: what the driver receives from a prepared launch,
what ``DeviceAppender`` passes to its kernels, and the cache's argument checks on their fast path.

The launch path runs for real (``runtime.module.PreparedLaunch``) against a recording stand-in for
the driver: ``cuda.bindings.driver.cuCtxGetCurrent`` / ``cuCtxSetCurrent`` / ``cuLaunchKernelEx``
replaced by Python functions that keep the current context and decode every launch's arguments from
its ``kernelParams`` array (what the real driver would copy). The cache's device path runs on
``DeviceAppender`` with kernels of a fake module (tensors passed as their addresses).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda.bindings import driver

import kvarn_cutlass as kc
from kvarn_cutlass.ops import append as A
from kvarn_cutlass.runtime import CudaError
from kvarn_cutlass.runtime.module import Kernel, _parse_signature

from _helpers import assert_same_snapshot, realistic_kv, snapshot

MODULE_CTX = driver.CUcontext(0x1000)
_READ = {"ptr": ctypes.c_uint64, "u64": ctypes.c_uint64, "i64": ctypes.c_int64, "i32": ctypes.c_int32,
         "u32": ctypes.c_uint32, "f32": ctypes.c_float, "f64": ctypes.c_double}


class _Module:
    device_index = 0
    _ctx = MODULE_CTX


class HostKernel(Kernel):
    """A kernel of a fake module: prepare() takes tensors as their addresses (no shared-memory opt-in)."""

    def __init__(self, name, signature, handle):
        super().__init__(_Module(), name, _parse_signature(name, signature), driver.CUfunction(handle))
        self.names = [e.split()[1] for e in signature]
        self._current_stream = lambda index: 0x50  # the CPU torch has no CUDA stream to ask for

    def prepare(self, grid, block, args, shared_mem=0, cluster=None, programmatic=False):
        args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        return super().prepare(grid, block, args, 0, cluster, programmatic)


class Driver:
    """The driver entry points of the launch path, recording: ``launches`` holds (kernel name, grid,
    stream, {argument name: value}) per cuLaunchKernelEx, ``switches`` the contexts made current."""

    def __init__(self):
        self.current = MODULE_CTX
        self.kernels = {}  # CUfunction handle -> HostKernel
        self.launches, self.switches = [], []
        self.programmatic = []  # per launch: whether it asked for programmatic dependent launch
        self.fail_with = None

    def kernel(self, name, signature):
        k = HostKernel(name, signature, 0x10 + len(self.kernels))
        self.kernels[int(k._func)] = k
        return k

    def cuCtxGetCurrent(self):
        return driver.CUresult.CUDA_SUCCESS, self.current

    def cuCtxSetCurrent(self, ctx):
        self.current = ctx
        self.switches.append(int(ctx))
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, config, func, params, extra):
        if self.fail_with is not None:
            return (self.fail_with,)
        k = self.kernels[int(func)]
        args = {}
        for i, (p, name) in enumerate(zip(k._params, k.names)):
            addr = ctypes.c_void_p.from_address(params + 8 * i).value
            args[name] = ctypes.string_at(addr, p.size) if p.kind == "bytes" else _READ[p.kind].from_address(addr).value
        grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
        self.launches.append((k.name, grid, int(config.hStream), args))
        pdl = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.programmatic.append(any(a.id == pdl and a.value.programmaticStreamSerializationAllowed
                                     for a in config.attrs[:config.numAttrs]))
        return (driver.CUresult.CUDA_SUCCESS,)


@pytest.fixture
def drv(monkeypatch):
    d = Driver()
    for name in ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernelEx"):
        monkeypatch.setattr(driver, name, getattr(d, name))
    return d


# ---- PreparedLaunch ---------------------------------------------------------------------------------
SIG = ("ptr x", "i32 n", "bytes:12 params", "f32 alpha", "i64 stride", "u64 mask", "ptr y")


def test_prepared_launch_passes_what_was_packed_and_rewritten(drv):
    k = drv.kernel("k", SIG)
    p = k.prepare((3, 2), 64, (0x7F00_0000_0010, -5, b"abcdefghijkl", 0.5, -(2**40), 2**64 - 1, None))
    p.launch()
    want = {"x": 0x7F00_0000_0010, "n": -5, "params": b"abcdefghijkl", "alpha": 0.5, "stride": -(2**40),
            "mask": 2**64 - 1, "y": 0}
    assert drv.launches[-1] == ("k", (3, 2, 1), 0x50, want)
    # one writer over a run of slots of mixed sizes, then set_arg and set_grid: all seen by the next launch
    w = p.writer(1, 4)
    w(2**31 - 1, b"ABCDEFGHIJKL", -1.25, 7)
    p.set_arg(6, 0x1230)
    p.set_grid(9)
    p.launch(stream=0x60)
    want.update(n=2**31 - 1, params=b"ABCDEFGHIJKL", alpha=-1.25, stride=7, y=0x1230)
    assert drv.launches[-1] == ("k", (9, 1, 1), 0x60, want)
    p.launch()  # back on the current stream: the stored handle changes back
    assert drv.launches[-1][2] == 0x50
    with pytest.raises(struct.error):
        w(2**31, b"ABCDEFGHIJKL", 0.0, 0)  # i32 out of range
    for first, count in ((-1, 1), (0, 0), (6, 2), (True, 1)):
        with pytest.raises(ValueError, match="not within its 7 arguments"):
            p.writer(first, count)


def test_launch_makes_the_module_context_current_only_when_another_is(drv):
    p = drv.kernel("k", ("ptr x",)).prepare(1, 32, (None,))
    p.launch()
    assert drv.switches == []
    drv.current = driver.CUcontext(0x2000)  # e.g. torch.cuda.set_device(1) on this thread
    p.launch()
    p.launch()
    assert drv.switches == [0x1000] and len(drv.launches) == 3


def test_failed_launch_raises_naming_the_kernel(drv):
    p = drv.kernel("kvarn_x", ("ptr x",)).prepare(1, 32, (None,))
    drv.fail_with = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match="cuLaunchKernelEx.*kvarn_x|kvarn_x.*cuLaunchKernelEx"):
        p.launch()


# ---- DeviceAppender ---------------------------------------------------------------------------------
# an H200's cluster form at T=128: 8 CTAs of 128 threads a record half, 4 cluster CTAs on each of 132 SMs
RANKS, MAX_HALVES = 8, 4 * 132 // 8


def _device_cache(drv, cluster=False, **kw):
    """A CPU cache whose device path runs DeviceAppender on kernels of the recording driver (with
    ``cluster``, also a cluster form of append_compress, ``append_compress_cluster``)."""
    c = kc.KVarNCache(**kw)
    kernels = tuple(drv.kernel(name, sig) for name, sig in (
        ("append_compress", A.APPEND_COMPRESS_SIGNATURE), ("append_commit", A.APPEND_COMMIT_SIGNATURE),
        ("append_snapshot", A.SNAPSHOT_SIGNATURE)))
    form = None
    if cluster:
        form = A.ClusterForm(drv.kernel("append_compress_cluster", A.APPEND_COMPRESS_SIGNATURE), RANKS, 128, 0,
                             MAX_HALVES)
    c._writer = A.DeviceAppender(c, kernels=kernels, cluster=form)
    return c


def _kernel_units(grid_x: int, bh: int, max_new: int, aux_parts: int, ranks: int) -> list:
    """What each CTA of append_compress's blockIdx.x does, decoded as compress.cu does it: ("compress", half,
    rank), ("aux", unit) or ("pad",)."""
    n_compress = bh * max_new
    out = []
    for x in range(grid_x):
        if x < n_compress * ranks:
            out.append(("compress", x // ranks, x % ranks))
        elif x - n_compress * ranks < bh * aux_parts:
            out.append(("aux", x - n_compress * ranks))
        else:
            out.append(("pad",))
    return out


def test_compress_grid_covers_every_half_and_aux_part_once_in_whole_clusters():
    for ranks in (1, 4, 8):
        for bh in (1, 3, 8, 24):
            for max_new in (1, 2, 5):
                for aux_parts in (1, 2, 3):
                    x = A._compress_grid_x(bh, max_new, aux_parts, ranks)
                    assert x % ranks == 0, (ranks, bh, max_new, aux_parts)
                    units = _kernel_units(x, bh, max_new, aux_parts, ranks)
                    halves = [u for u in units if u[0] == "compress"]
                    assert sorted(halves) == [("compress", h, r) for h in range(bh * max_new) for r in range(ranks)]
                    # a cluster's CTAs x // ranks are one record half's ranks (the cluster spans x), or no half's
                    for c in range(x // ranks):
                        kinds = {units[c * ranks + r][0] for r in range(ranks)}
                        assert kinds == {"compress"} and len({units[c * ranks + r][1] for r in range(ranks)}) == 1 \
                            or "compress" not in kinds
                    assert [u[1] for u in units if u[0] == "aux"] == list(range(bh * aux_parts))
                    assert len([u for u in units if u[0] == "pad"]) < ranks


@pytest.mark.parametrize("fused", [True, False])
def test_device_append_launches_clusters_while_the_tiles_fit(drv, monkeypatch, fused):
    """In a deferred block a tile-completing append is append_compress alone in its fused form (the sink, the
    counter and the group counts passed), or with KVARN_FUSED_APPEND=0 append_compress (groups 0) then
    append_commit; the compression's form by the tile count either way."""
    monkeypatch.setenv("KVARN_FUSED_APPEND", "1" if fused else "0")
    B, H, D, T = 2, 4, 128, 128  # 8 (b, head) pairs: 16 record halves a tile, clusters for up to 4 tiles
    c = _device_cache(drv, cluster=True, num_layers=1, batch_size=B, num_kv_heads=H, head_dim=D, window=256,
                      dtype=torch.float16)
    assert c._writer.cluster_tiles == MAX_HALVES // (2 * B * H) == 4
    g = torch.Generator().manual_seed(13)
    c.append(0, *[realistic_kv(B, H, 256, D, generator=g) for _ in range(2)])  # fills the window: no tile
    st = c._layers[0]
    for n, n_new, form in ((1, 1, "cluster"), (4 * T, 4, "cluster"), (5 * T, 5, "cta"), (300, 2, "cluster")):
        assert A.plan_append(st.sink_len, st.window_len, n, c.sink_tokens, c.window, T)[1] == n_new
        chunk = torch.zeros(B, H, n + 9, D, dtype=torch.float16)[:, :, 9:]  # a strided view
        del drv.launches[:]
        with c.deferred_checks():
            c.append(0, chunk, chunk)
        (a_name, a_grid, _, a), *rest = drv.launches
        assert len(rest) == (0 if fused else 1), n
        assert (a["sink_k"], a["sink_v"], a["counter"]) == (st.sink_k.data_ptr(), st.sink_v.data_ptr(),
                                                            c._counter.data_ptr())
        assert a["groups"] == (c._groups.data_ptr() if fused else 0), n
        aux_parts = -(-n // A.AUX_ROWS)
        ranks = RANKS if form == "cluster" else 1
        assert a_name == ("append_compress_cluster" if form == "cluster" else "append_compress"), n
        assert a_grid == (A._compress_grid_x(B * H, n_new, aux_parts, ranks), 2, 1), n
        assert (a["max_new"], a["n"], a["aux_parts"], a["aux_rows"]) == (n_new, n, aux_parts, A.AUX_ROWS), n
        assert (a["k"], a["v"], a["k_sb"], a["k_sh"], a["k_st"]) == (
            chunk.data_ptr(), chunk.data_ptr(), (n + 9) * D * H, (n + 9) * D, D), n
        assert (a["pool"], a["table"], a["cap"]) == (st.tiles.data_ptr(), st.tile_table.data_ptr(), st.tiles.shape[1])
        assert a["backup_k"] == c._backups[0].window_k.data_ptr() and a["backup_v"] == c._backups[0].window_v.data_ptr()
        if not fused:  # the commit's rows in blocks of 64 (the 256-row window a rewrite keeps, or the one token's row)
            [(b_name, b_grid, _, b)] = rest
            parts = {1: 1, 4 * T: 4, 5 * T: 4, 300: 4}[n]
            assert (b_name, b_grid, b["n"], b["k"]) == ("append_commit", (B * H, 2, parts), n, chunk.data_ptr())
    # the pool grew along the way (no max_seq_len), and each launch above read the pool it had then
    assert st.tiles.shape[1] > 8


@pytest.mark.parametrize("pdl_env", [None, "0"])
@pytest.mark.parametrize("cluster", [True, False])
def test_only_a_compression_after_the_prefill_kernel_is_a_programmatic_launch(drv, monkeypatch, cluster, pdl_env):
    """An append after the fused prefill kernel (``_append(..., True)``, what prefill_attention does) launches
    append_compress with programmatic dependent launch, in either compression form and either block kind, where
    there are clusters (sm_90) and $KVARN_APPEND_PDL is not 0; its commit, a no-tile append, every public
    ``append`` and the step graphs' launches stay plain (an overlapped block's, on another stream, too: append.py)."""
    if pdl_env is None:
        monkeypatch.delenv(A.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(A.PDL_ENV, pdl_env)
    monkeypatch.setenv("KVARN_FUSED_APPEND", "0")  # both kernels of a tile-completing append launch
    B, H, D, T = 1, 4, 128, 128
    c = _device_cache(drv, cluster=cluster, num_layers=1, batch_size=B, num_kv_heads=H, head_dim=D, window=256,
                      dtype=torch.float16, max_seq_len=1 << 16)
    on = cluster and pdl_env is None
    assert c._writer.programmatic is on
    g = torch.Generator().manual_seed(31)
    kv = lambda n: [realistic_kv(B, H, n, D, generator=g) for _ in range(2)]  # noqa: E731
    c._append(0, *kv(200), True)  # no tile: the commit alone, plain
    assert [x[0] for x in drv.launches] == ["append_commit"] and drv.programmatic == [False]
    for after_prefill in (True, False, True):
        for n in (2 * T, 9 * T):  # clusters (2 tiles), then the one-CTA form (9 > cluster_tiles)
            del drv.launches[:], drv.programmatic[:]
            c._append(0, *kv(n), after_prefill)
            names = [x[0] for x in drv.launches]
            assert names[1:] == ["append_commit"] and names[0].startswith("append_compress"), names
            assert drv.programmatic == [after_prefill and on, False], (after_prefill, n)
    del drv.launches[:], drv.programmatic[:]
    c.append(0, *kv(2 * T))
    with c.deferred_checks():
        c._append(0, *kv(2 * T), True)
    assert drv.programmatic == [False, False, on, False]
    enqueue = c._writer.prepare_step(c._layers[0], *kv(1), c._backup(0))
    del drv.programmatic[:]
    enqueue()
    assert drv.programmatic == [False, False]


@pytest.mark.parametrize("planned", [False, True])
def test_one_prepared_launch_per_kernel_serves_every_layer(drv, planned):
    """The cache prepares each kernel's launch once and writes the layer's buffers into it per call: appends
    alternating between layers, in both compression forms, each launch with its own layer's pointers. With
    ``planned`` (what the constructor of a CUDA cache does) every launch is prepared before the first append,
    from layer 0 and a stand-in of the inputs, and no append prepares one."""
    B, H, D, T = 1, 4, 128, 128
    c = _device_cache(drv, cluster=True, num_layers=3, batch_size=B, num_kv_heads=H, head_dim=D, window=256,
                      dtype=torch.float16, max_seq_len=8192)
    g = torch.Generator().manual_seed(21)
    prepared = []
    real_prepare = type(c._writer._commit).prepare
    if planned:
        c._writer.prepare_launches(c._layers[0])
        type(c._writer._commit).prepare = lambda *a, **kw: pytest.fail("an append prepared a launch")

    def counting_prepare(kernel, *a, **kw):
        prepared.append(kernel.name)
        return real_prepare(kernel, *a, **kw)

    for layer in (2, 0, 1):
        c.append(layer, *[realistic_kv(B, H, 256, D, generator=g) for _ in range(2)])  # full windows, no tile
    type(c._writer._commit).prepare = counting_prepare
    try:
        for step, (layer, n) in enumerate(((1, 2 * T), (0, 300), (2, 1), (1, 40 * T), (0, 4 * T), (2, 40 * T))):
            st = c._layers[layer]
            n_new = A.plan_append(st.sink_len, st.window_len, n, c.sink_tokens, c.window, T)[1]
            kv = [realistic_kv(B, H, n, D, generator=g) for _ in range(2)]
            del drv.launches[:]
            with c.deferred_checks():
                c.append(layer, *kv)
            launches = drv.launches  # (a tile-completing append in a block: the fused form, one launch)
            assert [x[0] for x in launches] == (["append_compress_cluster" if n_new <= c._writer.cluster_tiles
                                                 else "append_compress"] if n_new else ["append_commit"])
            for name, _, _, a in launches:
                assert (a["k"], a["v"], a["win_k"], a["win_v"], a["lens"]) == (
                    kv[0].data_ptr(), kv[1].data_ptr(), st.window_k.data_ptr(), st.window_v.data_ptr(),
                    st.lens.data_ptr()), (step, name)
                if name == "append_commit":
                    assert (a["n"], a["sink_k"], a["sink_v"]) == (n, st.sink_k.data_ptr(), st.sink_v.data_ptr())
                else:
                    assert (a["pool"], a["table"], a["cap"], a["n"], a["max_new"]) == (
                        st.tiles.data_ptr(), st.tile_table.data_ptr(), st.tiles.shape[1], n, n_new), step
                    assert (a["sink_k"], a["sink_v"], a["groups"]) == (
                        st.sink_k.data_ptr(), st.sink_v.data_ptr(), c._groups.data_ptr()), step
    finally:
        type(c._writer._commit).prepare = real_prepare
    # the commit launch was prepared by the first appends; each compression form once, at its first use
    assert sorted(prepared) == ([] if planned else ["append_compress", "append_compress_cluster"])


@pytest.mark.parametrize("batch,form", [(1, "cluster"), (4, "cluster"), (5, "cta")])
def test_step_launch_takes_the_form_its_most_tiles_pick(drv, batch, form):
    """prepare_step sizes append_compress for ceil(n / T) tiles (here one: a decode step) and picks the form
    for that count, as an eager append does: clusters up to MAX_HALVES record halves (batch 4 x 8 heads)."""
    H, D = 8, 128
    c = _device_cache(drv, cluster=True, num_layers=1, batch_size=batch, num_kv_heads=H, head_dim=D, window=256,
                      dtype=torch.float16, max_seq_len=1024)
    k = torch.zeros(batch, H, 1, D, dtype=torch.float16)
    enqueue = c._writer.prepare_step(c._layers[0], k, k.clone(), c._backup(0))
    del drv.launches[:]
    enqueue()
    (a_name, a_grid, _, a), (b_name, _, _, _) = drv.launches
    ranks = RANKS if form == "cluster" else 1
    assert a_name == ("append_compress_cluster" if form == "cluster" else "append_compress") and b_name == "append_commit"
    assert a_grid == (A._compress_grid_x(batch * H, 1, 1, ranks), 2, 1) and a["max_new"] == 1
    assert a["backup_k"] == c._backups[0].window_k.data_ptr()


def test_device_append_host_side_issues_no_torch_op_and_sets_the_launch(drv):
    from torch.profiler import ProfilerActivity, profile

    B, H, D, T = 2, 4, 128, 128
    c = _device_cache(drv, num_layers=1, batch_size=B, num_kv_heads=H, head_dim=D, window=256, dtype=torch.float16,
                      max_seq_len=4096)
    g = torch.Generator().manual_seed(12)
    one = [realistic_kv(B, H, 1, D, generator=g) for _ in range(2)]
    c.append(0, *one)  # prepares the launches
    st = c._layers[0]
    with c.deferred_checks():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                c.append(0, *one)
        ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
        assert ops == [], ops
        chunk = torch.zeros(B, H, 2 * T + 300, D, dtype=torch.float16)[:, :, 7 : 7 + 300]  # a strided view
        del drv.launches[:]
        c.append(0, chunk, chunk)  # 21 + 300 tokens: 65 over the window, one tile completes
    [(a_name, a_grid, _, a)] = drv.launches  # in a block: the fused form, one launch
    assert a_name == "append_compress"
    assert c.num_tiles(0) == 1 and c.seq_len(0) == 321  # (the recorded kernels committed nothing on the device)
    assert a["max_new"] == 1 and a["n"] == 300 and a["aux_parts"] == 2
    assert a_grid == (B * H * (1 + 2), 2, 1)
    assert (a["k"], a["v"]) == (chunk.data_ptr(),) * 2
    assert (a["k_sb"], a["k_sh"], a["k_st"]) == ((2 * T + 300) * D * H, (2 * T + 300) * D, D)
    assert (a["win_k"], a["lens"], a["err"]) == (st.window_k.data_ptr(), st.lens.data_ptr(), c._errors.data_ptr())
    assert a["backup_k"] == c._backups[0].window_k.data_ptr()  # the block's first tile: window backed up
    assert (a["sink_k"], a["counter"], a["groups"]) == (st.sink_k.data_ptr(), c._counter.data_ptr(),
                                                        c._groups.data_ptr())
    # outside a block the same append is two launches: the compression (groups 0), then the commit
    del drv.launches[:]
    c.append(0, chunk[:, :, :200], chunk[:, :, :200])  # 65 + 200: one tile completes
    (a_name, _, _, a), (b_name, b_grid, _, b) = drv.launches
    assert (a_name, b_name, a["groups"]) == ("append_compress", "append_commit", 0)
    assert b_grid == (B * H, 2, 4) and b["n"] == 200  # the commit: the kept rows in 4 blocks
    assert b["sink_k"] == st.sink_k.data_ptr() and b["counter"] == c._counter.data_ptr()
    # eager: the one torch op is the read of the error flag; n went back to 1 in the commit launch
    del drv.launches[:]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        c.append(0, *one)
    ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert ops <= {"aten::item", "aten::_local_scalar_dense"} and ops, ops
    [(name, _, _, b)] = drv.launches
    assert name == "append_commit" and b["n"] == 1 and b["k"] == one[0].data_ptr() and b["v"] == one[1].data_ptr()
    assert (b["k_sb"], b["k_sh"], b["k_st"]) == (H * D, D, D)


def test_inputs_the_kernels_cannot_read_as_they_are_are_copied(drv):
    B, H, D = 1, 2, 64
    c = _device_cache(drv, num_layers=1, batch_size=B, num_kv_heads=H, head_dim=D, preset="k4v2_g64", window=128,
                      sink_tokens=64, dtype=torch.float16, max_seq_len=4096)
    g = torch.Generator().manual_seed(3)
    c.append(0, realistic_kv(B, H, 70, D, generator=g), realistic_kv(B, H, 70, D, generator=g))
    st = c._layers[0]
    good = realistic_kv(B, H, 1, D, generator=g)
    flat = torch.randn(B * H * D + 1, generator=g).half()
    misaligned = flat[1:].view(B, H, 1, D)  # contiguous, 2 bytes past a 16-byte boundary
    channel_strided = realistic_kv(B, H, 1, 2 * D, generator=g)[..., ::2]
    for name, x in (("misaligned", misaligned), ("channel-strided", channel_strided),
                    ("window view", st.window_k[:, :, 3:4]), ("sink view", st.sink_v[:, :, 5:6])):
        del drv.launches[:]
        c.append(0, good, x)
        [(_, _, _, args)] = drv.launches
        assert args["k"] == good.data_ptr(), name  # an input the kernels can read goes as it is
        assert args["v"] != x.data_ptr() and args["v"] % 16 == 0, name
        assert (args["v_sb"], args["v_sh"], args["v_st"]) == (H * D, D, D), name
        c.truncate(0, c.seq_len(0) - 1)


def test_the_no_tile_shortcut_is_plan_appends_answer():
    """cache.append and StepAppends.advance skip plan_append when the sink is full and the window does not
    overflow, taking (0, 0, window_len + n): what plan_append (and kva_plan) says there."""
    import random

    rng = random.Random(16)
    for _ in range(5000):
        T = rng.choice([64, 128])
        window, sink = T * rng.randint(1, 8), T * rng.randint(0, 2)
        wl = rng.randint(0, window)
        n = rng.randint(1, window - wl) if wl < window else 0
        if n:
            assert A.plan_append(sink, wl, n, sink, window, T) == (0, 0, wl + n)


# ---- argument checks on the fast path ---------------------------------------------------------------
def _bad_cases(B, H, D):
    good = torch.randn(B, H, 1, D)
    return [
        ((True, good, good), ValueError, "layer must be an int"),
        ((-1, good, good), ValueError, "layer must be an int"),
        ((1, good, good), ValueError, "layer must be an int"),
        ((0, good.numpy(), good), TypeError, "k must be a torch.Tensor"),
        ((0, good, None), TypeError, "v must be a torch.Tensor"),
        ((0, good.double(), good), TypeError, "k has dtype torch.float64"),
        ((0, good, good.to(torch.int32)), TypeError, "v has dtype torch.int32"),
        ((0, good.to("meta"), good), ValueError, "k is on meta"),
        ((0, good, good.to("meta")), ValueError, "v is on meta"),
        ((0, good, torch.randn(B, H, 2, D)), ValueError, "same shape"),
        ((0, torch.randn(B, H + 1, 1, D), torch.randn(B, H + 1, 1, D)), ValueError, f"num_kv_heads={H}"),
        ((0, good[:, :, :0], good[:, :, :0]), ValueError, "n_new>=1"),
    ]


@pytest.mark.parametrize("path", ["device", "host"])
@pytest.mark.parametrize("case", range(len(_bad_cases(1, 2, 64))))
def test_bad_append_after_good_ones_raises_and_changes_nothing(drv, path, case):
    """The checks' fast path (the last accepted shape and dtype) is primed by good appends first; a bad call
    of the same shape still raises the full checks' error, and neither the cache nor the device sees it."""
    B, H, D = 1, 2, 64
    kw = dict(num_layers=1, batch_size=B, num_kv_heads=H, head_dim=D, preset="k4v2_g64", window=64, dtype=torch.float16)
    c = _device_cache(drv, **kw) if path == "device" else kc.KVarNCache(**kw)
    g = torch.Generator().manual_seed(case)
    for _ in range(3):
        c.append(0, torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))
    before, launches = snapshot(c), len(drv.launches)
    args, exc, match = _bad_cases(B, H, D)[case]
    with pytest.raises(exc, match=match):
        c.append(*args)
    assert_same_snapshot(before, snapshot(c))
    assert len(drv.launches) == launches
    c.append(0, torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))  # still appends
    assert c.seq_len(0) == 4


def test_fast_and_full_checks_agree_on_a_random_call_sequence(drv):
    """A seeded sequence of good and bad calls (dtypes, shapes, devices, subclasses, layers): append raises
    exactly when the full checks (check_kv on k and v, equal shapes, the layer) raise, with their message."""
    B, H, D, L = 2, 2, 64, 2
    c = _device_cache(drv, num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, preset="k4v2_g64", window=64,
                      dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2024)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32]

    def tensor():
        shape = [B, H, pick([1, 1, 1, 2, 0]), D]
        shape[pick([0, 1, 3, 2, 2, 2, 2, 2])] += pick([0, 0, 0, 0, 1])
        x = torch.randn(*shape, generator=g).to(pick(dtypes))
        return pick([x, x, x, x.to("meta"), torch.nn.Parameter(x, requires_grad=False) if x.is_floating_point() else x])

    def full_checks(layer, k, v):
        try:
            c._layer(layer)
            c.check_kv("k", k)
            c.check_kv("v", v)
            if k.shape != v.shape:
                raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        except (TypeError, ValueError) as e:
            return type(e), str(e)
        return None

    outcomes = set()
    for step in range(600):
        k = tensor()
        like_k = k.clone() if k.device.type != "meta" else k
        v = pick([like_k, like_k, tensor(), k.to("meta"), k.to(torch.int32), like_k[:, :, :1]])
        layer = pick([0, 1, 1, 0, 2, True])
        want = full_checks(layer, k, v)
        n = c.seq_len(layer) if want is None else None
        try:
            c.append(layer, k, v)
            got = None
        except (TypeError, ValueError) as e:
            got = type(e), str(e)
        assert got == want, (step, got, want)
        if got is None:
            assert c.seq_len(layer) == n + k.shape[2]
        outcomes.add(got is None)
    assert outcomes == {True, False}


# ---- tools/host_overhead.py ---------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("cc") is None, reason="the tool's CPU mode compiles a stub driver with cc")
def test_host_overhead_tool_runs_on_the_cpu():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "host_overhead.py"), "--device", "cpu", "--rounds", "2",
                          "--json"], capture_output=True, text=True, check=True, cwd=root).stdout
    res = json.loads(out)
    assert res["device"] == "cpu" and res["calls_per_round"] == 127
    assert {"append_us", "completing_us", "amortized_us", "appender_us", "launch_us", "checks_us"} <= res.keys()


@pytest.mark.skipif(shutil.which("cc") is None, reason="the tool's CPU mode compiles a stub driver with cc")
def test_host_overhead_tool_times_a_fresh_caches_prompt_appends():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "host_overhead.py"), "--device", "cpu", "--prompt",
                          "--rounds", "2", "--json"], capture_output=True, text=True, check=True, cwd=root).stdout
    res = json.loads(out)
    assert res["device"] == "cpu" and res["prompt_tokens"] == 16384 and res["chunk_tokens"] == 512
    assert 0 < res["prompt_rest_us"] and res["prompt_first_us"] + 31 * 0.5 * res["prompt_rest_us"] <= res["prompt_total_us"]
    parts = res["prompt_first_parts_us"]
    # the launches were prepared with the cache (as a CUDA cache's constructor does): the first append only
    # allocates the layer's backups and launches
    assert set(parts) == {"cache_append", "check_pair", "appender_init", "backup", "prepare_commit",
                          "prepare_compress", "pack", "launch", "device_append"}
    assert res["construct_us"] > 0
    assert parts["appender_init"] == parts["prepare_commit"] == parts["prepare_compress"] == parts["pack"] == 0
    assert min(parts["backup"], parts["launch"]) > 0
    assert parts["launch"] <= parts["device_append"]
    assert parts["device_append"] + parts["backup"] + parts["check_pair"] <= parts["cache_append"]
    # every later append completes a tile inside the tool's deferred block: one launch, the fused compression
    launches = res["prompt_rest_launch_us"]
    assert set(launches) == {"append_compress"} and min(launches.values()) > 0
    assert sum(launches.values()) <= res["prompt_rest_us"]


def test_step_appends_refuse_a_cpu_cache():
    from kvarn_cutlass.step_graph import StepAppends

    c = kc.KVarNCache(1, 1, 2, 64, preset="k4v2_g64", window=64, device="cpu", max_seq_len=256)
    k = torch.zeros(1, 1, 2, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="cache is on cpu"):
        StepAppends(c, k, k.clone())
    assert c._writer is None and not c._backups  # nothing was built for it


def test_commit_parts_split_rows_within_the_block_budget():
    # one token (a decode step): one block per (sequence, head, half), whatever the batch
    assert [A.commit_parts(1, 256, pairs) for pairs in (1, 8, 128)] == [1, 1, 1]
    # rows in shares of 64, bounded by the window (a rewrite keeps at most `window` rows)
    assert [A.commit_parts(n, 256, 8) for n in (64, 65, 128, 256, 512, 8192)] == [1, 2, 2, 4, 4, 4]
    assert A.commit_parts(2048, 1024, 8) == 8  # 16 rows-blocks, capped at 128 blocks / (2 * 8) pairs
    # a launch that already has a block per SM keeps one block per (sequence, head, half)
    assert A.commit_parts(512, 256, 128) == 1 and A.commit_parts(512, 256, 32) == 2
