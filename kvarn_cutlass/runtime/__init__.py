"""GPU runtime: every kernel of kvarn_cutlass is compiled, cached, loaded and launched through here.

Build (no GPU needed)::

    spec = KernelSpec("selftest.cu", ("kvarn_selftest_axpy",))
    compiled = build(spec, "sm_90")          # CompiledModule: cubin + per-kernel resources

Load and launch (on torch's current device and stream)::

    module = get_module(spec)                 # cached per (spec, arch, device)
    axpy = module.kernel("kvarn_selftest_axpy", ("ptr out", "ptr x", "ptr y", "f32 alpha", "i64 n"))
    axpy.launch(grid, block, (out, x, y, 2.0, n))     # tensors pass their data_ptr()
    hot = axpy.prepare(grid, block, (out, x, y, 2.0, n)); hot.launch()   # hot path: one driver call

Kernel families register their specs with :func:`register` (see ``registry``) so that
``kvarn-cutlass build`` can enumerate them.

Lower-level pieces: :func:`compile_cubin` (NVRTC/nvcc), :func:`cached_artifact` (locked,
atomic, checksummed disk cache under :func:`cache_root`), :func:`load_module`.
"""

from .arch import arch_target, device_arch, normalize_arch
from .compiler import (CompileResult, KernelResources, compile_cubin, compiler_version, cubin_global, cubin_sm,
                       cubin_symbols)
from .diskcache import cache_root, cached_artifact
from .errors import CompileError, CudaError
from .module import Kernel, Module, PreparedLaunch, load_module
from .registry import register
from .spec import CompiledModule, KernelSpec, build, get_kernel, get_module

__all__ = [
    "CompileError",
    "CompileResult",
    "CompiledModule",
    "CudaError",
    "Kernel",
    "KernelResources",
    "KernelSpec",
    "Module",
    "PreparedLaunch",
    "arch_target",
    "cubin_global",
    "build",
    "cache_root",
    "cached_artifact",
    "compile_cubin",
    "compiler_version",
    "cubin_sm",
    "cubin_symbols",
    "device_arch",
    "get_module",
    "get_kernel",
    "load_module",
    "normalize_arch",
    "register",
]
