"""CUDA C++ -> CUBIN compilation with NVRTC (default) or nvcc, without a GPU.

Both backends get ``-arch=<target>`` (e.g. ``sm_90``, ``sm_90a``), ``--std=c++17``
and ptxas verbosity; NVRTC also gets ``-default-device`` (nvcc has no such option,
so sources must mark device functions ``__device__`` to build with both).

Resource usage (registers, static shared memory, stack, spills) is parsed from the
ptxas ``-v`` report that both backends print into the compiler log, so it is known
at build time on a CPU machine; no cuobjdump is needed.

The backend is chosen by the ``backend`` argument, else ``$KVARN_CUTLASS_COMPILER``
(``nvrtc`` or ``nvcc``), else NVRTC.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .errors import CompileError, check_nvrtc

__all__ = [
    "COMPILER_ENV",
    "BACKENDS",
    "KernelResources",
    "CompileResult",
    "default_backend",
    "compiler_version",
    "cuda_include_dirs",
    "compile_cubin",
    "full_options",
    "parse_ptxas_log",
    "cubin_symbols",
    "cubin_sm",
]

COMPILER_ENV = "KVARN_CUTLASS_COMPILER"
BACKENDS = ("nvrtc", "nvcc")

_ARCH_OPTION = re.compile(r"^(-arch|--gpu-architecture|-gencode|--generate-code|-code|--gpu-code)\b")


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel resource usage reported by ptxas.

    Attributes:
        registers: registers per thread.
        shared_bytes: static shared memory per block (dynamic shared memory is a launch parameter).
        stack_bytes: stack frame (local memory) per thread.
        spill_store_bytes: bytes of register spill stores per thread.
        spill_load_bytes: bytes of register spill loads per thread.
        ptxas_ms: ptxas time for this kernel (the module's front-end time is not split per kernel).
    """

    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    ptxas_ms: float = 0.0


@dataclass(frozen=True)
class CompileResult:
    """Output of :func:`compile_cubin`.

    Attributes:
        cubin: the ELF CUBIN for one architecture.
        log: the full compiler log (includes the ptxas report).
        seconds: wall time of the compilation.
        resources: kernel (entry) name -> resource usage.
        compiler: the compiler version string (part of cache keys).
    """

    cubin: bytes
    log: str
    seconds: float
    resources: Mapping[str, KernelResources]
    compiler: str


def default_backend() -> str:
    """``$KVARN_CUTLASS_COMPILER`` if set, else ``"nvrtc"``."""
    backend = os.environ.get(COMPILER_ENV, "").strip().lower() or "nvrtc"
    if backend not in BACKENDS:
        raise ValueError(f"${COMPILER_ENV}={backend!r}; expected one of {BACKENDS}")
    return backend


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    return backend


