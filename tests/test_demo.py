"""``kvarn-cutlass demo``: its generator, its accuracy and memory figures against independent
computations, its CUTLASS compile child (budget, cleanup, cached vs compiled), and the GPU path."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvarn_cutlass.cli import main
from kvarn_cutlass.cli import demo
from kvarn_cutlass.format import PRESETS, TileSpec

from _helpers import SHARED

MODEL = SHARED / "models" / "kvarn-ref-lm"
REPO = Path(__file__).resolve().parents[1]


def run_json(capsys, *argv: str) -> dict:
    assert main(["demo", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- inputs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_rope_scores_depend_only_on_relative_position(seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 1, 1, 64, generator=g), torch.randn(1, 1, 1, 64, generator=g)
    at = lambda x, p: demo.rope(x, torch.tensor([p]))  # noqa: E731
    s1 = float((at(q, 9) * at(k, 4)).sum())
    s2 = float((at(q, 1005) * at(k, 1000)).sum())
    assert s1 == pytest.approx(s2, rel=1e-4, abs=1e-4), f"seed={seed}"
    assert float(at(q, 77).norm()) == pytest.approx(float(q.norm()), rel=1e-5), f"seed={seed}"  # rotations keep norms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generator_attention_is_local_and_peaked_like_a_trained_model(seed):
    """The docstring's claims at n = 2048: most attention on the newest 256 tokens, top key ~0.3,
    |q|, |k| ~ 12-15 (kvarn-ref-lm layers 1-5: 0.79-0.89, 0.24-0.34, 12-14)."""
    n = 2048
    q, k, v = demo.realistic_qkv(8, 2, n, 128, torch.Generator().manual_seed(seed))
    assert q.shape == (1, 8, n, 128) and k.shape == v.shape == (1, 2, n, 128) and q.dtype == torch.float32
    _, p = demo.exact_attention(q[:, :, -16:], k, v, 128**-0.5)
    window_share = float(p[..., -256:].sum(-1).mean())
    top = float(p.max(-1).values.mean())
    assert 0.6 < window_share < 0.95, window_share
    assert 0.1 < top < 0.6, top
    assert 8 < float(k.norm(dim=-1).mean()) < 20 and 8 < float(q.norm(dim=-1).mean()) < 20
    # keys have outlier channels: the largest per-channel spread is several times the median one
    spread = k.std(dim=2).mean(dim=(0, 1))
    assert float(spread.max() / spread.median()) > 2.5


def test_exact_attention_matches_sdpa_in_float64():
    seed = 21
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 8, 5, 32, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 40, 32, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 40, 32, generator=g, dtype=torch.float64)
    out, p = demo.exact_attention(q, k, v, 0.3)
    allowed = torch.arange(40)[None, :] <= torch.arange(35, 40)[:, None]  # query i at position 35 + i
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), f"seed={seed}"
    assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1))), f"seed={seed}"
    assert float(p[..., 0, 36:].abs().max()) == 0.0  # the first query sees nothing after position 35


# --- the CPU pipeline ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,tokens,chunk,window", [("k4v2_g128", 700, 256, 128), ("k4v4_g64", 530, 100, 192)])
def test_cpu_demo_figures(capsys, preset, tokens, chunk, window):
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--preset", preset, "--tokens", str(tokens),
                 "--chunk", str(chunk), "--window", str(window))
    assert r["device"] == "cpu" and r["tokens"] == tokens and r["shape"]["layers"] == 1
    Hkv, D = r["shape"]["kv_heads"], r["shape"]["head_dim"]
    # memory from the cache's documented layout: ceil((n - W) / T) tiles, the rest in the fp16 window
    T = PRESETS[preset][2]
    tiles = max(0, math.ceil((tokens - window) / T))
    want = tiles * Hkv * TileSpec(preset, D).tile_nbytes + (tokens - tiles * T) * Hkv * D * 2 * 2
    assert r["memory"]["kvarn_bytes"] == want
    assert r["memory"]["fp16_bytes"] == 2 * Hkv * tokens * D * 2
    pf, dc = r["accuracy"]["prefill_last_chunk"], r["accuracy"]["decode"]
    # the CPU prefill pipeline (int8 K scores) reproduces the float64 reference over the same cache
    assert pf["vs_reference_max"] < 5e-3
    # quantization error: present (tiles exist and get attention) but bounded
    assert 0 < pf["quantized_attention_share"] < 1 and 0 < dc["quantized_attention_share"] < 1
    assert 1e-4 < dc["vs_exact_max"] < 0.2 and 1e-4 < pf["vs_exact_max"] < 0.6
    # triangle inequality between the three errors of the prefill chunk
    assert abs(pf["vs_exact_max"] - pf["reference_vs_exact_max"]) <= pf["vs_reference_max"] + 1e-12
    assert dc["vs_reference_max"] is None  # the CPU decode is the reference itself: nothing to compare
    assert r["cutlass_gemm_sm90"]["status"] == "skipped (--no-compile)"


def test_cpu_demo_text_report(capsys):
    assert main(["demo", "--device", "cpu", "--no-compile", "--tokens", "400", "--chunk", "256", "--window", "128"]) == 0
    out = capsys.readouterr().out
    for needle in ("quantization error", "float64 reference", "memory:", "fp16", "not run: no CUDA device",
                   "CUTLASS K-score GEMM for sm_90: skipped", "the chunk's first 128 queries"):
        assert needle in out, needle


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="shared reference model not present")
def test_cpu_demo_with_a_model_uses_every_layer(capsys):
    pytest.importorskip("transformers")
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--model", str(MODEL), "--tokens", "300",
                 "--chunk", "128", "--window", "128")
    assert r["shape"] == {"layers": 6, "batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 128}
    assert "package" in r["source"]["text"]
    for phase in ("prefill_last_chunk", "decode"):
        per_layer = r["accuracy"][phase]["per_layer"]
        assert len(per_layer) == 6
        assert r["accuracy"][phase]["vs_exact_max"] == max(x["vs_exact"] for x in per_layer)
    assert r["accuracy"]["prefill_last_chunk"]["vs_reference_max"] < 5e-3
    assert r["memory"]["fp16_bytes"] == 6 * 2 * 2 * 300 * 128 * 2


@pytest.mark.parametrize("argv,fragment", [
    (["--window", "100"], "--window"),
    (["--tokens", "4", "--decode-steps", "4"], "--tokens"),
    (["--text", __file__], "--text needs --model"),
])
def test_bad_combinations_fail_with_one_line(capsys, argv, fragment):
    assert main(["demo", "--device", "cpu", "--no-compile", *argv]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


# --- the compile child ------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a container's init may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


_SLEEPER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            " time.sleep(120)")


def test_compile_child_past_the_deadline_is_left_running_in_its_own_group(monkeypatch):
    """A compile past the budget is detached, not killed: it goes on (with the compilers it started) in a
    process group of its own, so that it outlives the demo; stop() still ends the whole group."""
    monkeypatch.setattr(demo, "_CHILD", _SLEEPER)
    cfg = demo.demo_gemm_config(512, 4)
    job = demo.GemmCompile(cfg)
    try:
        ticks = []
        res = job.finish(time.perf_counter() + 1.5, lambda elapsed, state: ticks.append((elapsed, state)))
        assert res["status"] == "background" and res["config"] == cfg.name and res["pid"] == job.proc.pid
        assert res["state"] == "starting"  # this child never reports an event
        assert ticks and all(t >= 0 and state == "starting" for t, state in ticks)
        assert os.getpgid(job.proc.pid) == job.proc.pid != os.getpgid(0)
        time.sleep(0.5)
        assert job.proc.poll() is None and os.path.isfile(res["log"])
    finally:
        job.stop()
    assert _wait_until(lambda: not _group_alive(job.proc.pid), 10)
    assert not os.path.exists(job.log_path)


def test_compile_child_state_follows_its_events(monkeypatch):
    monkeypatch.setattr(demo, "_CHILD", "import json, time; print(json.dumps({'event': 'started'}), flush=True); "
                                        "time.sleep(1.5); print(json.dumps({'event': 'compiling'}), flush=True); "
                                        "time.sleep(120)")
    job = demo.GemmCompile(demo.demo_gemm_config(512, 4))
    try:
        assert _wait_until(lambda: job.state() == "waiting", 30)  # started, no compile yet: the cache lock
        assert _wait_until(lambda: job.state() == "compiling", 30)
    finally:
        job.stop()


def test_compile_child_failure_is_reported_with_its_last_line(monkeypatch):
    monkeypatch.setattr(demo, "_CHILD", "import sys; print('noise', file=sys.stderr); sys.exit('nvcc exploded')")
    job = demo.GemmCompile(demo.demo_gemm_config(512, 4))
    res = job.finish(None, lambda elapsed, state: None)
    assert res["status"] == "failed" and res["error"] == "nvcc exploded"
    assert not os.path.exists(job.log_path)  # read into the report, then removed


def test_compile_child_output_files_are_closed_on_every_path(monkeypatch):
    """finish() of a child that succeeded, and stop() of a child that already exited by itself, close
    the child's output file and remove its log; close() and stop() are idempotent."""
    monkeypatch.setattr(demo, "_CHILD", "import json; print(json.dumps({'status': 'compiled'}))")
    cfg = demo.demo_gemm_config(512, 4)
    finished = demo.GemmCompile(cfg)
    assert finished.finish(None, lambda elapsed, state: None)["status"] == "compiled"
    assert finished.out.closed and not os.path.exists(finished.log_path)
    exited = demo.GemmCompile(cfg)
    exited.proc.wait(timeout=60)
    exited.stop()
    assert exited.out.closed and not os.path.exists(exited.log_path)
    exited.stop()
    exited.close()
    assert exited.proc.returncode == 0


