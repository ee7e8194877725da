"""``kvarn-cutlass info``: fields, --json, graceful degradation without a GPU, cache size, the tuned prefill
configs summary."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvarn_cutlass.cli import main
from kvarn_cutlass.cli.info import INFO_KEYS, directory_size, prefill_config_summary

REPO = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def _info_json(capsys) -> dict:
    assert main(["info", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@no_gpu
def test_info_json_on_cpu_has_every_key_and_says_no_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(tmp_path / "cache"))
    info = _info_json(capsys)
    assert list(info) == list(INFO_KEYS)
    for key in ("gpu", "compute_capability", "arch", "gpu_memory_gib"):
        assert info[key] == "no CUDA GPU"
    assert info["prefill_configs"] == "none (no CUDA GPU)"
    assert info["torch"] == torch.__version__
    assert info["cuda_torch"] == (torch.version.cuda or "none (CPU build of torch)")
    assert info["kernel_cache"] == {"path": str(tmp_path / "cache"), "exists": False, "bytes": 0, "files": 0,
                                    "status": "not created yet (made by the first compile)"}
    for key in INFO_KEYS:  # every field is filled, never null
        assert info[key] not in (None, "")


@no_gpu
def test_info_text_is_one_line_per_field_and_exits_zero_as_a_process(tmp_path):
    env = {**os.environ, "KVARN_CUTLASS_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "kvarn_cutlass.cli", "info"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(INFO_KEYS)
    assert "no CUDA GPU" in lines[0]


@pytest.mark.parametrize("seed", [1, 2])
def test_kernel_cache_size_counts_regular_files_only(capsys, tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    root = tmp_path / "cache"
    expected_bytes, expected_files = 0, 0
    for i in range(rng.randint(3, 8)):
        d = root / f"kind{i % 3}" / f"sub{i}"
        d.mkdir(parents=True, exist_ok=True)
        n = rng.randint(0, 5000)
        (d / f"entry{i}.bin").write_bytes(rng.randbytes(n))
        expected_bytes += n
        expected_files += 1
    (root / "link").symlink_to(root / "kind0")  # a link is neither followed nor counted
    (root / "file-link").symlink_to(d / f"entry{i}.bin")
    if hasattr(os, "mkfifo"):
        os.mkfifo(root / "fifo")  # nor are other non-regular files
    assert directory_size(root) == (expected_bytes, expected_files), f"seed={seed}"
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(root))
    info = _info_json(capsys)
    assert info["kernel_cache"] == {"path": str(root), "exists": True, "bytes": expected_bytes, "files": expected_files,
                                    "status": "ready"}, f"seed={seed}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: the permission case cannot be built")
def test_kernel_cache_that_is_not_writable_says_so(capsys, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o500)
    try:
        monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(root))
        assert "is not writable" in _info_json(capsys)["kernel_cache"]["status"]
    finally:
        root.chmod(0o700)


@pytest.mark.parametrize("where", ["the path", "a parent"])
def test_kernel_cache_path_that_is_a_file_is_reported_unusable(where, capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory\n")
    root = blocker if where == "the path" else blocker / "kvarn" / "sub"
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(root))
    cache = _info_json(capsys)["kernel_cache"]
    assert cache["exists"] is False and cache["files"] == 0
    assert cache["status"].startswith("unusable: ") and f"{blocker} is a file" in cache["status"]
    assert "KVARN_CUTLASS_CACHE" in cache["status"]
    assert main(["info"]) == 0  # the text report carries the same words
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("kernel_cache"))
    assert f"{blocker} is a file" in line


@pytest.mark.parametrize("seed", [1, 2])
def test_prefill_config_summary_counts_tuned_buckets(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    n = rng.randint(5, 40)
    statuses = [rng.choice(["tuned", "untuned"]) for _ in range(n)]
    table = {"schema": 1, "arch": "sm90", "buckets": {f"D{64 << (i % 3)}_T128_V{i}": {"status": s}
                                                      for i, s in enumerate(statuses)}}
    (tmp_path / "prefill_sm90.json").write_text(json.dumps(table))
    monkeypatch.setenv("KVARN_CUTLASS_GEMM_CONFIGS", str(tmp_path))
    summary = prefill_config_summary(90)
    assert summary == {"arch": "sm90", "path": str(tmp_path / "prefill_sm90.json"), "buckets": n,
                       "tuned": statuses.count("tuned")}, f"seed={seed}"


def test_prefill_config_summary_of_the_committed_table(monkeypatch):
    monkeypatch.delenv("KVARN_CUTLASS_GEMM_CONFIGS", raising=False)
    table = json.loads((REPO / "gemm_configs" / "prefill_sm90.json").read_text())
    tuned = [k for k, b in table["buckets"].items() if b["status"] == "tuned"]
    summary = prefill_config_summary(90)
    assert (summary["buckets"], summary["tuned"]) == (len(table["buckets"]), len(tuned)) and tuned


def test_prefill_config_summary_says_why_none_applies(tmp_path, monkeypatch):
    assert prefill_config_summary(None) == "none (no CUDA GPU)"
    monkeypatch.setenv("KVARN_CUTLASS_GEMM_CONFIGS", str(tmp_path / "absent"))
    why = prefill_config_summary(90)
    assert why.startswith("none (") and str(tmp_path / "absent" / "prefill_sm90.json") in why and "not found" in why
    monkeypatch.delenv("KVARN_CUTLASS_GEMM_CONFIGS")
    assert "prefill_sm100.json not found" in prefill_config_summary(100)  # no table for that architecture yet


def test_info_rejects_unknown_arguments_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--bogus" in err


@pytest.mark.gpu
def test_info_on_a_gpu_reports_its_architecture(capsys):
    info = _info_json(capsys)
    major, minor = torch.cuda.get_device_capability()
    assert info["gpu"] == torch.cuda.get_device_name()
    assert info["compute_capability"] == f"{major}.{minor}"
    assert info["arch"] == f"sm_{major}{minor}"
    if (major, minor) == (9, 0):
        assert isinstance(info["prefill_configs"], dict) and info["prefill_configs"]["arch"] == "sm90"
