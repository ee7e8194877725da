"""Load CUBINs through the driver API and launch their kernels on PyTorch's streams.

Modules are loaded into the primary context of a torch CUDA device, the context
PyTorch itself uses, so tensors' ``data_ptr()`` and ``torch.cuda`` streams are valid
in it. Kernels launch with ``cuLaunchKernelEx`` (needed for cluster dimensions on
sm_90) on ``torch.cuda.current_stream()`` unless a stream is given.

Arguments are packed from a declared signature, one entry per kernel parameter::

    "ptr"      device pointer: a CUDA torch.Tensor (its data_ptr()), an int address, or None (nullptr)
    "i32" "u32" "i64" "u64"   integers (range-checked)
    "f32" "f64"               Python/NumPy real numbers
    "bytes:N"  a by-value struct of N bytes (e.g. a CUTLASS Params struct): bytes of length N

An entry may carry a parameter name after a space (``"f32 alpha"``); errors then use it.

The launch path is CUDA-graph safe: it allocates no device memory, never synchronizes
and reads nothing back from the device. :meth:`Kernel.prepare` packs arguments and the
launch configuration once, so :meth:`PreparedLaunch.launch` only sets the stream, checks
the current context and calls ``cuLaunchKernelEx`` (driver entry points bound at prepare
time: no import, enum lookup or error-checking call on the success path). A prepared
launch keeps its arguments in one buffer, one 8-byte-aligned slot each, so the arguments
that change per call (an input's address and strides) are rewritten in place by one
``struct.pack_into`` (:meth:`PreparedLaunch.writer`).

Modules stay loaded for the life of the process: a captured CUDA graph may still refer
to their kernels, and :func:`spec.get_module` caches them, so unloading would buy nothing.
"""

from __future__ import annotations

import ctypes
import functools
import numbers
import re
import struct
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import check_driver

__all__ = ["Module", "Kernel", "PreparedLaunch", "load_module", "primary_context"]

# Launches with more dynamic shared memory than this need an explicit opt-in per function.
_DEFAULT_DYNAMIC_SMEM = 48 * 1024

_INT_RANGES = {
    "i32": (-(2**31), 2**31 - 1),
    "u32": (0, 2**32 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}
_FLOAT_KINDS = ("f32", "f64")
# struct codes of each kind, little-endian standard sizes (the argument buffer); "bytes" is "<size>s"
_STRUCT_CODES = {"ptr": "Q", "i32": "i", "u32": "I", "i64": "q", "u64": "Q", "f32": "f", "f64": "d"}
_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64,
           "u64": ctypes.c_uint64, "f32": ctypes.c_float, "f64": ctypes.c_double}
_SLOT_ALIGN = 8  # every argument starts at a multiple of 8 bytes in a prepared launch's buffer
_ENTRY = re.compile(r"^(ptr|i32|u32|i64|u64|f32|f64|bytes:(\d+))(?:\s+([A-Za-z_]\w*))?$")


@dataclass(frozen=True)
class _Param:
    """One parsed signature entry."""

    kind: str  # "ptr", "i32", ..., or "bytes"
    size: int  # bytes in the kernel's parameter space
    label: str  # for messages: "argument 2 (f32 alpha)"


def _parse_signature(kernel: str, signature: Sequence[str]) -> tuple[_Param, ...]:
    if isinstance(signature, str) or not isinstance(signature, (tuple, list)):
        raise TypeError(f"kernel {kernel!r}: signature must be a tuple of str like ('ptr', 'i32'), got {signature!r}")
    params = []
    for i, entry in enumerate(signature):
        m = _ENTRY.match(entry.strip()) if isinstance(entry, str) else None
        if m is None:
            raise ValueError(
                f"kernel {kernel!r}: signature entry {i} is {entry!r}; expected one of ptr, i32, u32, i64, u64, "
                f"f32, f64, bytes:N, optionally followed by a space and a parameter name"
            )
        kind, nbytes, pname = m.group(1), m.group(2), m.group(3)
        if nbytes is not None:
            if int(nbytes) <= 0:
                raise ValueError(f"kernel {kernel!r}: signature entry {i} {entry!r} must have N > 0")
            kind, size = "bytes", int(nbytes)
        else:
            size = 8 if kind in ("ptr", "i64", "u64", "f64") else 4
        label = f"argument {i} ({m.group(1)}{' ' + pname if pname else ''})"
        params.append(_Param(kind, size, label))
    return tuple(params)


