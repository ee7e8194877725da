"""Benchmark records: merge one section's results into ``docs/benchmarks/<gpu>.json`` with provenance.

File layout (JSON, keys sorted)::

    {"sections": {"<section>": {"provenance": {...}, "results": {...}}, ...}}

Writing a section replaces that section's entry whole and keeps the others, so each
section can be re-run on its own; a section that runs in parts passes its ``merge``, which
combines the recorded results with the new ones (the provenance is then the latest run's). Provenance says where the numbers came from: GPU
name and capability, driver, CUDA, torch, Python, package version, git commit, date.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any, Callable

__all__ = ["REPO_ROOT", "gpu_slug", "default_record_path", "provenance", "record_section", "write_json_atomic"]

# The checkout holding this package, when it is one (docs/ lives beside the package there).
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
REPO_ROOT: Path | None = _PACKAGE_PARENT if (_PACKAGE_PARENT / "pyproject.toml").is_file() else None


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: ``"NVIDIA H200"`` -> ``"h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return slug or "gpu"


def default_record_path(out_dir: str | os.PathLike | None = None) -> Path:
    """``<out_dir or REPO_ROOT/docs/benchmarks>/<gpu slug>.json`` for torch's current GPU.

    Raises:
        RuntimeError: no ``out_dir`` and the package is not in a checkout (an installed copy).
    """
    import torch

    if out_dir is None:
        if REPO_ROOT is None:
            raise RuntimeError("the package is not running from a checkout; pass an output directory (--out DIR)")
        out_dir = REPO_ROOT / "docs" / "benchmarks"
    return Path(out_dir) / f"{gpu_slug(torch.cuda.get_device_name())}.json"


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def _driver_version() -> str | None:
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip()
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}" if err == driver.CUresult.CUDA_SUCCESS else None
    except Exception:  # the driver library may be absent; provenance then says unknown
        return None


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("kvarn-cutlass")
    except Exception:  # running from a checkout that was never pip-installed
        from kvarn_cutlass import __version__

        return __version__


def provenance() -> dict[str, Any]:
    """Where a measurement was made: hardware, software versions, commit and UTC date."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    # KVARN_GIT_COMMIT: set by whoever copies a checkout to a machine whose .git is absent or stale.
    commit = os.environ.get("KVARN_GIT_COMMIT") or None
    if commit is None and REPO_ROOT is not None and (REPO_ROOT / ".git").exists():
        commit = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT)
        if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT):
            commit += "-dirty"
    return {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kvarn_cutlass": _package_version(),
        "git_commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    }


def record_section(section: str, results: dict[str, Any], path: str | os.PathLike | None = None,
                   prov: dict[str, Any] | None = None,
                   merge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None) -> Path:
    """Merge ``results`` of ``section`` into the record file and return its path.

    Args:
        section: section name (the key under ``"sections"``).
        results: JSON-serializable results of that section.
        path: record file; default :func:`default_record_path`.
        prov: provenance to store; default :func:`provenance` (measured now).
        merge: ``merge(recorded, results)``, the results to store when the record already has the section
            (default: ``results`` replace it).

    The file is rewritten atomically (temporary file beside it, then ``os.replace``).
    """
    target = Path(path) if path is not None else default_record_path()
    doc: dict[str, Any] = {"sections": {}}
    if target.exists():
        doc = json.loads(target.read_text())
        if not isinstance(doc.get("sections"), dict):
            raise ValueError(f"{target} is not a benchmark record (no 'sections' object)")
    old = doc["sections"].get(section)
    if merge is not None and isinstance(old, dict) and isinstance(old.get("results"), dict):
        results = merge(old["results"], results)
    doc["sections"][section] = {"provenance": prov if prov is not None else provenance(), "results": results}
    write_json_atomic(target, doc)
    return target


def write_json_atomic(path: str | os.PathLike, doc: Any) -> None:
    """``doc`` as indented, key-sorted JSON at ``path`` (parents created), atomically: a temporary file
    beside it, then ``os.replace``. The file gets mode 0o666 less the umask, as any file the process
    creates (``tempfile.mkstemp`` would make it 0600: a record written by CI or another user would be
    unreadable to the team)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
