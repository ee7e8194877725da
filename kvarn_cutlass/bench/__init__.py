"""Benchmark infrastructure: CUDA-event timing (``timing``), result records with provenance
(``record``) and a registry of named sections run by ``kvarn-cutlass bench``.

A section is a function ``fn(opts: BenchOptions) -> dict`` returning JSON-serializable
results; a module registers it at import with :func:`register_section`, and lists itself
in :data:`SECTION_MODULES` so that the CLI finds it. A section too long for one device command
can also register its parts (``parts``: names with estimated seconds, run with ``--part``) and a
``merge`` of a new run's results into the recorded ones, so that the parts fill one record.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["SECTION_MODULES", "BenchOptions", "PartsPlan", "Section", "register_section", "sections"]

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
        parts: the parts of the section to run (names from its ``parts`` lister); empty: all of it.
    """

    quick: bool = False
    parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class PartsPlan:
    """What a section with parts would run under some options: ``fixed_s``, the estimated seconds every
    command pays before its first part (imports, model build, first kernel compiles), and ``parts``,
    (name, estimated seconds) in run order."""

    fixed_s: float
    parts: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Section:
    """A registered section: ``run``; optionally ``parts`` (the :class:`PartsPlan` of some options) and
    ``merge(recorded, new) -> results`` (a new run's results over the recorded ones)."""

    name: str
    run: Callable[[BenchOptions], dict[str, Any]]
    description: str
    parts: Callable[[BenchOptions], PartsPlan] | None = None
    merge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None


_sections: dict[str, Section] = {}


def register_section(name: str, run: Callable[[BenchOptions], dict[str, Any]], description: str,
                     parts: Callable[[BenchOptions], PartsPlan] | None = None,
                     merge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Register a bench section under a unique ``name`` (re-registering the same function is a no-op);
    ``parts`` and ``merge``: see :class:`Section`."""
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"section name {name!r} must be letters, digits, '_' or '-'")
    existing = _sections.get(name)
    if existing is not None and existing.run is not run:
        raise ValueError(f"bench section {name!r} is already registered by {existing.run.__module__}")
    _sections[name] = Section(name, run, description, parts, merge)


def sections() -> dict[str, Section]:
    """Name -> section, after importing every module in :data:`SECTION_MODULES`."""
    for module in SECTION_MODULES:
        importlib.import_module(module)
    return dict(sorted(_sections.items()))