def _value(p: _Param, value: Any, kernel: str, device_index: int) -> int | float | bytes:
    """One argument's value as ``struct`` packs it (int, float or bytes), after type and range checks."""
    kind = p.kind
    if kind == "ptr":
        if value is None:
            return 0
        if type(value) is int:
            if 0 <= value < 2**64:
                return value
        elif hasattr(value, "data_ptr") and hasattr(value, "device"):
            dev = value.device
            if dev.type != "cuda":
                raise ValueError(f"kernel {kernel!r} {p.label}: tensor is on {dev}, kernels need CUDA tensors")
            if dev.index != device_index:
                raise ValueError(f"kernel {kernel!r} {p.label}: tensor is on {dev}, the kernel's module is loaded "
                                 f"on cuda:{device_index}")
            return value.data_ptr()
        elif not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"kernel {kernel!r} {p.label}: expected a CUDA tensor, an int address or None, "
                            f"got {type(value).__name__}")
        if not 0 <= int(value) < 2**64:
            raise ValueError(f"kernel {kernel!r} {p.label}: address {int(value)} is out of range")
        return int(value)
    if kind in _INT_RANGES:
        lo, hi = _INT_RANGES[kind]
        if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"kernel {kernel!r} {p.label}: expected an int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"kernel {kernel!r} {p.label}: {int(value)} is out of range [{lo}, {hi}]")
        return int(value)
    if kind in _FLOAT_KINDS:
        if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            hint = " (pass a Python float; reading a tensor would synchronize)" if hasattr(value, "device") else ""
            raise TypeError(f"kernel {kernel!r} {p.label}: expected a real number, got {type(value).__name__}{hint}")
        return float(value)
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"kernel {kernel!r} {p.label}: expected bytes of length {p.size}, got {type(value).__name__}")
    raw = bytes(value)
    if len(raw) != p.size:
        raise ValueError(f"kernel {kernel!r} {p.label}: expected {p.size} bytes, got {len(raw)}")
    return raw


def _struct_code(p: _Param) -> str:
    """The ``struct`` code of one argument (little-endian standard sizes once behind a "<")."""
    return f"{p.size}s" if p.kind == "bytes" else _STRUCT_CODES[p.kind]


def _slot_format(params: tuple[_Param, ...], offsets: tuple[int, ...], nbytes: int, first: int, count: int) -> str:
    """``struct`` format (little-endian, standard sizes) of arguments ``first .. first + count - 1`` in their
    slots, each slot's padding as pad bytes (which packing writes as zeros)."""
    fmt = ["<"]
    for i in range(first, first + count):
        q = params[i]
        fmt.append(_struct_code(q))
        end = offsets[i + 1] if i + 1 < len(params) else nbytes
        fmt.append("x" * (end - offsets[i] - q.size))
    return "".join(fmt)


