"""What an installed wheel holds: the package data the library reads at run time (kernel sources,
the tuned kernel configs), found from the installed package rather than from a checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvarn_cutlass.ops.prefill import FusedConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and *.egg-info beside its sources)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "kvarn_cutlass", src / "kvarn_cutlass", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_wheel(sys.argv[1]))", str(out)],
                          cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1]


def test_wheel_ships_the_gemm_configs_and_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for table in sorted((REPO / "kvarn_cutlass" / "gemm_configs").glob("*.json")):
        member = f"kvarn_cutlass/gemm_configs/{table.name}"
        assert member in names, member
        assert zipfile.ZipFile(wheel).read(member) == table.read_bytes()
    for source in sorted((REPO / "kvarn_cutlass" / "csrc").glob("*.cu*")):
        assert f"kvarn_cutlass/csrc/{source.name}" in names


def test_installed_package_finds_its_gemm_configs(wheel, tmp_path):
    """Unpacked as pip installs it, away from any checkout: the tuned prefill table is the one selected
    (an installed wheel used to look for ../gemm_configs beside site-packages and fall back to untuned)."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import json, sys, warnings; sys.path.insert(0, sys.argv[1]); import kvarn_cutlass as kc; "
             "from kvarn_cutlass.runtime.configs import config_dir; "
             "from kvarn_cutlass.ops.prefill import select_config; "
             "warnings.simplefilter('error'); "  # an untuned fallback warns: make it fail the probe
             "cfg = select_config(kc.TileSpec('k4v2_g128', 128)); "
             "print(json.dumps({'package': kc.__file__, 'dir': str(config_dir()), 'config': cfg.name}))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVARN_CUTLASS_GEMM_CONFIGS")}
    proc = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["package"]).is_relative_to(site), got["package"]  # the unpacked wheel, not the checkout
    assert Path(got["dir"]) == site / "kvarn_cutlass" / "gemm_configs"
    table = json.loads((REPO / "kvarn_cutlass" / "gemm_configs" / "prefill_sm90.json").read_text())
    entry = table["buckets"]["D128_T128_V2"]
    assert entry["status"] == "tuned" and got["config"] == FusedConfig(**entry["config"]).name


def test_checkout_root_gemm_configs_is_the_package_copy(monkeypatch):
    """One copy in the repository: ``gemm_configs/`` at the root (where the docs and ``tune`` point)
    is the package's directory, so a tuned table written through either path is the one shipped."""
    from kvarn_cutlass.runtime.configs import config_dir

    monkeypatch.delenv("KVARN_CUTLASS_GEMM_CONFIGS", raising=False)
    assert (REPO / "gemm_configs").resolve() == (REPO / "kvarn_cutlass" / "gemm_configs").resolve()
    assert config_dir().resolve() == (REPO / "kvarn_cutlass" / "gemm_configs").resolve()
