"""Where the tuned kernel-config tables live: ``gemm_configs/`` (package data).

``kvarn-cutlass tune`` writes ``prefill_sm<arch>.json`` there (the fused prefill kernel's configs per
bucket, :mod:`kvarn_cutlass.ops.prefill`). The directory ships inside the package
(``kvarn_cutlass/gemm_configs/``), so an installed wheel finds its tables as a checkout does; in a
checkout ``gemm_configs/`` at the repository root links to the same directory. The directory keeps
its name from the CUTLASS GEMM tables it used to hold, so that ``$KVARN_CUTLASS_GEMM_CONFIGS``
settings and the paths in the docs and tools stay valid.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path

__all__ = ["CONFIG_ENV", "config_dir"]

CONFIG_ENV = "KVARN_CUTLASS_GEMM_CONFIGS"


def config_dir() -> Path:
    """``$KVARN_CUTLASS_GEMM_CONFIGS`` when set, else the tables shipped in the package
    (``kvarn_cutlass/gemm_configs/``)."""
    env = os.environ.get(CONFIG_ENV, "").strip()
    if env:
        return Path(env)
    return _package_dir()


@functools.lru_cache(maxsize=1)
def _package_dir() -> Path:
    # resolved once: importlib.resources costs ~30 us, and every prefill launch selects its config here
    return Path(os.fspath(resources.files("kvarn_cutlass") / "gemm_configs"))