def _slot_offsets(params: tuple[_Param, ...]) -> tuple[tuple[int, ...], int]:
    """(offset of each argument, total bytes) in a launch's argument buffer: 8-byte-aligned slots."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.size // _SLOT_ALIGN) * _SLOT_ALIGN
    return tuple(offsets), total


def _dims(value: Any, argname: str) -> tuple[int, int, int]:
    """(x, y, z) from an int or a 1-3 tuple of positive ints."""
    dims = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3:
        raise TypeError(f"{argname} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 or d > 2**31 - 1:
            raise ValueError(f"{argname}={value!r}: every dimension must be an int in [1, 2**31 - 1]")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


# --- contexts and streams -------------------------------------------------------------------------

_ctx_lock = threading.Lock()
_primary_contexts: dict[int, Any] = {}


def _device_index(device: Any) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise TypeError(f"device must be an int, str or torch.device, got {device!r}")
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device={device!r} is not a CUDA device")
    return torch.cuda.current_device() if dev.index is None else dev.index


def primary_context(device: Any = None) -> tuple[int, Any]:
    """(device index, CUcontext) of the primary context of a torch CUDA device, made current on this thread.

    PyTorch's CUDA runtime uses the primary context, so modules loaded into it see the
    same memory and streams as torch. Initializes torch's CUDA state first.
    """
    import torch
    from cuda.bindings import driver

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available (torch.cuda.is_available() is False)")
    torch.cuda.init()
    index = _device_index(device)
    with _ctx_lock:
        ctx = _primary_contexts.get(index)
        if ctx is None:
            check_driver(driver.cuInit(0), "cuInit")
            dev = check_driver(driver.cuDeviceGet(index), "cuDeviceGet")
            # Retained once per device and never released: torch keeps it alive for the process anyway.
            ctx = check_driver(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _primary_contexts[index] = ctx
    _make_current(ctx, int(ctx))
    return index, ctx


def _make_current(ctx: Any, ctx_int: int, kernel: str | None = None) -> None:
    from cuda.bindings import driver

    # torch.cuda.set_device() on this thread may have switched the current context since the last launch.
    current = check_driver(driver.cuCtxGetCurrent(), "cuCtxGetCurrent", kernel)
    if int(current) != ctx_int:
        check_driver(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", kernel)


def _raw_stream_getter():
    import torch

    # torch._C._cuda_getCurrentRawStream is what Triton uses: an int without building a Stream object.
    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return fast
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def _stream_handle(stream: Any, device_index: int, current_stream) -> int:
    if stream is None:
        return current_stream(device_index)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream / ExternalStream
    if isinstance(handle, int):
        return handle
    try:
        from cuda.bindings import driver

        if isinstance(stream, driver.CUstream):
            return int(stream)
    except ImportError:
        pass
    raise TypeError(
        f"stream must be None, a torch.cuda.Stream, a CUstream or an int handle, got {type(stream).__name__}"
    )


# --- modules, kernels, launches -------------------------------------------------------------------


class Module:
    """A CUBIN loaded into the primary context of one device. Create with :func:`load_module`."""

    def __init__(self, handle: Any, device_index: int, ctx: Any):
        self._handle = handle
        self.device_index = device_index
        self._ctx = ctx
        self._kernels: dict[tuple[str, tuple[str, ...]], Kernel] = {}
        self._lock = threading.Lock()

    def kernel(self, name: str, signature: tuple[str, ...]) -> "Kernel":
        """The kernel ``name`` (an ``extern "C"`` symbol) with its argument signature.

        The signature is checked against the kernel's parameter count and sizes
        (``cuFuncGetParamInfo``), so a mismatch fails here instead of corrupting a launch.

        Raises:
            CudaError: the symbol is not in the module (``cuModuleGetFunction``).
            TypeError / ValueError: malformed signature, or one that disagrees with the kernel.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"kernel name must be a non-empty str, got {name!r}")
        params = _parse_signature(name, signature)
        key = (name, tuple(signature))
        with self._lock:
            k = self._kernels.get(key)
            if k is None:
                _make_current(self._ctx, int(self._ctx), name)
                from cuda.bindings import driver

                result = driver.cuModuleGetFunction(self._handle, name.encode())
                func = check_driver(result, "cuModuleGetFunction", name)
                _check_params(func, name, params)
                k = self._kernels[key] = Kernel(self, name, params, func)
            return k


