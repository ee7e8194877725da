"""Shared pytest setup.

* Tests marked ``gpu`` are skipped where torch sees no CUDA device.
* torch runs one intra-op thread (``OMP_NUM_THREADS=1`` unless already set), for this process and the
  command-line processes the tests start.
* Slow extras (:data:`EXTRAS`) are left out of the default run and run with ``--extras`` (or ``-m extra``,
  which runs only them). The default run is the README's ``python3 -m pytest -q -rs -n auto``, which CI runs on a
  2-core CPU machine and which must stay well under 10 minutes with a cold kernel cache, the accuracy
  gates (``tests/test_accuracy.py``) included.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest

# Set before any test module imports torch. The tests' tensors are small: on the 2-core machine two OpenMP
# threads bought nothing idle and cost 4x under load (others' jobs on the other core): test_hf.py took 42 s
# with two threads and 19 s with one on an idle machine; test_accuracy.py 980 s and 232 s at load 3.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# (node id pattern ("*" matches anything; brackets are literal), node id it keeps in the default run, why the default run can do without the
# rest). Every shipped variant is still built for sm_90, the measured target, in the default run; sm_80 is a
# build-only target (no kernel has run there), so one representative variant per family keeps it covered.
EXTRAS: tuple[tuple[str, str, str], ...] = (
    ("tests/test_decode.py::test_variant_compiles[*-sm_80]",
     "tests/test_decode.py::test_variant_compiles[decode_d128_t128_v2_s2-sm_80]",
     "sm_80 builds of every decode variant (~70 s cold); every variant builds for sm_90 by default"),
    ("tests/test_compress.py::test_compress_compiles_every_shape[*-sm_80]",
     "tests/test_compress.py::test_compress_compiles_every_shape[128-128-sm_80]",
     "sm_80 builds of every compression shape (~20 s cold); every shape builds for sm_90 by default"),
    ("tests/test_compress.py::test_cluster_warps_variants_compile[*]",
     "tests/test_compress.py::test_cluster_warps_variants_compile[4]",
     "the 16-warp A/B variant's build (~12 s cold); the 4-warp one stays, the emulation covers both orders"),
    ("tests/test_prefill_int8.py::test_int8_variant_compiles[*]",
     "tests/test_prefill_int8.py::test_int8_variant_compiles[sm_90]",
     "sm_80 builds of the int8 K-operand variants and their f16 twins (~14 s cold); all build for sm_90 by default"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--extras", action="store_true",
                     help="also run the slow extras that the default run leaves out (tests/conftest.py EXTRAS)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "extra: a slow extra, left out unless --extras or -m extra (tests/conftest.py)")


def _matches(nodeid: str, pattern: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), nodeid) is not None


def _is_extra(nodeid: str) -> bool:
    return any(_matches(nodeid, pattern) and nodeid != keep for pattern, keep, _ in EXTRAS)


def _named(nodeid: str, args: list[str]) -> bool:
    """Whether a command-line argument names this test (or its function) by node id: that runs it anyway."""
    return any("::" in a and (nodeid == a or nodeid.startswith(a + "[") or nodeid.endswith("/" + a)) for a in args)


@pytest.hookimpl(tryfirst=True)  # mark the extras before -m selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    extras = [item for item in items if _is_extra(item.nodeid)]
    for item in extras:
        item.add_marker(pytest.mark.extra)
    if not any("::" in a for a in config.args):  # whole files: a stale entry would put its tests back by default
        for pattern, keep, _ in EXTRAS:
            file = pattern.split("::", 1)[0]
            if any(item.nodeid.startswith(file + "::") for item in items) and keep not in {
                    item.nodeid for item in items if _matches(item.nodeid, pattern)}:
                warnings.warn(pytest.PytestConfigWarning(
                    f"tests/conftest.py EXTRAS: {pattern!r} no longer matches {keep!r}; update the entry"))
    left_out = [item for item in extras if not _named(item.nodeid, config.args)]
    if left_out and not config.getoption("--extras") and "extra" not in (config.getoption("markexpr") or ""):
        ids = {item.nodeid for item in left_out}
        items[:] = [item for item in items if item.nodeid not in ids]
        config.hook.pytest_deselected(items=left_out)
        config._kvarn_extras_left_out = len(left_out)  # for the summary line

    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left_out = getattr(config, "_kvarn_extras_left_out", 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow extras left out (python3 -m pytest --extras runs them too; "
                                    "tests/conftest.py says which and why)")
    elif (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None)
          and not config.getoption("--extras") and "extra" not in (config.getoption("markexpr") or "")):
        # under pytest-xdist the workers collect and leave the extras out; this process never sees the items
        terminalreporter.write_line("slow extras left out (python3 -m pytest --extras runs them too; "
                                    "tests/conftest.py says which and why)")


@pytest.fixture(scope="session")
def kernel_cache_root(tmp_path_factory) -> str:
    """A kernel cache for the session, never the user's: one directory for all pytest-xdist workers of the run
    (their base temp directories share a parent), so a module is compiled once per run (a file lock per module)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kvarn-kernel-cache"
    return str(root)