def test_compile_child_reports_compiled_then_cached(monkeypatch, tmp_path, capsys):
    """In-process run of the child body with nvcc replaced: the first build announces and runs the
    compiler once, the second is served by the disk cache (GemmBinary.cached) without announcing it."""
    pytest.importorskip("cutlass_library")
    from kvarn_cutlass.gemm import compile as gemm_compile

    try:
        gemm_compile.nvcc_version()
    except (FileNotFoundError, OSError):
        pytest.skip("no nvcc (its version is part of the cache key)")
    calls = []

    def fake_compile(src, entry, arch, flags):
        calls.append(entry)
        return b"\x7fELF-not-a-real-cubin", b"\x7fELF-not-a-real-so", "ptxas info: fake", 0.25

    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm_compile, "_compile", fake_compile)
    config = demo.demo_gemm_config(512, 4)
    assert not gemm_compile.gemm_cache_path(config).is_file()
    cfg_json = json.dumps(config.to_dict())
    runs = []
    for _ in range(2):
        demo._compile_child(cfg_json)
        lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
        runs.append(([ln["event"] for ln in lines[:-1]], lines[-1]))
    (events1, first), (events2, second) = runs
    assert events1 == ["started", "compiling"] and events2 == ["started"]
    assert (first["status"], second["status"]) == ("compiled", "cached")
    assert len(calls) == 1
    assert first["nvcc_seconds"] == second["nvcc_seconds"] == 0.25
    assert first["cubin_bytes"] == len(b"\x7fELF-not-a-real-cubin")
    assert isinstance(first["sass"], (str, dict))
    assert gemm_compile.gemm_cache_path(config).is_file()  # where the demo's start line looks


