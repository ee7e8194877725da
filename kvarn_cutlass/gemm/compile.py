"""Compile an emitted K-score GEMM with nvcc, cache it, load its host helper.

One nvcc invocation per config (``-shared`` + ``-keep``) yields both pieces:
  * the kernel cubin for ``sm_90a`` (harvested from the kept intermediates), launched from Python
    through :mod:`kvarn_cutlass.runtime`, and
  * a host shared library exporting ``<entry>_query`` / ``<entry>_workspace_size`` /
    ``<entry>_params`` which fill the kernel's ``Params`` bytes (TMA descriptors included) -- called
    once per (config, problem, pointer set), never per launch.

Flags: ``-DNDEBUG`` (without it ptxas serialises the wgmma pipeline, warning C7510),
``-arch=sm_90a``, ``--expt-relaxed-constexpr``, ``-std=c++17``, CUTLASS include dirs from the
nvidia-cutlass wheel.  Both artifacts are stored as one checksummed entry through
``kvarn_cutlass.runtime.cached_artifact`` keyed by source hash, flags, nvcc version, arch and
nvidia-cutlass version.  Temporary files live in a private ``tempfile.mkdtemp`` directory (never
the cwd); the loaded .so is materialised under the cache root.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from ..runtime.diskcache import read_cache_file, write_cache_file
from .config import GemmConfig
from .emit import ARGS_FIELDS, QUERY, emit_source, entry_name

__all__ = ["GemmBinary", "build_gemm", "gemm_cache_path", "nvcc_flags", "cutlass_include_dirs", "KvarnKScoreArgs",
           "HostLib"]


# ---- runtime contract (kvarn_cutlass.runtime) ------------------------------------------------
def _rt():
    try:
        from .. import runtime as rt

        rt.cached_artifact, rt.cache_root, rt.normalize_arch, rt.CompileError  # noqa: B018
        return rt
    except (ImportError, AttributeError):  # package __init__ not exporting yet: use the submodules
        import types

        from ..runtime import arch, diskcache, errors

        return types.SimpleNamespace(
            cached_artifact=diskcache.cached_artifact, cache_root=diskcache.cache_root,
            normalize_arch=arch.normalize_arch, CompileError=errors.CompileError,
        )


@functools.lru_cache(maxsize=None)
def cutlass_include_dirs() -> tuple[str, ...]:
    """CUTLASS C++ include dirs shipped inside the nvidia-cutlass wheel (``cutlass_library/source``)."""
    import cutlass_library

    src = Path(os.environ.get("CUTLASS_PATH") or cutlass_library.source_path)
    dirs = [src / "include", src / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs[:1] if not (d / "cutlass" / "cutlass.h").is_file()]
    if missing:
        raise FileNotFoundError(f"CUTLASS headers not found under {missing}; reinstall nvidia-cutlass==4.2.0.0")
    return tuple(str(d) for d in dirs)


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and (Path(os.environ[var]) / "bin" / "nvcc").is_file():
            return str(Path(os.environ[var]) / "bin" / "nvcc")
    if Path("/usr/local/cuda/bin/nvcc").is_file():
        return "/usr/local/cuda/bin/nvcc"
    p = shutil.which("nvcc")
    if p is None:
        raise FileNotFoundError("nvcc not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda/bin, PATH)")
    return p


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def _cutlass_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass")
    except Exception:
        return "unknown"


def nvcc_flags(arch: int) -> list[str]:
    """nvcc flags (without -o / input) for a K-score GEMM translation unit."""
    if arch != 90:
        raise ValueError(f"the K-score GEMM uses sm_90a wgmma; arch={arch} is not supported (only 90)")
    flags = [
        "-std=c++17", "-DNDEBUG", "-O3", "--expt-relaxed-constexpr",
        f"-arch=sm_{arch}a",
        "-Xptxas=-v", "-lineinfo",
        "-shared", "-Xcompiler=-fPIC",
        "-diag-suppress=177",
    ]
    for d in cutlass_include_dirs():
        flags.append(f"-I{d}")
    return flags


# ---- the ctypes mirror of KvarnKScoreArgs ----------------------------------------------------
_CTYPES = {"void const*": ctypes.c_void_p, "void*": ctypes.c_void_p, "float const*": ctypes.c_void_p,
           "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


class KvarnKScoreArgs(ctypes.Structure):
    _fields_ = [(n, _CTYPES[t]) for n, t in ARGS_FIELDS]


# ---- artifact container ----------------------------------------------------------------------
_PACK_MAGIC = b"KVGEMM01"


def _pack(meta: dict, cubin: bytes, so: bytes) -> bytes:
    head = json.dumps(meta, sort_keys=True).encode()
    return _PACK_MAGIC + struct.pack("<QQQ", len(head), len(cubin), len(so)) + head + cubin + so


def _unpack(blob: bytes) -> tuple[dict, bytes, bytes]:
    if not blob.startswith(_PACK_MAGIC):
        raise ValueError("not a kvarn GEMM artifact")
    o = len(_PACK_MAGIC)
    nh, nc, ns = struct.unpack_from("<QQQ", blob, o)
    o += 24
    meta = json.loads(blob[o:o + nh]); o += nh
    cubin = blob[o:o + nc]; o += nc
    so = blob[o:o + ns]
    return meta, cubin, so


@dataclasses.dataclass(frozen=True)
class GemmBinary:
    """Compiled K-score GEMM: kernel cubin + host helper library bytes + build metadata."""

    config: GemmConfig
    arch: int
    entry: str
    cubin: bytes
    host_so: bytes
    meta: dict  # nvcc version, flags, ptxas resource log, compile seconds, source sha256
    cached: bool = False  # True when this call read the disk cache instead of running nvcc

    @property
    def ptxas_log(self) -> str:
        return self.meta.get("log", "")

    def host(self) -> "HostLib":
        return HostLib.load(self)


def _compile(src: str, entry: str, arch: int, flags: list[str]) -> tuple[bytes, bytes, str, float]:
    rt = _rt()
    tmp = tempfile.mkdtemp(prefix="kvarn_gemm_")
    try:
        cu = Path(tmp) / "kscore.cu"
        cu.write_text(src)
        so = Path(tmp) / "kscore.so"
        cmd = [nvcc_path(), *flags, "-keep", f"-keep-dir={tmp}", "-o", str(so), str(cu)]
        t0 = time.perf_counter()
        # nvcc stays in the caller's process group: stopping the demo's compile child or a build worker
        # (each leads a group of its own) stops nvcc and the cicc/ptxas it started with it
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, check=False)
        secs = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise rt.CompileError(f"{entry}.cu", log + "\n---- source ----\n" + src, cmd,
                                  reason=f"nvcc exited with status {proc.returncode}")
        cubins = [c for c in sorted(Path(tmp).glob(f"kscore*.sm_{arch}a.cubin")) if "_dlink" not in c.name]
        if len(cubins) != 1:
            raise rt.CompileError(f"{entry}.cu", log, cmd,
                                  reason=f"expected one kept cubin, found {[c.name for c in cubins]}")
        return cubins[0].read_bytes(), so.read_bytes(), log, secs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_BUILD_LOCK = threading.Lock()


def _cache_key(cfg: GemmConfig, cc: int) -> tuple[dict, str, list[str]]:
    """(kernel-cache key, emitted source, nvcc flags) of ``cfg`` on sm_``cc``."""
    src = emit_source(cfg)
    flags = nvcc_flags(cc)
    key = {
        "arch": f"sm_{cc}a",
        "source_sha256": hashlib.sha256(src.encode()).hexdigest(),
        # include dirs are machine paths: the headers are identified by the nvidia-cutlass version
        "flags": [f for f in flags if not f.startswith("-I")],
        "nvcc": nvcc_version(),
        "nvidia_cutlass": _cutlass_version(),
        "config": cfg.to_dict(),
        "format": 1,
    }
    return key, src, flags


def gemm_cache_path(cfg: GemmConfig, arch: "int | str" = 90) -> Path:
    """Where the kernel cache keeps ``cfg``'s build (present or not; :func:`build_gemm` checks its
    contents). Needs nvcc (its version is part of the key), no GPU."""
    from ..runtime.diskcache import entry_path

    cc = _rt().normalize_arch(arch)
    return entry_path("gemm", cfg.name, _cache_key(cfg, cc)[0])


def build_gemm(cfg: GemmConfig, arch: "int | str" = 90, on_compile: Callable[[], None] | None = None) -> GemmBinary:
    """Emit + compile (or fetch from the disk cache) the K-score GEMM for ``cfg``.  No GPU needed.

    ``on_compile()`` is called when nvcc is about to run (a cache miss, with the entry's lock held),
    never on a cache hit."""
    rt = _rt()
    cc = rt.normalize_arch(arch)
    key, src, flags = _cache_key(cfg, cc)
    entry = entry_name(cfg)

    compiled = []  # build() runs only when the cache holds no valid entry

    def build() -> bytes:
        compiled.append(True)
        if on_compile is not None:
            on_compile()
        cubin, so, log, secs = _compile(src, entry, cc, flags)
        meta = {"nvcc": key["nvcc"], "flags": flags, "log": log, "seconds": round(secs, 2),
                "source_sha256": key["source_sha256"], "entry": entry, "nvidia_cutlass": key["nvidia_cutlass"]}
        return _pack(meta, cubin, so)

    blob = rt.cached_artifact("gemm", cfg.name, key, build)
    meta, cubin, so = _unpack(blob)
    return GemmBinary(config=cfg, arch=cc, entry=entry, cubin=cubin, host_so=so, meta=meta, cached=not compiled)


# ---- host helper library ---------------------------------------------------------------------
class HostLib:
    """ctypes view of a config's host helper .so (query sizes, build Params bytes)."""

    _loaded: dict[str, "HostLib"] = {}

    def __init__(self, lib: ctypes.CDLL, entry: str):
        self._lib = lib
        self.entry = entry
        q = getattr(lib, f"{entry}_query")
        q.restype = ctypes.c_int64
        q.argtypes = [ctypes.c_int]
        self._query = q
        ws = getattr(lib, f"{entry}_workspace_size")
        ws.restype = ctypes.c_int64
        ws.argtypes = [ctypes.POINTER(KvarnKScoreArgs)]
        self._ws = ws
        pf = getattr(lib, f"{entry}_params")
        pf.restype = ctypes.c_int
        pf.argtypes = [ctypes.POINTER(KvarnKScoreArgs), ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)]
        self._params = pf
        self.params_size = int(q(QUERY["params_size"]))
        self.smem_size = int(q(QUERY["smem_size"]))
        self.threads = int(q(QUERY["threads"]))
        self.cluster = (int(q(QUERY["cluster_m"])), int(q(QUERY["cluster_n"])), int(q(QUERY["cluster_k"])))
        args_size = int(q(QUERY["args_size"]))
        if args_size != ctypes.sizeof(KvarnKScoreArgs):
            raise RuntimeError(f"KvarnKScoreArgs layout mismatch: C {args_size} B, ctypes {ctypes.sizeof(KvarnKScoreArgs)} B")

    @classmethod
    def load(cls, binary: GemmBinary) -> "HostLib":
        digest = hashlib.sha256(binary.host_so).hexdigest()[:16]
        with _BUILD_LOCK:
            hit = cls._loaded.get(digest)
            if hit is not None:
                return hit
            path = _rt().cache_root() / f"sm_{binary.arch}a" / "gemm_so" / f"{binary.config.name}-{digest}.so"
            # dlopen needs a file: rewrite it when absent, unreadable, not a file or not these bytes
            have, _ = read_cache_file(path)
            if have is None or hashlib.sha256(have).hexdigest()[:16] != digest:
                write_cache_file(path, binary.host_so)
            lib = cls(ctypes.CDLL(str(path)), binary.entry)
            cls._loaded[digest] = lib
            return lib

    def workspace_size(self, args: KvarnKScoreArgs) -> int:
        return int(self._ws(ctypes.byref(args)))

    def params(self, args: KvarnKScoreArgs) -> tuple[bytes, tuple[int, int, int]]:
        """Params bytes and grid for ``args``.  Raises ``ValueError`` when CUTLASS rejects the problem."""
        buf = ctypes.create_string_buffer(self.params_size)
        grid = (ctypes.c_int32 * 3)()
        rc = self._params(ctypes.byref(args), buf, self.params_size, grid)
        if rc == 1:
            raise ValueError(
                f"{self.entry}: CUTLASS can_implement rejected M={args.M} N={args.N} K={args.K} L={args.L} "
                f"(lda={args.lda} ldb={args.ldb} ldd={args.ldd}; check 16-byte alignment of strides and pointers)")
        if rc == 3:
            raise ValueError(f"{self.entry}: this schedule needs a workspace buffer")
        if rc != 0:
            raise RuntimeError(f"{self.entry}_params returned {rc}")
        return buf.raw, (grid[0], grid[1], grid[2])
