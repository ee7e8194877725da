"""``tools/gpu_check.sh``'s bench step, run here with every ``python3`` call replaced by a stub that records its
arguments (nvidia-smi and the steps' real work are not needed for the argument routing)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script is bash")


def _python_calls(tmp_path, sections, **env) -> tuple[list[str], str]:
    """Every ``python3`` command line the script runs for ``sections`` with ``env``, and its summary."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.txt"
    (stub / "python3").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (stub / "python3").chmod(0o755)
    out = tmp_path / "out"
    full_env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(out), "GPU_BUILD": "0",
                "GPU_TEST_GROUPS": "none", **env}
    subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), *sections], env=full_env, cwd=ROOT,
                   capture_output=True, text=True, check=False)
    return log.read_text().splitlines(), (out / "summary.txt").read_text()


def _bench_calls(tmp_path, sections, **env) -> tuple[list[str], str]:
    """The bench command lines the script runs for ``sections`` with ``env``, and its summary."""
    calls, summary = _python_calls(tmp_path, sections, **env)
    return [line for line in calls if line.startswith("-m kvarn_cutlass.cli bench")], summary


def test_parts_go_to_the_e2e_section_in_a_run_of_their_own(tmp_path):
    calls, summary = _bench_calls(tmp_path, ["prefill", "e2e"], GPU_BENCH_PARTS="gen-b1-c2048 gen-b16-c512")
    assert calls == ["-m kvarn_cutlass.cli bench --section prefill",
                     "-m kvarn_cutlass.cli bench --section e2e --part gen-b1-c2048 --part gen-b16-c512"]
    assert "bench: exit 0" in summary and "bench_parts: exit 0" in summary


def test_sections_without_parts_run_together_and_all_runs_every_section(tmp_path):
    calls, _ = _bench_calls(tmp_path, ["compress", "append"])
    assert calls == ["-m kvarn_cutlass.cli bench --section compress --section append"]
    calls, _ = _bench_calls(tmp_path / "all", ["all"])
    assert calls == ["-m kvarn_cutlass.cli bench"]


def test_parts_without_the_e2e_section_fail_the_step_and_run_no_bench(tmp_path):
    calls, summary = _bench_calls(tmp_path, ["prefill"], GPU_BENCH_PARTS="gen-b1-c2048")
    assert calls == [] and "bench: exit 2" in summary


def _variant_calls(tmp_path, value):
    calls, summary = _python_calls(tmp_path, [], GPU_PREFILL_VARIANTS=value)
    return [line for line in calls if line.startswith("tools/prefill_variants.py")], summary


def test_prefill_variant_runs_split_on_semicolons_each_a_step(tmp_path):
    calls, summary = _variant_calls(tmp_path, "D256 only=k_batch_4,pv_serial ; only=k_batch_4;")
    assert calls == ["tools/prefill_variants.py D256 only=k_batch_4,pv_serial", "tools/prefill_variants.py only=k_batch_4"]
    assert summary.count("prefill_variants: exit 0") == 2
    calls, _ = _variant_calls(tmp_path / "tuned", "tuned")
    assert calls == ["tools/prefill_variants.py"]
    calls, _ = _variant_calls(tmp_path / "configs", "D256 r16c8n32wg r16c8n64wg")
    assert calls == ["tools/prefill_variants.py D256 r16c8n32wg r16c8n64wg"]


def test_records_reach_out_before_the_steps_after_the_bench(tmp_path):
    """The benchmark records are copied to $OUT right after the bench, so a later step that runs the device call
    past its time limit cannot lose them: when the decode variants step starts, they are there."""
    records = sorted(p.name for p in (ROOT / "docs" / "benchmarks").glob("*.json"))
    assert records
    stub = tmp_path / "bin"
    stub.mkdir()
    log, out = tmp_path / "calls.txt", tmp_path / "out"
    (stub / "python3").write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        f'case "$1" in tools/decode_variants.py) ls {out} | grep "\\.json$" | sed "s/^/present: /" >> {log};; esac\n')
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(out), "GPU_BUILD": "0",
           "GPU_TEST_GROUPS": "none", "GPU_DECODE_VARIANTS": "1"}
    subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "prefill"], env=env, cwd=ROOT,
                   capture_output=True, text=True, check=False)
    lines = log.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("tools/decode_variants.py"))
    assert sorted(line.removeprefix("present: ") for line in lines[at + 1:] if line.startswith("present: ")) == records