# --- the whole demo with a stand-in nvcc ----------------------------------------------------------------------
# Stands in for nvcc (found through CUDA_HOME): reports a version of its own (a cache key of its own),
# records its own pid, its parent's (the demo's compile child) and, in "hang" mode, a grandchild's (as
# nvcc starts cicc and ptxas); "ok" and "fail" wait for the test's go file, then write a cubin and a
# host library where the real one would, or fail with a message.
_FAKE_NVCC = r"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 99.0, V99.0.0"; exit 0; fi
echo $PPID > "$FAKE_NVCC_DIR/child.pid"
echo $$ > "$FAKE_NVCC_DIR/nvcc.pid"
if [ "$FAKE_NVCC_MODE" = hang ]; then
    sleep 300 &
    echo $! > "$FAKE_NVCC_DIR/cicc.pid"
    wait
    exit 1
fi
while [ ! -e "$FAKE_NVCC_DIR/go" ]; do sleep 0.1; done
if [ "$FAKE_NVCC_MODE" = fail ]; then echo "fake nvcc: error: out of memory" >&2; exit 3; fi
prev=""
for a in "$@"; do
    case "$a" in -keep-dir=*) keep="${a#-keep-dir=}";; esac
    if [ "$prev" = "-o" ]; then out="$a"; fi
    prev="$a"