def _cuda_homes() -> list[Path]:
    homes = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    return homes + [Path("/usr/local/cuda")]


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding the CUDA toolkit headers (``cuda_runtime.h``, CCCL), best first.

    Searched in order: ``$CUDA_HOME/include``, ``$CUDA_PATH/include``, the headers that
    ``cuda.pathfinder`` finds (pip wheels, conda), ``/usr/local/cuda/include``. Empty when
    none is found: NVRTC still compiles sources that include only its built-in headers
    (``cuda_fp16.h``, ``cuda_bf16.h``, ...), and a failing compile then says what was searched.
    """
    candidates: list[Path] = [h / "include" for h in _cuda_homes()[:-1]]
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # pathfinder's lookups raise various errors when nothing is installed
        pass
    candidates.append(Path("/usr/local/cuda/include"))
    for inc in candidates:
        if (inc / "cuda_runtime.h").is_file():
            # CUDA 13 moved CCCL (cuda/std, cub, thrust) into include/cccl.
            cccl = inc / "cccl"
            return (str(cccl), str(inc)) if cccl.is_dir() else (str(inc),)
    return ()


def _headers_hint() -> str:
    if cuda_include_dirs():
        return ""
    return (
        "\nnote: no CUDA toolkit headers were found (searched $CUDA_HOME/include, $CUDA_PATH/include, "
        "cuda.pathfinder, /usr/local/cuda/include); set CUDA_HOME or install the nvidia-cuda-runtime wheel "
        "if the source includes toolkit headers"
    )


@functools.lru_cache(maxsize=None)
def _nvcc_path() -> str | None:
    for home in _cuda_homes():
        if (home / "bin" / "nvcc").is_file():
            return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def compiler_version(backend: str | None = None) -> str:
    """Version string identifying the compiler build, e.g. ``"nvrtc 13.0 (13.0.88) /path/libnvrtc.so.13"``.

    It goes into every cache key, so switching compiler (version or library) rebuilds.
    """
    backend = _resolve_backend(backend)
    if backend == "nvrtc":
        try:
            from cuda.bindings import nvrtc

            major, minor = check_nvrtc(nvrtc.nvrtcVersion(), "nvrtcVersion")
        except Exception as e:
            raise RuntimeError(
                f"NVRTC is not usable ({e}); install the nvidia-cuda-nvrtc wheel (pip install 'cuda-bindings[all]') "
                f"or set {COMPILER_ENV}=nvcc"
            ) from e
        parts = [f"nvrtc {major}.{minor}"]
        try:
            from importlib.metadata import version

            parts.append(f"({version('nvidia-cuda-nvrtc')})")
        except Exception:  # not a pip install of NVRTC: the library path below identifies it
            pass
        try:
            from cuda import pathfinder

            parts.append(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path or "")
        except Exception:
            pass
        return " ".join(p for p in parts if p)
    nvcc = _nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (searched $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, PATH)")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return f"nvcc {m.group(1) if m else out.strip().splitlines()[-1]} {nvcc}"


def _check_options(options: Sequence[str]) -> tuple[str, ...]:
    if isinstance(options, str):
        raise TypeError("options must be a sequence of str, not a single str")
    opts = tuple(options)
    for o in opts:
        if not isinstance(o, str):
            raise TypeError(f"options must be str, got {o!r}")
        if _ARCH_OPTION.match(o):
            raise ValueError(f"option {o!r}: the architecture is given by the target argument, not options")
    return opts


def full_options(
    target: str, options: Sequence[str] = (), include_dirs: Sequence[str] = (), backend: str | None = None
) -> tuple[str, ...]:
    """Every option :func:`compile_cubin` passes to the compiler (what a cache key must hold).

    Raises:
        TypeError / ValueError: an option is not a str, or sets the architecture.
    """
    backend = _resolve_backend(backend)
    opts = _check_options(options)
    includes = tuple(f"-I{d}" for d in (*include_dirs, *cuda_include_dirs()))
    if backend == "nvrtc":
        return (f"-arch={target}", "--std=c++17", "-default-device", "--ptxas-options=-v", *includes, *opts)
    return (f"-arch={target}", "--std=c++17", "-Xptxas=-v", *includes, *opts)


def compile_cubin(
    source: str,
    source_name: str,
    target: str,
    options: Sequence[str] = (),
    include_dirs: Sequence[str] = (),
    backend: str | None = None,
) -> CompileResult:
    """Compile CUDA C++ source text to a CUBIN for one architecture; no GPU needed.

    Args:
        source: the CUDA C++ source text.
        source_name: file name shown in diagnostics (e.g. ``"selftest.cu"``).
        target: compiler target, e.g. ``"sm_90"`` or ``"sm_90a"`` (see :func:`arch.arch_target`).
        options: extra compiler options (``-D...``, ``-lineinfo``, ``--use_fast_math``,
            ``--maxrregcount=N``, ...); architecture options are rejected.
        include_dirs: extra include directories, searched before the CUDA headers.
        backend: ``"nvrtc"`` or ``"nvcc"``; default from :func:`default_backend`.

    Raises:
        CompileError: the compiler rejected the source or options (carries the log).
        RuntimeError: the chosen compiler is not installed.
    """
    backend = _resolve_backend(backend)
    all_opts = full_options(target, options, include_dirs, backend)
    version = compiler_version(backend)
    start = time.perf_counter()
    compile_fn = _nvrtc_compile if backend == "nvrtc" else _nvcc_compile
    cubin, log = compile_fn(source, source_name, all_opts)
    seconds = time.perf_counter() - start
    return CompileResult(cubin=cubin, log=log, seconds=seconds, resources=parse_ptxas_log(log), compiler=version)


def _nvrtc_compile(source: str, source_name: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    prog = check_nvrtc(nvrtc.nvrtcCreateProgram(source.encode(), source_name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        size = check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            reason = nvrtc.nvrtcGetErrorString(status)[1].decode()
            raise CompileError(source_name, log + _headers_hint(), options, reason=f"NVRTC: {reason}")
        size = check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvcc_compile(source: str, source_name: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    nvcc = _nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (searched $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, PATH)")
    # A private temporary directory: nvcc writes intermediates next to its output, never into the cwd.
    with tempfile.TemporaryDirectory(prefix="kvarn-cutlass-nvcc-") as tmp:
        src = Path(tmp) / Path(source_name).name
        out = Path(tmp) / "out.cubin"
        src.write_text(source)
        proc = subprocess.run(
            [nvcc, "-cubin", *options, "-o", str(out), str(src)], capture_output=True, text=True, cwd=tmp, check=False
        )
        log = (proc.stdout + proc.stderr).replace(tmp + os.sep, "")
        if proc.returncode != 0:
            raise CompileError(source_name, log, options, reason=f"nvcc exited with status {proc.returncode}")
        return out.read_bytes(), log


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_TIME = re.compile(r"Compile time = ([\d.]+) ms")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Kernel (entry function) name -> resources, from a ptxas ``-v`` report.

    The report lists, per entry function: ``Compiling entry function 'NAME'``,
    ``Function properties for NAME`` followed by the stack/spill line, and
    ``Used N registers, ... M bytes smem`` and ``Compile time = T ms``. Non-entry
    (device) functions are skipped.
    """
    fields: dict[str, dict[str, float]] = {}
    entry: str | None = None  # entry function the "Used ..." line belongs to
    props: str | None = None  # function the next stack/spill line belongs to
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            fields.setdefault(entry, {})
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif m := _STACK.search(line):
            if props in fields:
                fields[props].update(
                    stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)), spill_load_bytes=int(m.group(3))
                )
            props = None
        elif (m := _USED.search(line)) and entry is not None:
            smem = _SMEM.search(line)
            fields[entry].update(registers=int(m.group(1)), shared_bytes=int(smem.group(1)) if smem else 0)
        elif (m := _PTXAS_TIME.search(line)) and entry is not None:
            fields[entry]["ptxas_ms"] = float(m.group(1))
    return {name: KernelResources(**f) for name, f in fields.items()}


