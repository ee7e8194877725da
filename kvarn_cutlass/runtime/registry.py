"""Registry of the package's kernel families, so every kernel can be enumerated and built.

A kernel family's op module calls :func:`register` at import time. :func:`families`
first imports every module in :data:`KERNEL_MODULES` and every submodule of the
packages in :data:`KERNEL_PACKAGES`, so ``kvarn-cutlass build`` and tests see all
kernels without importing them by hand. To add a family: register its specs in its
op module; a module inside ``kvarn_cutlass.ops`` needs nothing else, one elsewhere
is added to :data:`KERNEL_MODULES`.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Callable, Iterable, Union

from .spec import KernelSpec

__all__ = ["KERNEL_MODULES", "KERNEL_PACKAGES", "register", "families", "specs"]

# Modules whose import registers kernel families.
KERNEL_MODULES: tuple[str, ...] = (
    "kvarn_cutlass.runtime.selftest",
    "kvarn_cutlass.decode",
)
# Packages whose submodules are all imported (op modules register their families there).
KERNEL_PACKAGES: tuple[str, ...] = ("kvarn_cutlass.ops",)

SpecSource = Union[Iterable[KernelSpec], Callable[[], Iterable[KernelSpec]]]

_families: dict[str, SpecSource] = {}
_lock = threading.Lock()


def register(family: str, specs: SpecSource) -> None:
    """Register the specs of a kernel family.

    Args:
        family: a unique family name, e.g. ``"decode"``.
        specs: the family's :class:`KernelSpec` variants, or a function returning them
            (called only when the registry is enumerated, for families with many variants).

    Raises:
        ValueError: ``family`` is already registered with different specs.
    """
    if not isinstance(family, str) or not family:
        raise TypeError(f"family must be a non-empty str, got {family!r}")
    source = specs if callable(specs) else tuple(specs)
    with _lock:
        # Re-registration by a re-imported module is harmless; two families with one name are a bug.
        if family in _families and _families[family] != source:
            raise ValueError(f"kernel family {family!r} is already registered with other specs")
        _families[family] = source


def families() -> dict[str, tuple[KernelSpec, ...]]:
    """Family name -> its specs, after importing :data:`KERNEL_MODULES` and :data:`KERNEL_PACKAGES`."""
    for name in KERNEL_MODULES:
        importlib.import_module(name)
    for name in KERNEL_PACKAGES:
        try:
            package = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a broken import inside the package is a bug, not an absent package
                raise
            continue
        for info in pkgutil.iter_modules(package.__path__, prefix=f"{name}."):
            importlib.import_module(info.name)
    with _lock:
        items = list(_families.items())
    out: dict[str, tuple[KernelSpec, ...]] = {}
    for family, source in sorted(items):
        resolved = tuple(source() if callable(source) else source)
        for s in resolved:
            if not isinstance(s, KernelSpec):
                raise TypeError(f"kernel family {family!r} yielded {type(s).__name__}, not KernelSpec")
        out[family] = resolved
    return out


def specs() -> tuple[KernelSpec, ...]:
    """Every registered spec, in family order."""
    return tuple(s for group in families().values() for s in group)
