"""``kvarn-cutlass tune`` and ``emit``: bad buckets, patterns and architectures fail at once with one
line; tune checks the GPU before compiling and changes the config table only with successful
measurements (the GPU check, the compile pool and the timing are replaced where this machine cannot
run them)."""

from __future__ import annotations

import json
import random

import pytest

from kvarn_cutlass.cli import main
from kvarn_cutlass.gemm import tune
from kvarn_cutlass.gemm.configs import untuned_table


def one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv,fragments", [
    (["tune", "--buckets", "NOPE"], ["--buckets", "'NOPE'", "M4096_T128_D128_f16"]),
    (["tune", "--buckets", "M4096_T128_D96_f16"], ["--buckets", "head_dim 96 is not supported"]),
    (["tune", "--buckets", "M4000_T128_D128_f16"], ["--buckets", "M4000 is not a bucket", "M4096"]),
    (["tune", "--buckets", "M4096_T128_D128"], ["--buckets", "lacks the output dtype"]),
    (["tune", "--filter", "("], ["--filter", "not a regular expression"]),
    (["emit", "--bucket", "M4096_T128_D96_f16"], ["--bucket", "head_dim 96 is not supported"]),
    (["emit", "--bucket", "M4096_T32_D128"], ["--bucket", "tiles of 32 tokens"]),
    (["sass", "--bucket", "M4096_T128_D128_bf16"], ["--bucket", "'bf16' is not supported"]),
])
def test_bad_bucket_or_pattern_is_a_usage_error_naming_it(argv, fragments, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    line = one_error_line(capsys)
    assert "error: error" not in line
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.parametrize("command", ["emit", "sass"])
def test_an_architecture_without_the_gemm_is_refused(command, capsys):
    assert main([command, "--arch", "sm80"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # not the sm_90 source under another name
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(err) == 1 and "only --arch sm90" in err[0], err


def test_emit_takes_any_row_count_of_a_supported_shape(capsys):
    assert main(["emit", "--bucket", "M20_T64_D64"]) == 0  # M is rounded to its bucket; f16 by default
    assert "cutlass" in capsys.readouterr().out


# --- tune's run ------------------------------------------------------------------------------------------
@pytest.fixture
def table_file(tmp_path):
    path = tmp_path / "sm90.json"
    path.write_text(json.dumps(untuned_table(90), indent=1, sort_keys=True) + "\n")
    return path


def _tune(table_file, tmp_path, *buckets: str, extra=()) -> int:
    return main(["tune", "--buckets", *buckets, "--output", str(table_file), "--state", str(tmp_path / "state.jsonl"),
                 "--filter", "_c1x1_", *extra])


def test_no_gpu_is_one_line_before_any_compile(monkeypatch, capsys, tmp_path, table_file):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    compiled = []
    monkeypatch.setattr(tune, "compile_all", lambda configs, jobs: compiled.append(configs) or {})
    before = table_file.read_bytes()
    assert _tune(table_file, tmp_path, "M4096_T128_D128_f16") == 1
    line = one_error_line(capsys)
    assert "no CUDA device" in line and "--dry-run" in line
    assert compiled == [] and table_file.read_bytes() == before and not (tmp_path / "state.jsonl").exists()


@pytest.fixture
def fake_gpu(monkeypatch):
    """tune with the GPU check, the nvcc pool and the provenance replaced; returns the list of
    (bucket, config name) measured."""
    monkeypatch.setattr(tune, "require_sm90_gpu", lambda: "fake sm_90 GPU")
    monkeypatch.setattr(tune, "compile_all", lambda configs, jobs: {})
    monkeypatch.setattr(tune, "_provenance", lambda: {"gpu": "fake sm_90 GPU", "tool": "test"})
    measured: list[tuple[str, str]] = []
    return measured


def test_failed_measurements_never_reach_the_table(monkeypatch, capsys, tmp_path, table_file, fake_gpu):
    def broken(cfg, bucket, runs):
        fake_gpu.append((bucket, cfg.name))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tune, "_measure", broken)
    before = table_file.read_bytes()
    assert _tune(table_file, tmp_path, "M4096_T128_D128_f16", "M128_T64_D64_f32") == 1
    assert fake_gpu, "nothing was measured"
    assert table_file.read_bytes() == before
    err = capsys.readouterr().err
    assert "is unchanged" in err and f"{len(fake_gpu)} measurement(s) failed" in err
    state = tmp_path / "state.jsonl"
    assert not state.exists() or state.read_text() == ""  # failures are retried next time, not recorded


@pytest.mark.parametrize("seed", [random.randrange(2**31)])
def test_only_measured_buckets_change_and_take_the_fastest_config(monkeypatch, capsys, tmp_path, table_file, fake_gpu,
                                                                  seed):
    rng = random.Random(seed)
    good, bad = "M4096_T128_D128_f16", "M128_T64_D64_f32"
    tops: dict[str, float] = {}

    def measure(cfg, bucket, runs):
        fake_gpu.append((bucket, cfg.name))
        if bucket == bad:
            raise RuntimeError("launch failed")
        tops[cfg.name] = rng.uniform(1, 500)
        return {"time_us": 1e3 / tops[cfg.name], "tops": tops[cfg.name], "timing": {}}

    monkeypatch.setattr(tune, "_measure", measure)
    before = json.loads(table_file.read_text())
    assert _tune(table_file, tmp_path, good, bad) == 0, f"seed {seed}"
    after = json.loads(table_file.read_text())
    best = max(tops, key=tops.get)
    entry = after["buckets"][good]
    assert tune.GemmConfig.from_dict(entry["config"]).name == best, f"seed {seed}"
    assert entry["status"] == "tuned" and entry["tops"] == round(tops[best], 2) and entry["candidates"] == len(tops)
    assert entry["filter"] == "_c1x1_" and entry["provenance"]["gpu"] == "fake sm_90 GPU"
    assert after["buckets"][bad] == before["buckets"][bad]
    del after["buckets"][good], before["buckets"][good]
    assert after == before  # nothing else moved
    # the state holds the successful measurements only; a rerun measures only the failed bucket again
    lines = [json.loads(ln) for ln in (tmp_path / "state.jsonl").read_text().splitlines()]
    assert {r["config_name"] for r in lines} == set(tops) and all(r["bucket"] == good for r in lines)
    fake_gpu.clear()
    assert _tune(table_file, tmp_path, good, bad) == 0
    assert fake_gpu and {b for b, _ in fake_gpu} == {bad}
