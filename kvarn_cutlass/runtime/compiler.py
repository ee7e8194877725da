"""CUDA C++ -> CUBIN compilation with NVRTC (default) or nvcc, without a GPU.

Both backends get ``-arch=<target>`` (e.g. ``sm_90``, ``sm_90a``), ``--std=c++17``
and ptxas verbosity; NVRTC also gets ``-default-device`` (nvcc has no such option,
so sources must mark device functions ``__device__`` to build with both).

Resource usage is known at build time on a CPU machine, without cuobjdump: registers,
stack frame and static shared memory are read from the CUBIN's ELF sections
(:func:`cubin_resources`); spills and per-kernel ptxas time are parsed from the ptxas
``-v`` report in the compiler log (:func:`parse_ptxas_log`). The log is the weaker
source: on an H200 machine NVRTC 13.0 returned an empty log once the CUDA driver had
been initialized in the process, so those two fields are then ``None``.

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
from dataclasses import dataclass, replace
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
    "cutlass_include_dirs",
    "compile_cubin",
    "full_options",
    "parse_ptxas_log",
    "cubin_resources",
    "kernel_resources",
    "cubin_symbols",
    "cubin_sm",
    "cubin_global",
]

COMPILER_ENV = "KVARN_CUTLASS_COMPILER"
BACKENDS = ("nvrtc", "nvcc")

_ARCH_OPTION = re.compile(r"^(-arch|--gpu-architecture|-gencode|--generate-code|-code|--gpu-code)\b")


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel resource usage.

    Registers, stack and static shared memory come from the CUBIN itself (see
    :func:`cubin_resources`), so they are always known; spills and ptxas time come
    from the ptxas report in the compiler log and are ``None`` when the log lacks it.

    Attributes:
        registers: registers per thread.
        shared_bytes: static shared memory per block, as ptxas counts it (dynamic shared
            memory is a launch parameter).
        stack_bytes: stack frame (local memory) per thread.
        spill_store_bytes: bytes of register spill stores per thread, or None if unknown.
        spill_load_bytes: bytes of register spill loads per thread, or None if unknown.
        ptxas_ms: ptxas time for this kernel, or None if unknown (the front end is not split per kernel).
    """

    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    ptxas_ms: float | None = None


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


@functools.lru_cache(maxsize=None)
def cutlass_include_dirs() -> tuple[str, ...]:
    """The CUTLASS and CuTe C++ headers shipped in the nvidia-cutlass wheel (a dependency), as include
    directories for :func:`compile_cubin`: the one directory holding ``cutlass/`` and ``cute/`` (e.g.
    ``cute/arch/mma_sm90_gmma.hpp``, the sm_90 wgmma atoms).

    ``$CUTLASS_PATH`` (a CUTLASS source tree, the variable CUTLASS's own tools read) takes precedence
    over the wheel's copy (``cutlass_library.source_path``).

    Raises:
        FileNotFoundError: neither has the headers (the message says where it looked and what to install).
    """
    env = os.environ.get("CUTLASS_PATH", "").strip()
    if env:
        root, origin = Path(env), "$CUTLASS_PATH"
    else:
        try:
            import cutlass_library
        except ImportError:
            raise FileNotFoundError("the CUTLASS headers come from the nvidia-cutlass wheel, which is not installed "
                                    "(pip install nvidia-cutlass==4.2.0.0, or set CUTLASS_PATH to a CUTLASS "
                                    "source tree)") from None
        root, origin = Path(cutlass_library.source_path), "the nvidia-cutlass wheel"
    include = root / "include"
    if not ((include / "cutlass" / "cutlass.h").is_file() and (include / "cute" / "tensor.hpp").is_file()):
        raise FileNotFoundError(f"no CUTLASS/CuTe headers under {include} (from {origin}); reinstall "
                                "nvidia-cutlass==4.2.0.0 or point CUTLASS_PATH at a CUTLASS source tree")
    return (str(include),)


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
    return CompileResult(cubin=cubin, log=log, seconds=seconds, resources=kernel_resources(cubin, log), compiler=version)


