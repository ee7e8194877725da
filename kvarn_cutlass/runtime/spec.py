"""Kernel specs, builds and loaded modules: spec -> build() -> get_module().

A :class:`KernelSpec` names a source in ``kvarn_cutlass/csrc`` plus the compile-time
parameters (defines, options). :func:`build` compiles it for one architecture with no
GPU, through the disk cache; :func:`get_module` loads it for a device and keeps it for
the life of the process, keyed by (spec, target, device, backend).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .arch import arch_target, device_arch
from .compiler import KernelResources, compile_cubin, compiler_version, cubin_symbols, default_backend, full_options
from .diskcache import cached_artifact
from .errors import CompileError
from .module import Kernel, Module, _device_index, load_module

__all__ = ["CSRC_DIR", "KernelSpec", "CompiledModule", "build", "get_module", "get_kernel"]

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"

# Bump when the payload layout below or the meaning of a key field changes.
# 2: resources read from the CUBIN (version 1 took them from a log that can be empty).
_PAYLOAD_VERSION = 2
_IDENT = re.compile(r"^[A-Za-z_]\w*$")
_LEN = struct.Struct("<I")


def _normalize_defines(defines: Any) -> tuple[tuple[str, str], ...]:
    items = defines.items() if isinstance(defines, Mapping) else defines
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise TypeError(f"defines must be a dict or (name, value) pairs, got {defines!r}") from None
    out = []
    for name, value in pairs:
        if not isinstance(name, str) or not _IDENT.match(name):
            raise ValueError(f"defines: {name!r} is not a C identifier")
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (str, int, float)):
            raise TypeError(f"defines[{name!r}] must be str, int or float, got {type(value).__name__}")
        out.append((name, str(value)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class KernelSpec:
    """Everything that determines a compiled module, except the architecture.

    Attributes:
        source_file: file name under ``kvarn_cutlass/csrc`` (e.g. ``"selftest.cu"``) or an absolute path.
        kernel_names: the ``extern "C" __global__`` entry points the module must contain.
        defines: preprocessor macros, a dict or (name, value) pairs; stored sorted.
        options: extra compiler options (``-lineinfo``, ``--use_fast_math``, ``--maxrregcount=N``).
        arch_specific: compile for the ``a`` target (``sm_90a``) on sm_90+, for wgmma/setmaxnreg.
        include_dirs: absolute include directories beyond ``csrc`` (e.g. the CuTe headers of the
            nvidia-cutlass wheel), searched before the CUDA headers; part of the cache key.
        name: readable name for cache files and reports; defaults to the source's stem.
    """

    source_file: str
    kernel_names: tuple[str, ...]
    defines: tuple[tuple[str, str], ...] = ()
    options: tuple[str, ...] = ()
    arch_specific: bool = False
    include_dirs: tuple[str, ...] = ()
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.source_file, str) or not self.source_file:
            raise TypeError(f"source_file must be a non-empty str, got {self.source_file!r}")
        names = (self.kernel_names,) if isinstance(self.kernel_names, str) else tuple(self.kernel_names)
        if not names or not all(isinstance(n, str) and _IDENT.match(n) for n in names):
            raise ValueError(f"kernel_names must be C identifiers (extern \"C\" symbols), got {self.kernel_names!r}")
        if isinstance(self.options, str):
            raise TypeError("options must be a sequence of str, not a single str")
        object.__setattr__(self, "kernel_names", names)
        object.__setattr__(self, "defines", _normalize_defines(self.defines))
        object.__setattr__(self, "options", tuple(self.options))
        if isinstance(self.include_dirs, str) or not all(
                isinstance(d, str) and Path(d).is_absolute() for d in self.include_dirs):
            raise TypeError(f"include_dirs must be a sequence of absolute paths, got {self.include_dirs!r}")
        object.__setattr__(self, "include_dirs", tuple(self.include_dirs))
        object.__setattr__(self, "name", self.name or Path(self.source_file).stem)

    @property
    def source_path(self) -> Path:
        """Absolute path of the source file."""
        path = Path(self.source_file)
        return path if path.is_absolute() else CSRC_DIR / path

    def compile_options(self) -> tuple[str, ...]:
        """``-D`` options for the defines, then the spec's options."""
        return tuple(f"-D{k}={v}" for k, v in self.defines) + self.options


@dataclass(frozen=True)
class CompiledModule:
    """A spec compiled for one architecture.

    Attributes:
        spec: the spec that was built.
        target: compiler target, e.g. ``"sm_90"``.
        cubin: the ELF CUBIN.
        resources: kernel name -> registers, static shared memory, stack, spills (from ptxas).
        compile_seconds: wall time of the compilation that produced the CUBIN (also when
            this object was read from the disk cache).
        compiler: compiler version string.
        log: compiler log of that compilation.
        cached: True when read from the disk cache rather than compiled by this call.
    """

    spec: KernelSpec
    target: str
    cubin: bytes
    resources: Mapping[str, KernelResources]
    compile_seconds: float
    compiler: str
    log: str
    cached: bool


def _source_digest(path: Path) -> str:
    """sha256 of the source and of every header beside it, which ``#include "x.cuh"`` may pull in."""
    try:
        h = hashlib.sha256(path.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(f"kernel source {path} does not exist") from None
    for header in sorted(path.parent.glob("*.cuh")):
        h.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()


def _pack_payload(meta: dict, cubin: bytes) -> bytes:
    blob = json.dumps(meta, sort_keys=True).encode()
    return _LEN.pack(len(blob)) + blob + cubin


def _unpack_payload(payload: bytes) -> tuple[dict, bytes]:
    (n,) = _LEN.unpack_from(payload, 0)
    return json.loads(payload[_LEN.size : _LEN.size + n]), payload[_LEN.size + n :]


def build(spec: KernelSpec, arch: str | int, backend: str | None = None) -> CompiledModule:
    """Compile ``spec`` for ``arch`` (no GPU needed), through the on-disk cache.

    Args:
        spec: what to compile.
        arch: e.g. ``"sm90"``, ``"sm_90a"``, ``90``; ``spec.arch_specific`` adds the ``a``.
        backend: ``"nvrtc"`` (default) or ``"nvcc"``.

    Raises:
        CompileError: the source does not compile, or lacks one of ``spec.kernel_names``.
        FileNotFoundError: the source file is missing.
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a KernelSpec, got {type(spec).__name__}")
    backend = backend or default_backend()
    target = arch_target(arch, spec.arch_specific)
    path = spec.source_path
    include_dirs = (str(path.parent), *spec.include_dirs)
    key = {
        "arch": target,
        "source": spec.source_file,
        "source_sha256": _source_digest(path),
        "kernels": list(spec.kernel_names),
        "options": list(full_options(target, spec.compile_options(), include_dirs, backend)),
        "compiler": compiler_version(backend),
        "payload_version": _PAYLOAD_VERSION,
    }
    compiled_now = False

    def compile_payload() -> bytes:
        nonlocal compiled_now
        result = compile_cubin(path.read_text(), path.name, target, spec.compile_options(), include_dirs, backend)
        missing = [k for k in spec.kernel_names if k not in cubin_symbols(result.cubin)]
        if missing:
            raise CompileError(
                path.name, result.log, spec.compile_options(),
                reason=f"kernels {missing} are not in the CUBIN (declare them extern \"C\" __global__)",
            )
        compiled_now = True
        meta = {
            "resources": {k: vars(r) for k, r in result.resources.items()},
            "seconds": result.seconds,
            "compiler": result.compiler,
            "log": result.log,
        }
        return _pack_payload(meta, result.cubin)

    meta, cubin = _unpack_payload(cached_artifact("kernels", spec.name, key, compile_payload))
    return CompiledModule(
        spec=spec,
        target=target,
        cubin=cubin,
        resources={k: KernelResources(**v) for k, v in meta["resources"].items()},
        compile_seconds=float(meta["seconds"]),
        compiler=meta["compiler"],
        log=meta["log"],
        cached=not compiled_now,
    )


_modules: dict[tuple[KernelSpec, str, int, str], Module] = {}
_modules_lock = threading.Lock()


def get_module(spec: KernelSpec, device: Any = None, backend: str | None = None) -> Module:
    """The module of ``spec`` built for and loaded on ``device`` (torch's current device when ``None``).

    Built and loaded once per (spec, target, device, backend) in this process; later
    calls are a dict lookup.
    """
    index = _device_index(device)
    backend = backend or default_backend()
    target = arch_target(device_arch(index), spec.arch_specific)
    key = (spec, target, index, backend)
    module = _modules.get(key)
    if module is not None:
        return module
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            module = _modules[key] = load_module(build(spec, target, backend).cubin, index)
        return module


_kernels: dict[tuple, Kernel] = {}


def get_kernel(spec: KernelSpec, name: str, signature: tuple[str, ...], device: Any = None) -> Kernel:
    """Kernel ``name`` of ``spec``'s module on ``device`` with its argument ``signature``.

    Looked up once per (spec, kernel, signature, device, compiler) in this process (the driver
    query and signature check are not repeated on the launch path); later calls are a dict lookup.
    """
    index = _device_index(device)
    key = (spec, name, tuple(signature), index, default_backend())
    kernel = _kernels.get(key)
    if kernel is None:
        module = get_module(spec, index)
        with _modules_lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _kernels[key] = module.kernel(name, signature)
    return kernel

