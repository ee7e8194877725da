"""``kvarn-cutlass build``: progress on stderr (a line per module off a terminal, a bar on one), one
worker per core by default, a summary that agrees with --json, the table behind --verbose, and
SIGTERM stopping the workers with the compilers they run."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvarn_cutlass import cli
from kvarn_cutlass.cli import main
from kvarn_cutlass.cli.progress import Progress

REPO = Path(__file__).resolve().parents[1]
SELFTEST = ["build", "--arch", "sm80", "--family", "selftest"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_jobs_default_to_the_cores_this_process_may_use():
    parser = cli._build_parser()
    assert parser.parse_args(["build"]).jobs == len(os.sched_getaffinity(0))


def test_progress_lines_say_compiled_then_cached(capsys, cache):
    argv = [*SELFTEST, "--arch", "sm90"]
    assert main(argv) == 0
    first = capsys.readouterr()
    lines = [ln for ln in first.err.splitlines() if ln.startswith("build [")]
    assert len(lines) == 2 and {ln.split("]")[0] for ln in lines} == {"build [1/2", "build [2/2"}, first.err
    assert all("selftest sm" in ln and ": compiled in " in ln for ln in lines), lines
    assert main(argv) == 0
    second = capsys.readouterr()
    lines = [ln for ln in second.err.splitlines() if ln.startswith("build [")]
    assert len(lines) == 2 and all(ln.endswith(": from the kernel cache") for ln in lines), lines
    assert main([*argv, "--no-progress"]) == 0
    assert "build [" not in capsys.readouterr().err


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_summary_agrees_with_the_json_and_the_table_needs_verbose(capsys, cache, jobs):
    argv = [*SELFTEST, "--arch", "sm90", "--jobs", jobs, "--no-progress"]
    assert main([*argv, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["kernels"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    kernels = {r["kernel"] for r in records}
    modules = {(r["module"], r["arch"]) for r in records}
    most = max(records, key=lambda r: r["registers"])
    assert summary.startswith(f"kvarn-cutlass build: {len(modules)} modules ({len(records)} kernels) for sm_80, sm_90 ")
    assert f"0 compiled, {len(modules)} from the kernel cache, 0 failed" in summary  # the --json run built them
    assert f"most registers: {most['registers']} ({most['kernel']}" in summary
    assert "regs" not in summary and len(summary.splitlines()) <= 5  # no table
    assert main([*argv, "--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert all(k in verbose for k in kernels) and "regs" in verbose
    untimed = lambda text: re.sub(r" in \d+\.\d s:", " in T s:", text)  # noqa: E731 - the build's wall time
    assert untimed(verbose).endswith(untimed(summary))  # the table, then the same summary


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_bar_and_off_it_a_line_per_note():
    tty = _Terminal()
    with Progress(3, "build", unit="module", stream=tty) as p:
        assert p.bar is not None
        for i in range(3):
            p.step(note=f"m{i}: compiled in 0.1 s")
        assert p.bar.n == 3 and p.bar.postfix == "m2: compiled in 0.1 s"
    assert tty.getvalue().startswith("\rbuild:") and "build [" not in tty.getvalue()
    log = io.StringIO()
    with Progress(3, "generate", stream=log) as p:
        p.step()
        p.step(note="prompt 1/2 done")
        p.step(n=1)
    assert log.getvalue() == "generate [2/3] prompt 1/2 done\n"


_TERM_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    from kvarn_cutlass.cli import build, main

    def slow_task(task):  # a module build that runs a compiler which runs another process
        proc = subprocess.Popen(["sh", "-c", "sleep 300 & echo $! > " + sys.argv[1] + "/grandchild.$$; wait"])
        with open(os.path.join(sys.argv[1], f"worker.{os.getpid()}"), "w") as f:
            f.write(str(proc.pid))
        proc.wait()

    build._build_task = slow_task
    sys.exit(main(["build", "--arch", "sm80", "--arch", "sm90", "--family", "selftest", "--jobs", "2"]))
""")


def test_sigterm_stops_the_workers_and_the_compilers_they_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "KVARN_CUTLASS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", _TERM_SCRIPT, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(list(tmp_path.glob("grandchild.*"))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)  # the shells write the pid file before their sleep is running
    workers = [int(p.name.split(".")[1]) for p in tmp_path.glob("worker.*")]
    spawned = [int(p.read_text()) for p in tmp_path.glob("worker.*")] + [int(p.read_text())
                                                                         for p in tmp_path.glob("grandchild.*")]
    try:
        assert len(workers) == 2 and len(spawned) == 4, list(tmp_path.iterdir())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "kvarn-cutlass build: terminated (SIGTERM)", err

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 10
    while any(alive(p) for p in workers + spawned) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers + spawned if alive(p)]