def _check_params(func: Any, name: str, params: tuple[_Param, ...]) -> None:
    """Compare a signature with the kernel's parameter sizes from the driver."""
    from cuda.bindings import driver

    for i, p in enumerate(params):
        status, _, size = driver.cuFuncGetParamInfo(func, i)
        if status == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
            raise TypeError(f"kernel {name!r} takes {i} parameters, the signature declares {len(params)}")
        check_driver((status,), "cuFuncGetParamInfo", name)
        if size != p.size:
            raise ValueError(
                f"kernel {name!r} {p.label}: the kernel's parameter is {size} bytes, the signature says {p.size}"
            )
    status = driver.cuFuncGetParamInfo(func, len(params))[0]
    if status == driver.CUresult.CUDA_SUCCESS:
        raise TypeError(f"kernel {name!r} takes more than the {len(params)} parameters the signature declares")


class Kernel:
    """A kernel of a loaded :class:`Module` with a declared argument signature."""

    def __init__(self, module: Module, name: str, params: tuple[_Param, ...], func: Any):
        self.module = module
        self.name = name
        self._params = params
        self._offsets, self._nbytes = _slot_offsets(params)
        # every argument in its slot, packed by one call (Kernel.prepare's cost is mostly per-argument work)
        self._struct = struct.Struct(_slot_format(params, self._offsets, self._nbytes, 0, len(params)))
        self._arg_structs = tuple(struct.Struct("<" + _struct_code(p)) for p in params)
        self._writer_structs: dict[tuple[int, int], struct.Struct] = {}  # PreparedLaunch.writer's, by (first, count)
        self._func = func
        self._smem_opt_in = _DEFAULT_DYNAMIC_SMEM
        self._current_stream = _raw_stream_getter()

    @property
    def signature(self) -> tuple[str, ...]:
        """Parameter kinds, e.g. ``("ptr", "ptr", "f32", "i32")`` (``"bytes:N"`` for structs)."""
        return tuple(f"bytes:{p.size}" if p.kind == "bytes" else p.kind for p in self._params)

    def attribute(self, attr: str) -> int:
        """A ``CU_FUNC_ATTRIBUTE_*`` value, e.g. ``attribute("NUM_REGS")`` or ``attribute("MAX_THREADS_PER_BLOCK")``."""
        from cuda.bindings import driver

        enum = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr.upper()}", None)
        if enum is None:
            raise ValueError(f"attr={attr!r} is not a CU_FUNC_ATTRIBUTE_* name")
        return check_driver(driver.cuFuncGetAttribute(enum, self._func), "cuFuncGetAttribute", self.name)

    def pack(self, args: Sequence[Any]) -> tuple[list, ctypes.Array]:
        """(holders, void* array) for ``args``; the holders must outlive every launch using the array.

        The holders are ctypes views into one buffer (one 8-byte-aligned slot per argument), which
        they keep alive."""
        buf, array = self._pack(args)
        holders = [(ctypes.c_uint8 * p.size if p.kind == "bytes" else _CTYPES[p.kind]).from_buffer(buf, off)
                   for p, off in zip(self._params, self._offsets)]
        return holders, array

    def _pack(self, args: Sequence[Any]) -> tuple[ctypes.Array, ctypes.Array]:
        """(buffer holding every argument in its slot, void* array of the slots' addresses) for ``args``, checked."""
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"kernel {self.name!r}: args must be a tuple or list, got {type(args).__name__}")
        if len(args) != len(self._params):
            raise TypeError(
                f"kernel {self.name!r} takes {len(self._params)} arguments "
                f"({', '.join(self.signature)}), got {len(args)}"
            )
        name, dev = self.name, self.module.device_index
        buf = (ctypes.c_uint8 * max(self._nbytes, _SLOT_ALIGN))()
        values = [_value(p, a, name, dev) for p, a in zip(self._params, args)]
        try:
            self._struct.pack_into(buf, 0, *values)
        except (OverflowError, struct.error):  # a finite real beyond f32's range (the checks pass every other value)
            for p, packer, value in zip(self._params, self._arg_structs, values):
                try:
                    packer.pack(value)
                except (OverflowError, struct.error):
                    raise ValueError(f"kernel {name!r} {p.label}: {value!r} is out of range for {p.kind}") from None
            raise
        base = ctypes.addressof(buf)
        array = (ctypes.c_void_p * max(len(self._params), 1))(*[base + off for off in self._offsets])
        return buf, array

    def prepare(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        args: Sequence[Any],
        shared_mem: int = 0,
        cluster: int | tuple[int, ...] | None = None,
        programmatic: bool = False,
    ) -> "PreparedLaunch":
        """Pack arguments and launch configuration once, for repeated cheap launches.

        Args:
            grid: blocks per grid, int or (x[, y[, z]]); with ``cluster``, a multiple of it.
            block: threads per block, int or (x[, y[, z]]).
            args: one value per signature entry (tensors are read as ``data_ptr()`` now).
            shared_mem: dynamic shared memory per block in bytes; above 48 KiB the
                function's limit is raised (``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``).
            cluster: thread-block cluster dims (sm_90+), int or (x[, y[, z]]).
            programmatic: programmatic dependent launch (sm_90+,
                ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``): the kernel may start while the
                previous kernel in the stream finishes, so it must execute ``griddepcontrol.wait`` before it
                reads anything that kernel writes (a stream capture records the edge in the graph).
        """
        from cuda.bindings import driver

        gx, gy, gz = _dims(grid, "grid")
        bx, by, bz = _dims(block, "block")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, numbers.Integral) or shared_mem < 0:
            raise ValueError(f"shared_mem={shared_mem!r} must be an int >= 0 (bytes)")
        buf, array = self._pack(args)
        if shared_mem > self._smem_opt_in:
            _make_current(self.module._ctx, int(self.module._ctx), self.name)
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check_driver(driver.cuFuncSetAttribute(self._func, attr, int(shared_mem)), "cuFuncSetAttribute", self.name)
            self._smem_opt_in = int(shared_mem)
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
        config.sharedMemBytes = int(shared_mem)
        attrs = []
        if cluster is not None:
            cx, cy, cz = _dims(cluster, "cluster")
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cx, cy, cz
            attrs.append(attr)
        if not isinstance(programmatic, bool):
            raise TypeError(f"programmatic must be a bool, got {type(programmatic).__name__}")
        if programmatic:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        config.attrs = attrs
        config.numAttrs = len(attrs)
        return PreparedLaunch(self, config, buf, array)

    def launch(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        args: Sequence[Any],
        shared_mem: int = 0,
        stream: Any = None,
        cluster: int | tuple[int, ...] | None = None,
    ) -> None:
        """Launch once: :meth:`prepare` then :meth:`PreparedLaunch.launch` (same arguments as those)."""
        self.prepare(grid, block, args, shared_mem, cluster).launch(stream)