_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_ELF64_SECTION = struct.Struct("<IIQQQQIIQQ")
_ELF64_SYMBOL = struct.Struct("<IBBHQQ")
_SHT_SYMTAB = 2
_STT_FUNC = 2


def _elf_header(cubin: bytes) -> tuple:
    if len(cubin) < _ELF64_HEADER.size or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("cubin is not a 64-bit ELF image")
    return _ELF64_HEADER.unpack_from(cubin, 0)


def cubin_symbols(cubin: bytes) -> set[str]:
    """Names of the function symbols in a CUBIN (kernels with ``extern "C"`` keep their source name).

    Raises:
        ValueError: ``cubin`` is not a 64-bit ELF image.
    """
    hdr = _elf_header(cubin)
    shoff, shentsize, shnum = hdr[6], hdr[11], hdr[12]
    sections = [_ELF64_SECTION.unpack_from(cubin, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != _SHT_SYMTAB:
            continue
        str_off = sections[link][4]
        for pos in range(off, off + size, entsize or _ELF64_SYMBOL.size):
            st_name, st_info = _ELF64_SYMBOL.unpack_from(cubin, pos)[:2]
            if st_info & 0xF == _STT_FUNC:
                end = cubin.index(b"\0", str_off + st_name)
                names.add(cubin[str_off + st_name : end].decode())
    return names


def cubin_sm(cubin: bytes) -> int:
    """Compute capability a CUBIN was built for, from its ELF ``e_flags`` (e.g. 90 for sm_90/sm_90a)."""
    hdr = _elf_header(cubin)
    abi_version, flags = hdr[0][8], hdr[7]
    # ELF ABI version 8 (CUDA 12.8+) moved the SM number from bits 0-7 to bits 8-15.
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF
