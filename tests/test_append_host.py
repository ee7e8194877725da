"""The host side of the append hot path, on the CPU: what the driver receives from a prepared launch.

The launch path runs for real (``runtime.module.PreparedLaunch``) against a recording stand-in for
the driver: ``cuda.bindings.driver.cuCtxGetCurrent`` / ``cuCtxSetCurrent`` / ``cuLaunchKernelEx``
replaced by Python functions that keep the current context and decode every launch's arguments from
its ``kernelParams`` array (what the real driver would copy), on kernels of a fake module.
"""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch
from cuda.bindings import driver

from kvarn_cutlass.runtime import CudaError
from kvarn_cutlass.runtime.module import Kernel, _parse_signature

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

    def prepare(self, grid, block, args, shared_mem=0, cluster=None):
        args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        return super().prepare(grid, block, args, 0, cluster)


class Driver:
    """The driver entry points of the launch path, recording: ``launches`` holds (kernel name, grid,
    stream, {argument name: value}) per cuLaunchKernelEx, ``switches`` the contexts made current."""

    def __init__(self):
        self.current = MODULE_CTX
        self.kernels = {}  # CUfunction handle -> HostKernel
        self.launches, self.switches = [], []
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