class PreparedLaunch:
    """A launch with packed arguments and configuration; :meth:`launch` is the hot path.

    Tensor arguments were captured as addresses at :meth:`Kernel.prepare` time: keep the
    tensors alive (and in place) while this object is used. Not thread-safe: launching
    sets the configuration's stream, so prepare one per thread.

    The driver copies the arguments when a launch is enqueued (or captured), so changing
    them afterwards affects only later launches.
    """

    __slots__ = (
        "kernel", "_config", "_buf", "_array", "_array_addr", "_func", "_ctx", "_ctx_int", "_device",
        "_stream_of", "_stream", "_get_context", "_launch_ex",
    )

    def __init__(self, kernel: Kernel, config: Any, buf: ctypes.Array, array: ctypes.Array):
        from cuda.bindings import driver

        self.kernel = kernel
        self._config = config
        self._buf = buf  # the argument slots, which the driver reads through _array
        self._array = array
        self._array_addr = ctypes.addressof(array)
        self._func = kernel._func
        self._ctx = kernel.module._ctx
        self._ctx_int = int(kernel.module._ctx)
        self._device = kernel.module.device_index
        self._stream_of = kernel._current_stream
        self._stream = None  # the handle last stored in the configuration (stored again only when it changes)
        # driver entry points bound once: the launch path makes no import or module lookup
        self._get_context = driver.cuCtxGetCurrent
        self._launch_ex = driver.cuLaunchKernelEx

    def set_arg(self, index: int, value: int | float) -> None:
        """Replace argument ``index`` for later launches: an int address or int for ``ptr``/integer
        entries, a float for ``f32``/``f64``. Unchecked (the hot path of a launch whose pointers or
        sizes change per call): the caller passes values of the declared kind and range (a value outside
        it raises ``struct.error``, or ``OverflowError`` for a finite real beyond f32's range)."""
        k = self.kernel
        k._arg_structs[index].pack_into(self._buf, k._offsets[index], value)

    def set_args(self, first: int, *values: int | float) -> None:
        """:meth:`set_arg` for arguments ``first``, ``first + 1``, ... (as unchecked)."""
        k, buf = self.kernel, self._buf
        for i, value in enumerate(values, first):
            k._arg_structs[i].pack_into(buf, k._offsets[i], value)

    def writer(self, first: int, count: int):
        """A function ``w(*values)`` that replaces arguments ``first .. first + count - 1`` for later launches
        in one ``struct.pack_into`` over their slots: the per-call update of a hot launch (an input's
        address and strides), a few times cheaper than :meth:`set_args`. Values as for :meth:`set_arg`
        (``bytes`` for ``bytes:N`` entries); a value outside its kind's range raises ``struct.error`` (or
        ``OverflowError``: a finite real beyond f32's range) and leaves the run's slots zeroed (write them again
        before the next launch)."""
        k = self.kernel
        packer = k._writer_structs.get((first, count))
        if packer is None:
            n = len(k._params)
            if type(first) is not int or type(count) is not int or first < 0 or count < 1 or first + count > n:
                raise ValueError(f"kernel {k.name!r}: arguments {first!r}..+{count!r} are not within its {n} arguments")
            packer = k._writer_structs[(first, count)] = struct.Struct(
                _slot_format(k._params, k._offsets, k._nbytes, first, count))
        return functools.partial(packer.pack_into, self._buf, k._offsets[first])

    def set_grid(self, x: int, y: int = 1, z: int = 1) -> None:
        """Replace the grid dimensions for later launches (unchecked: positive ints)."""
        cfg = self._config
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = x, y, z

    def launch(self, stream: Any = None) -> None:
        """Enqueue the kernel on ``stream`` (default: torch's current stream of the module's device).

        No allocation, synchronization or device read-back: safe inside CUDA graph capture.

        Raises:
            CudaError: ``cuLaunchKernelEx`` failed (bad configuration, too many resources, ...).
        """
        if stream is None:
            handle = self._stream_of(self._device)
        else:
            handle = _stream_handle(stream, self._device, self._stream_of)
        if handle != self._stream:
            self._config.hStream = handle
            self._stream = handle
        # torch.cuda.set_device() on this thread may have switched the current context since the last launch
        status, current = self._get_context()
        if status or current != self._ctx:  # (CUcontext equality compares the handles)
            _make_current(self._ctx, self._ctx_int, self.kernel.name)
        result = self._launch_ex(self._config, self._func, self._array_addr, 0)
        if result[0]:  # CUresult is an int enum: CUDA_SUCCESS is 0
            check_driver(result, "cuLaunchKernelEx", self.kernel.name)


def load_module(cubin: bytes, device: Any = None) -> Module:
    """Load a CUBIN into the primary context of ``device`` (torch's current device when ``None``).

    Raises:
        TypeError: ``cubin`` is not bytes.
        CudaError: the driver rejected the image (e.g. built for another architecture).
    """
    from cuda.bindings import driver

    if not isinstance(cubin, (bytes, bytearray)):
        raise TypeError(f"cubin must be bytes, got {type(cubin).__name__}")
    index, ctx = primary_context(device)
    handle = check_driver(driver.cuModuleLoadData(bytes(cubin)), "cuModuleLoadData")
    return Module(handle, index, ctx)
