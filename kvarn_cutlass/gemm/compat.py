"""Make ``cutlass_cppgen`` (nvidia-cutlass 4.2) importable and usable for *emission only*
with cuda-bindings 13.x, on a machine with no GPU, without touching the installed package.

What nvidia-cutlass 4.2 assumes, and what this module does about it
--------------------------------------------------------------------
1. ``cuda.cuda``, ``cuda.cudart``, ``cuda.nvrtc`` and ``cuda.__version__`` (cuda-python <= 12.x
   layout).  cuda-bindings 13 removed them; only ``cuda.bindings.{driver,runtime,nvrtc}`` exist.
   cutlass_cppgen reaches them lazily (``lazy_import("cuda.cuda")`` resolves on first attribute
   access) and reads ``cuda.__version__`` in ``supports_cluster_launch``/``check_cuda_versions``.
   :func:`cuda_aliases` installs alias entries in ``sys.modules`` (and the version attribute on the
   ``cuda`` namespace package) *only for the duration of a ``with`` block*, and only for names that
   are missing; it removes exactly what it added on exit.  Nothing is aliased process-wide, so
   other code importing ``cuda.cuda`` still gets the honest ``ModuleNotFoundError``.

2. Import side effect: ``cutlass_cppgen.backend.__init__`` runs ``ArtifactManager()``, which opens
   ``sqlite3.connect("compiled_cache.db")`` -- a file in the *current working directory*.
   Its compiler also sets the process-wide ``tempfile.tempdir = "./"`` and writes
   ``host_func*.so``/temp ``.cu`` files and error logs into cwd, but only when *its* compiler runs.
   We import the package with a one-shot meta-path hook that sets ``cutlass_cppgen.CACHE_FILE`` to
   ``":memory:"`` right before ``cutlass_cppgen.backend.compiler`` executes (it does
   ``from cutlass_cppgen import CACHE_FILE`` at import), and we also rebind the module global
   afterwards.  We never call cutlass_cppgen's compiler (``plan.compile``/``plan.run``): this
   package only uses its emitters and compiles with :mod:`kvarn_cutlass.gemm.compile`.  As a guard,
   :func:`cutlass_cppgen_offline` snapshots ``tempfile.tempdir`` and restores it.

3. Device queries: ``OperationBase.__init__`` calls ``device_cc()`` when ``cc`` is None,
   ``epilogue.trace`` does the same when ``cc`` is not given, ``get_option_registry()`` calls
   ``device_cc()``, and ``supports_cluster_launch()`` (launch path only) too.  Emission here always
   passes ``cc`` explicitly and never touches the option registry.  Inside
   :func:`cutlass_cppgen_offline` the ``device_cc`` name is replaced in every loaded cutlass_cppgen
   module by a function that raises :class:`DeviceQueryError`, so an accidental device query fails
   loudly (and deterministically) instead of initialising CUDA or depending on the host's GPU.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import tempfile
import threading
import types
from typing import Iterator

__all__ = ["cuda_aliases", "import_cutlass_cppgen", "cutlass_cppgen_offline", "DeviceQueryError"]

_LOCK = threading.RLock()
_ALIASES = {
    "cuda.cuda": "cuda.bindings.driver",
    "cuda.cudart": "cuda.bindings.runtime",
    "cuda.nvrtc": "cuda.bindings.nvrtc",
}
_CACHE_FILE_OVERRIDE = ":memory:"


class DeviceQueryError(RuntimeError):
    """cutlass_cppgen tried to query a CUDA device during offline emission."""


def _bindings_version() -> str:
    try:
        import cuda.bindings as cb

        return str(cb.__version__)
    except Exception:  # pragma: no cover - cuda-bindings is a hard dependency
        return "13.0.0"


@contextlib.contextmanager
def cuda_aliases() -> Iterator[None]:
    """Temporarily expose the cuda-python 12 module names that nvidia-cutlass 4.2 imports.

    Re-entrant; only names that are absent are added, and exactly those are removed on exit.
    """
    with _LOCK:
        added_mods = []
        added_attrs = []
        cuda_pkg = importlib.import_module("cuda")
        for alias, target in _ALIASES.items():
            if alias in sys.modules:
                continue
            try:
                mod = importlib.import_module(target)
            except ImportError:  # e.g. nvrtc bindings missing: leave that name absent
                continue
            sys.modules[alias] = mod
            added_mods.append(alias)
            attr = alias.split(".", 1)[1]
            if not hasattr(cuda_pkg, attr):
                setattr(cuda_pkg, attr, mod)
                added_attrs.append(attr)
        if not hasattr(cuda_pkg, "__version__"):
            cuda_pkg.__version__ = _bindings_version()
            added_attrs.append("__version__")
        try:
            yield
        finally:
            for alias in added_mods:
                sys.modules.pop(alias, None)
            for attr in added_attrs:
                with contextlib.suppress(AttributeError):
                    delattr(cuda_pkg, attr)


class _CacheFileHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """One-shot hook: before ``cutlass_cppgen.backend.compiler`` runs, point CACHE_FILE at memory."""

    target = "cutlass_cppgen.backend.compiler"

    def __init__(self) -> None:
        self._spec = None

    def find_spec(self, fullname, path, target=None):  # noqa: D401 - importlib protocol
        if fullname != self.target:
            return None
        # find the real spec with the remaining finders
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                self._spec = spec
                return importlib.util.spec_from_loader(fullname, self, origin=spec.origin)
        return None

    def create_module(self, spec):
        return self._spec.loader.create_module(self._spec)

    def exec_module(self, module):
        pkg = sys.modules.get("cutlass_cppgen")
        if pkg is not None:
            pkg.CACHE_FILE = _CACHE_FILE_OVERRIDE
        module.__file__ = self._spec.origin
        module.__spec__ = self._spec
        module.__loader__ = self._spec.loader
        self._spec.loader.exec_module(module)


def _no_device_cc(device: int = -1) -> int:
    raise DeviceQueryError(
        "cutlass_cppgen tried to query the CUDA device compute capability during offline "
        "emission; pass cc=<int> explicitly (kvarn_cutlass emits for a given arch, never the host's)"
    )


_MODULE = None


def import_cutlass_cppgen():
    """Import ``cutlass_cppgen`` with no cwd side effects and return the module (cached)."""
    global _MODULE
    with _LOCK:
        if _MODULE is not None:
            return _MODULE
        already = "cutlass_cppgen" in sys.modules
        saved_tempdir = tempfile.tempdir
        hook = None
        if not already:
            hook = _CacheFileHook()
            sys.meta_path.insert(0, hook)
        try:
            with cuda_aliases():
                mod = importlib.import_module("cutlass_cppgen")
                # make sure every emitter module we use is loaded while the aliases exist
                importlib.import_module("cutlass_cppgen.backend.evt")
                importlib.import_module("cutlass_cppgen.backend.gemm_operation")
        finally:
            if hook is not None:
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(hook)
            tempfile.tempdir = saved_tempdir
        comp = sys.modules.get("cutlass_cppgen.backend.compiler")
        if comp is not None:
            # later ArtifactManager calls (which we never make) would also stay off the disk
            comp.CACHE_FILE = _CACHE_FILE_OVERRIDE
        mod.CACHE_FILE = _CACHE_FILE_OVERRIDE
        _MODULE = mod
        return mod


_REGISTRIES: dict[int, object] = {}


def _option_registry(mod, cc: int):
    reg = _REGISTRIES.get(cc)
    if reg is None:
        from cutlass_cppgen.library_defaults import OptionRegistry

        if getattr(mod, "_nvcc_version", None) is None:
            # normally set by check_cuda_versions() inside initialize_cuda_context(), which also
            # creates a CUDA context; the registry only needs the toolkit version string.
            mod._nvcc_version = mod.nvcc_version()
        reg = _REGISTRIES[cc] = OptionRegistry(cc)
    return reg


@contextlib.contextmanager
def cutlass_cppgen_offline(cc: int = 90):
    """Context for emission for compute capability ``cc`` (int, e.g. 90).

    Aliases present, device queries raise :class:`DeviceQueryError`, ``tempfile.tempdir``
    restored, and cutlass_cppgen's option registry (normally built from ``device_cc()`` on first
    use) replaced for the duration by one built for ``cc``.  Yields the ``cutlass_cppgen`` module.
    """
    mod = import_cutlass_cppgen()
    with _LOCK, cuda_aliases():
        saved_registry = mod._option_registry
        mod._option_registry = _option_registry(mod, int(cc))
        saved_tempdir = tempfile.tempdir
        patched: list[tuple[types.ModuleType, object]] = []
        for name, m in list(sys.modules.items()):
            if not name.startswith("cutlass_cppgen") or m is None:
                continue
            if "device_cc" in getattr(m, "__dict__", {}):
                patched.append((m, m.__dict__["device_cc"]))
                m.device_cc = _no_device_cc
        try:
            yield mod
        finally:
            for m, orig in patched:
                m.device_cc = orig
            mod._option_registry = saved_registry
            tempfile.tempdir = saved_tempdir
