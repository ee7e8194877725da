"""``kvarn-cutlass info``: what this machine offers the package (GPU, driver, toolchain, caches, tuned configs).

Every field degrades to a string saying why it is absent ("no CUDA GPU", "not installed", ...), so the
command succeeds on a CPU-only machine. ``--json`` prints the same fields as one JSON object (keys in
:data:`INFO_KEYS`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import stat
from pathlib import Path
from typing import Any

__all__ = ["INFO_KEYS", "add_parser", "run", "gather", "prefill_config_summary", "directory_size", "cache_status"]

NO_GPU = "no CUDA GPU"
NOT_INSTALLED = "not installed"

# The keys of gather()'s result, in display order.
INFO_KEYS: tuple[str, ...] = (
    "gpu", "compute_capability", "arch", "gpu_memory_gib", "driver", "cuda_driver_api", "cuda_torch",
    "python", "torch", "cuda_bindings", "cuda_python", "nvidia_cutlass", "kvarn_cutlass", "nvcc", "nvrtc",
    "kernel_cache", "prefill_configs",
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "info",
        help="show the GPU, driver, CUDA/torch/CUTLASS versions, kernel cache and tuned prefill configs",
        description="Show what this machine offers kvarn-cutlass: GPU and architecture, driver, CUDA, torch, "
        "cuda-python and nvidia-cutlass versions, nvcc, NVRTC, the kernel cache directory and its size, and "
        "which tuned configs of the fused prefill kernel apply to this GPU. Works without a GPU (fields then "
        "say why they are absent).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return NOT_INSTALLED


def directory_size(path: Path) -> tuple[int, int]:
    """``(bytes, files)`` of the regular files under ``path`` (symlinks not followed; 0, 0 if absent)."""
    total = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # removed while walking (another process pruning the cache)
                continue
            if stat.S_ISREG(st.st_mode):  # not symlinks, sockets, fifos
                total += st.st_size
                files += 1
    return total, files


CACHE_READY = "ready"


def cache_status(root: Path) -> str:
    """Whether the kernel cache can be used at ``root``: ``"ready"`` (a writable directory), ``"not
    created yet"`` (it will be, on the first compile), or why it cannot (something that is not a
    directory in the way, no write permission), with the environment variable that moves it."""
    from ..runtime.diskcache import CACHE_ENV

    move = f"set {CACHE_ENV} to a writable directory"
    if root.exists() and not root.is_dir():
        return f"unusable: {root} is a file, not a directory; remove it or {move}"
    if root.is_dir():
        return CACHE_READY if os.access(root, os.W_OK | os.X_OK) else f"unusable: {root} is not writable; {move}"
    parent = root.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"unusable: {parent} is a file, so {root} cannot be created; {move}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"unusable: {root} cannot be created ({parent} is not writable); {move}"
    return "not created yet (made by the first compile)"


def prefill_config_summary(cc: int | None) -> dict[str, Any] | str:
    """Which ``gemm_configs/prefill_sm<cc>.json`` (the fused prefill kernel's tuned configs) applies to compute
    capability ``cc`` and how many of its buckets are tuned.

    Returns ``{"arch", "path", "buckets", "tuned"}``, or a string saying why none applies (no GPU, no table
    for this architecture: every bucket then runs its default config).
    """
    if cc is None:
        return f"none ({NO_GPU})"
    from ..ops.prefill import table_path

    path = table_path(f"sm{cc}")
    if not path.is_file():
        return f"none ({path} not found; every bucket uses its default config)"
    buckets = json.loads(path.read_text()).get("buckets", {})
    return {"arch": f"sm{cc}", "path": str(path), "buckets": len(buckets),
            "tuned": sum(1 for b in buckets.values() if b.get("status") == "tuned")}


def _gpu_fields() -> tuple[dict[str, Any], int | None]:
    try:
        import torch
    except ImportError:
        return {k: f"{NO_GPU} (torch {NOT_INSTALLED})" for k in ("gpu", "compute_capability", "arch", "gpu_memory_gib")}, None
    if not torch.cuda.is_available():
        return {k: NO_GPU for k in ("gpu", "compute_capability", "arch", "gpu_memory_gib")}, None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    cc = props.major * 10 + props.minor
    return {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}", "arch": f"sm_{cc}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1)}, cc


def _driver() -> str:
    from ..bench.record import _run

    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return smi.splitlines()[0].strip() if smi else "no NVIDIA driver (nvidia-smi not found or failed)"


def _cuda_driver_api() -> str:
    try:
        from cuda.bindings import driver
    except ImportError:
        return f"cuda-bindings {NOT_INSTALLED}"
    try:
        err, v = driver.cuDriverGetVersion()
    except Exception as e:  # libcuda.so absent: the bindings raise when they first load it
        return f"no NVIDIA driver ({type(e).__name__})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no NVIDIA driver ({err.name})"
    return f"{v // 1000}.{v % 1000 // 10}"


def _nvcc() -> str:
    try:
        from ..runtime import compiler_version

        return compiler_version("nvcc")  # the optional backend ($KVARN_CUTLASS_COMPILER=nvcc)
    except Exception:  # RuntimeError when absent; anything else means it is not usable either
        return "not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda/bin, PATH)"


def _nvrtc() -> str:
    try:
        from ..runtime import compiler_version

        return compiler_version("nvrtc")
    except Exception:
        return f"{NOT_INSTALLED} (pip install nvidia-cuda-nvrtc)"


def _torch_cuda() -> str:
    try:
        import torch
    except ImportError:
        return f"torch {NOT_INSTALLED}"
    return torch.version.cuda or "none (CPU build of torch)"


def gather() -> dict[str, Any]:
    """All fields of ``info`` as a dict with the keys :data:`INFO_KEYS` (strings, numbers or nested dicts)."""
    from ..runtime import cache_root

    gpu, cc = _gpu_fields()
    root = cache_root()
    size, files = directory_size(root)
    info: dict[str, Any] = {
        **gpu,
        "driver": _driver(),
        "cuda_driver_api": _cuda_driver_api(),
        "cuda_torch": _torch_cuda(),
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "cuda_bindings": _dist_version("cuda-bindings"),
        "cuda_python": _dist_version("cuda-python"),
        "nvidia_cutlass": _dist_version("nvidia-cutlass"),
        "kvarn_cutlass": _dist_version("kvarn-cutlass"),
        "nvcc": _nvcc(),
        "nvrtc": _nvrtc(),
        "kernel_cache": {"path": str(root), "exists": root.is_dir(), "status": cache_status(root), "bytes": size,
                         "files": files},
        "prefill_configs": prefill_config_summary(cc),
    }
    return {k: info[k] for k in INFO_KEYS}


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _text(info: dict[str, Any]) -> str:
    lines = []
    for key in INFO_KEYS:
        value = info[key]
        if key == "kernel_cache":
            status = "" if value["status"] == CACHE_READY else f" ({value['status']})"
            value = f"{value['path']}{status}, {_human_bytes(value['bytes'])} in {value['files']} files"
        elif key == "prefill_configs" and isinstance(value, dict):
            value = f"{value['path']}: {value['tuned']} of {value['buckets']} buckets tuned"
        lines.append(f"{key:18s} {value}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = gather()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(_text(info))
    return 0