done
printf 'not a real cubin' > "$keep/kscore.sm_90a.cubin"
printf 'not a real library' > "$out"
"""
DEMO_ARGV = ["demo", "--device", "cpu", "--tokens", "300", "--chunk", "128", "--window", "128"]


def _fake_nvcc_env(tmp_path, mode: str) -> dict:
    pytest.importorskip("cutlass_library")  # the nvcc flags name its include directories
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(_FAKE_NVCC)
    nvcc.chmod(0o755)
    for d in ("pids", "cache", "tmp"):
        (tmp_path / d).mkdir()
    env = {**os.environ, "CUDA_HOME": str(cuda), "FAKE_NVCC_DIR": str(tmp_path / "pids"), "FAKE_NVCC_MODE": mode,
           "KVARN_CUTLASS_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _pid(tmp_path, name: str) -> int:
    return int((tmp_path / "pids" / f"{name}.pid").read_text())


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _leftovers(tmp_path) -> list:
    """Files the demo and its child must not leave: logs, nvcc's temporary directories, cache temp files."""
    return ([p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(("kvarn-demo-", "kvarn_gemm_"))]
            + [p.name for p in (tmp_path / "cache").rglob("*.tmp")])


def test_sigterm_stops_the_compile_like_interrupt_with_no_lock_held(tmp_path):
    """SIGTERM (timeout, a CI runner) during the wait for the compile: exit status 143 and one line, the
    compile child, the stand-in nvcc and its own child gone, every lock of the kernel cache free, no
    cache entry, no temporary files."""
    import fcntl

    env = _fake_nvcc_env(tmp_path, "hang")
    proc = subprocess.Popen([sys.executable, "-m", "kvarn_cutlass.cli", *DEMO_ARGV, "--budget", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_until(lambda: (tmp_path / "pids" / "cicc.pid").is_file(), 120), "the stand-in nvcc never ran"
        pids = {name: _pid(tmp_path, name) for name in ("child", "nvcc", "cicc")}
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        if (tmp_path / "pids" / "child.pid").is_file():
            _kill_group(_pid(tmp_path, "child"))
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "kvarn-cutlass demo: terminated (SIGTERM)", err
    assert "compiling the CUTLASS K-score GEMM" in err and out == ""
    for name, pid in pids.items():
        assert _wait_until(lambda: not _alive(pid), 10), f"{name} ({pid}) survived SIGTERM"
    for lock in (tmp_path / "cache").rglob("*.lock"):
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while anyone holds it
    assert not list((tmp_path / "cache").rglob("*.bin"))
    assert _leftovers(tmp_path) == []


def _demo_json(env, *extra: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "kvarn_cutlass.cli", *DEMO_ARGV, *extra, "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_compile_past_the_budget_finishes_in_the_background_and_the_next_demo_reads_it(tmp_path):
    env = _fake_nvcc_env(tmp_path, "ok")
    first, err = _demo_json(env, "--budget", "1")  # the stand-in waits for the go file: never done by then
    gemm = first["cutlass_gemm_sm90"]
    try:
        assert "compiling the CUTLASS K-score GEMM" in err and "goes on in the background" in err
        assert gemm["status"] == "background" and gemm["state"] in ("starting", "waiting", "compiling"), gemm
        assert _alive(gemm["pid"]) and os.getpgid(gemm["pid"]) == gemm["pid"]  # outlived the demo, own group
        (tmp_path / "pids" / "go").touch()
        assert _wait_until(lambda: not _alive(gemm["pid"]), 120)
    finally:
        _kill_group(gemm["pid"])
    assert len(list((tmp_path / "cache").rglob("*.bin"))) == 1  # the build reached the kernel cache
    assert not os.path.exists(gemm["log"]) and _leftovers(tmp_path) == []
    (tmp_path / "pids" / "nvcc.pid").unlink()
    second, err = _demo_json(env, "--budget", "0")
    assert "in the kernel cache" in err and "compiling" not in err
    assert second["cutlass_gemm_sm90"]["status"] == "cached", second["cutlass_gemm_sm90"]
    assert not (tmp_path / "pids" / "nvcc.pid").exists()  # nvcc did not run again
    assert _leftovers(tmp_path) == []


def test_background_compile_failure_is_left_in_its_log(tmp_path):
    env = _fake_nvcc_env(tmp_path, "fail")
    doc, _ = _demo_json(env, "--budget", "1")
    gemm = doc["cutlass_gemm_sm90"]
    try:
        assert gemm["status"] == "background"
        (tmp_path / "pids" / "go").touch()
        assert _wait_until(lambda: not _alive(gemm["pid"]), 120)
    finally:
        _kill_group(gemm["pid"])
    assert "fake nvcc: error: out of memory" in open(gemm["log"]).read()
    assert not list((tmp_path / "cache").rglob("*.bin"))


def test_report_says_what_the_background_compile_was_doing(capsys):
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--tokens", "300", "--chunk", "128", "--window", "128")
    args = argparse.Namespace(budget=50.0)
    for state, words in (("compiling", "still compiling after 51.2 s"),
                         ("waiting", "waiting for another build of the same kernel")):
        r["cutlass_gemm_sm90"] = {"status": "background", "state": state, "config": "cfg", "pid": 4242,
                                  "log": "/tmp/x.log", "seconds": 51.2}
        demo._report(r, args)
        out = capsys.readouterr().out
        assert words in out and "left running in the background (pid 4242)" in out and "/tmp/x.log" in out


def test_demo_config_is_what_prefill_selects():
    from kvarn_cutlass.gemm.configs import select_config
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = select_config(90, M=2048, N=128, head_dim=128, L=1, out_dtype="f16")
    assert demo.demo_gemm_config(512, 4) == want


# --- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_demo_json(capsys):
    r = run_json(capsys, "--device", "cuda", "--tokens", "4096", "--chunk", "512")
    assert r["device"] == "cuda" and r["shape"]["q_heads"] == 32 and r["shape"]["kv_heads"] == 8
    pf, dc = r["accuracy"]["prefill_last_chunk"], r["accuracy"]["decode"]
    assert pf["vs_reference_max"] < 5e-3, pf  # the prefill kernels vs float64 over the same cache
    assert dc["vs_reference_max"] < 2e-3, dc  # the graph-replayed decode kernels
    assert dc["vs_exact_max"] < 0.2 and pf["vs_exact_max"] < 0.6
    d, p = r["speed"]["decode"], r["speed"]["prefill"]
    for key in ("kvarn_graph_us", "kvarn_eager_us", "sdpa_fp16_us", "sdpa_over_kvarn_graph"):
        assert d[key] > 0, key
    # SDPA replayed from a CUDA graph beside the eager call, or the reason it could not be captured
    assert d.get("sdpa_fp16_graph_us", 0) > 0 or "sdpa_fp16_graph_error" in d, d
    for key in ("kvarn_prompt_ms", "sdpa_flash_fp16_ms", "kvarn_over_sdpa"):
        assert p[key] > 0, key
    assert p["chunks"] == 8
    assert r["memory"]["fp16_bytes"] == 2 * 8 * 4096 * 128 * 2 and r["memory"]["fp16_over_kvarn"] > 3


@pytest.mark.gpu
@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="shared reference model not present")
def test_gpu_demo_with_a_model(capsys):
    pytest.importorskip("transformers")
    r = run_json(capsys, "--device", "cuda", "--model", str(MODEL), "--tokens", "2048")
    assert r["shape"]["layers"] == 6
    assert r["accuracy"]["decode"]["vs_reference_max"] < 2e-3
    assert r["accuracy"]["prefill_last_chunk"]["vs_reference_max"] < 5e-3
    assert r["speed"]["decode"]["kvarn_graph_us"] > 0


def test_gpu_report_formats_every_gpu_field(capsys):
    """The text report's CUDA branch, fed a CPU result with the fields the CUDA path adds (it cannot
    run here); the GPU test above runs the real thing."""
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--tokens", "300", "--chunk", "128", "--window", "128")
    r.update(device="cuda", gpu="NVIDIA H200", gpu_kernels="...")
    r["accuracy"]["decode"]["vs_reference_max"] = 3.5e-4
    r["speed"] = {"decode": {"kvarn_graph_us": 21.5, "kvarn_eager_us": 40.25, "sdpa_fp16_us": 53.75,
                             "sdpa_over_kvarn_graph": 2.5, "sdpa_fp16_graph_us": 12.25,
                             "sdpa_graph_over_kvarn_graph": 0.57, "rotated_sets": 3},
                  "prefill": {"kvarn_prompt_ms": 310.5, "sdpa_flash_fp16_ms": 31.25,
                              "kvarn_over_sdpa": 9.94, "chunks": 3}}
    demo._report(r, None)
    out = capsys.readouterr().out
    assert "demo on NVIDIA H200" in out and "GPU kernels vs the float64 reference" in out and "3.5e-04" in out
    for needle in ("21.5 us (CUDA graph; eager 40.25 us) vs SDPA fp16 eager 53.75 us (2.5x); CUDA graph 12.25 us (0.57x)",
                   "(attention and append): 310.5 ms vs SDPA flash fp16 31.25 ms (9.94x the SDPA time)"):
        assert needle in out, out