def _nvrtc_compile(source: str, source_name: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    prog = check_nvrtc(nvrtc.nvrtcCreateProgram(source.encode(), source_name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        size = check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # Writable buffers: b" " * n may be a shared immutable object (n == 1 is CPython's cached b" ").
        buf = bytearray(size)
        check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            reason = nvrtc.nvrtcGetErrorString(status)[1].decode()
            raise CompileError(source_name, log + _headers_hint(), options, reason=f"NVRTC: {reason}")
        size = check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), log
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
_SHT_NOBITS = 8
_STT_OBJECT = 1
_STT_FUNC = 2
# .nv.info attribute records: u8 format, u8 attribute, then a u16 value, or for format
# EIFMT_SVAL a u16 size and that many bytes. The attributes read here hold (symbol index, value).
_EIFMT_SVAL = 4
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
# From sm_90 on the toolchain adds this much reserved space to a kernel's .nv.shared section
# when the kernel uses shared memory; ptxas's "bytes smem" does not count it.
_SM90_RESERVED_SMEM = 1024


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    entsize: int


def _elf_header(cubin: bytes) -> tuple:
    if len(cubin) < _ELF64_HEADER.size or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("cubin is not a 64-bit ELF image")
    return _ELF64_HEADER.unpack_from(cubin, 0)


def _cstr(cubin: bytes, offset: int) -> str:
    return cubin[offset : cubin.index(b"\0", offset)].decode()


def _elf_sections(cubin: bytes) -> list[_Section]:
    hdr = _elf_header(cubin)
    shoff, shentsize, shnum, shstrndx = hdr[6], hdr[11], hdr[12], hdr[13]
    raw = [_ELF64_SECTION.unpack_from(cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]
    return [_Section(_cstr(cubin, names_at + r[0]), r[1], r[4], r[5], r[6], r[9]) for r in raw]


def _elf_symbols(cubin: bytes, sections: list[_Section]) -> list[tuple[str, int]]:
    """(name, st_info) of every symbol, in symbol-table order (indices match .nv.info records)."""
    out: list[tuple[str, int]] = []
    for sec in sections:
        if sec.type != _SHT_SYMTAB:
            continue
        names_at = sections[sec.link].offset
        for pos in range(sec.offset, sec.offset + sec.size, sec.entsize or _ELF64_SYMBOL.size):
            st_name, st_info = _ELF64_SYMBOL.unpack_from(cubin, pos)[:2]
            out.append((_cstr(cubin, names_at + st_name), st_info))
    return out


def cubin_symbols(cubin: bytes) -> set[str]:
    """Names of the function symbols in a CUBIN (kernels with ``extern "C"`` keep their source name).

    Raises:
        ValueError: ``cubin`` is not a 64-bit ELF image.
    """
    return {name for name, info in _elf_symbols(cubin, _elf_sections(cubin)) if info & 0xF == _STT_FUNC}


def cubin_global(cubin: bytes, name: str) -> bytes:
    """The initial bytes of the ``__device__`` variable ``name`` of a CUBIN (``extern "C"`` keeps the name).

    A kernel source can export compile-time numbers the host needs (shared-memory sizes, block shapes)
    as an initialized ``extern "C" __device__ const`` array; this reads them without a GPU.

    Raises:
        ValueError: ``cubin`` is not a 64-bit ELF image.
        KeyError: no initialized variable ``name`` in the CUBIN.
    """
    sections = _elf_sections(cubin)
    for sec in sections:
        if sec.type != _SHT_SYMTAB:
            continue
        names_at = sections[sec.link].offset
        for pos in range(sec.offset, sec.offset + sec.size, sec.entsize or _ELF64_SYMBOL.size):
            st_name, st_info, _, st_shndx, st_value, st_size = _ELF64_SYMBOL.unpack_from(cubin, pos)
            if st_info & 0xF == _STT_OBJECT and 0 < st_shndx < len(sections) and _cstr(cubin, names_at + st_name) == name:
                data = sections[st_shndx]
                if data.type == _SHT_NOBITS:
                    break
                return cubin[data.offset + st_value : data.offset + st_value + st_size]
    raise KeyError(f"the CUBIN has no initialized __device__ variable {name!r}")


def cubin_sm(cubin: bytes) -> int:
    """Compute capability a CUBIN was built for, from its ELF ``e_flags`` (e.g. 90 for sm_90/sm_90a)."""
    hdr = _elf_header(cubin)
    abi_version, flags = hdr[0][8], hdr[7]
    # ELF ABI version 8 (CUDA 12.8+) moved the SM number from bits 0-7 to bits 8-15.
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF


def cubin_resources(cubin: bytes) -> dict[str, KernelResources]:
    """Kernel name -> registers, stack frame and static shared memory, read from a CUBIN.

    Registers and stack come from the ``EIATTR_REGCOUNT`` / ``EIATTR_FRAME_SIZE`` records
    of the ``.nv.info`` section, static shared memory from the size of ``.nv.shared.<kernel>``
    (less the 1 KiB the toolchain reserves in it from sm_90 on). Spills and ptxas time
    are not in the CUBIN and stay ``None``.

    Raises:
        ValueError: ``cubin`` is not a 64-bit ELF image.
    """
    sections = _elf_sections(cubin)
    symbols = _elf_symbols(cubin, sections)
    regs: dict[str, int] = {}
    stack: dict[str, int] = {}
    for sec in sections:
        if sec.name != ".nv.info":
            continue
        pos, end = sec.offset, sec.offset + sec.size
        while pos + 4 <= end:
            fmt, attr, size = cubin[pos], cubin[pos + 1], struct.unpack_from("<H", cubin, pos + 2)[0]
            if fmt == _EIFMT_SVAL and attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
                sym, value = struct.unpack_from("<II", cubin, pos + 4)
                (regs if attr == _EIATTR_REGCOUNT else stack)[symbols[sym][0]] = value
            pos += 4 + (size if fmt == _EIFMT_SVAL else 0)
    shared = {sec.name[len(".nv.shared.") :]: sec.size for sec in sections if sec.name.startswith(".nv.shared.")}
    reserved = _SM90_RESERVED_SMEM if cubin_sm(cubin) >= 90 else 0
    kernels = {name for name, info in symbols if info & 0xF == _STT_FUNC} & set(regs)
    return {
        k: KernelResources(
            registers=regs[k],
            shared_bytes=max(shared.get(k, 0) - reserved, 0),
            stack_bytes=stack.get(k, 0),
        )
        for k in kernels
    }


def kernel_resources(cubin: bytes, log: str) -> dict[str, KernelResources]:
    """:func:`cubin_resources`, with spills and ptxas time from the compile log where it has them."""
    from_log = parse_ptxas_log(log)
    out = {}
    for name, res in cubin_resources(cubin).items():
        extra = from_log.get(name)
        if extra is not None:
            res = replace(res, spill_store_bytes=extra.spill_store_bytes, spill_load_bytes=extra.spill_load_bytes,
                          ptxas_ms=extra.ptxas_ms)
        out[name] = res
    return out
