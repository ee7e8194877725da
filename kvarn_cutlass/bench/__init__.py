"""Benchmark infrastructure: CUDA-event timing (``timing``), result records with provenance
(``record``) and a registry of named sections run by ``kvarn-cutlass bench``.

A section is a function ``fn(opts: BenchOptions) -> dict`` returning JSON-serializable
results; a module registers it at import with :func:`register_section`, and lists itself
in :data:`SECTION_MODULES` so that the CLI finds it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["SECTION_MODULES", "BenchOptions", "Section", "register_section", "sections"]

# Modules whose import registers bench sections.
SECTION_MODULES: tuple[str, ...] = (
    "kvarn_cutlass.bench.copy",
    "kvarn_cutlass.bench.launch",
    "kvarn_cutlass.bench.compress",
    "kvarn_cutlass.bench.prefill",
    "kvarn_cutlass.bench.decode",
    "kvarn_cutlass.bench.e2e",
)


@dataclass(frozen=True)
class BenchOptions:
    """Options every section receives.

    Attributes:
        quick: fewer sizes and repetitions (smoke runs, CI on a GPU); results are still recorded.
    """

    quick: bool = False


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[BenchOptions], dict[str, Any]]
    description: str


_sections: dict[str, Section] = {}


def register_section(name: str, run: Callable[[BenchOptions], dict[str, Any]], description: str) -> None:
    """Register a bench section under a unique ``name`` (re-registering the same function is a no-op)."""
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"section name {name!r} must be letters, digits, '_' or '-'")
    existing = _sections.get(name)
    if existing is not None and existing.run is not run:
        raise ValueError(f"bench section {name!r} is already registered by {existing.run.__module__}")
    _sections[name] = Section(name, run, description)


def sections() -> dict[str, Section]:
    """Name -> section, after importing every module in :data:`SECTION_MODULES`."""
    for module in SECTION_MODULES:
        importlib.import_module(module)
    return dict(sorted(_sections.items()))
