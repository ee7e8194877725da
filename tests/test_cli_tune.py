"""``kvarn-cutlass tune``: bad buckets fail at parse time with one line naming them, a missing GPU is one
line before anything is built, and the flags reach the tuner (``ops.prefill_tune.run_tune``, replaced
here: this machine cannot time a kernel)."""

from __future__ import annotations

import pytest

from kvarn_cutlass.cli import main
from kvarn_cutlass.cli import tune
from kvarn_cutlass.ops import prefill_tune


def one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("bucket,fragment", [
    ("M4096_T128_D128_f16", "is not a prefill bucket"),  # a key of the removed CUTLASS GEMM table
    ("D96_T128_V2", "head_dim=96"),
    ("D128_T32_V2", "no preset has that tile size"),
    ("D128_T128_V2_xx", "is not a prefill bucket"),
])
def test_bad_bucket_is_a_usage_error_naming_it(bucket, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--buckets", bucket, "--dry-run"])
    assert exc.value.code == 2
    line = one_error_line(capsys)
    assert "--buckets" in line and bucket in line and fragment in line, line


@pytest.fixture
def tuner_calls(monkeypatch) -> list:
    """run_tune replaced by a recorder; returns the list of its calls."""
    calls: list = []

    def fake_run_tune(buckets, context=16384, chunk=512, reps=10, output=None):
        calls.append({"buckets": list(buckets), "context": context, "chunk": chunk, "reps": reps, "output": output})
        return 0

    monkeypatch.setattr(prefill_tune, "run_tune", fake_run_tune)
    return calls


def test_no_gpu_is_one_line_and_nothing_runs(monkeypatch, capsys, tuner_calls):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--buckets", "D128_T128_V2"]) == 1
    line = one_error_line(capsys)
    assert "no CUDA device" in line and "--dry-run" in line
    assert tuner_calls == []


def test_flags_reach_the_tuner(monkeypatch, tmp_path, tuner_calls):
    monkeypatch.setattr(tune, "require_gpu", lambda: "fake GPU")
    out = tmp_path / "prefill_sm90.json"
    assert main(["tune", "--buckets", "D64_T128_V2", "D128_T128_V2_lm", "--runs", "3", "--context", "4096",
                 "--chunk", "256", "--output", str(out)]) == 0
    assert tuner_calls == [{"buckets": ["D64_T128_V2", "D128_T128_V2_lm"], "context": 4096, "chunk": 256, "reps": 3,
                            "output": str(out)}]
    tuner_calls.clear()
    assert main(["tune"]) == 0  # the defaults: every default bucket, the tuner's own shape
    assert tuner_calls == [{"buckets": list(prefill_tune.DEFAULT_BUCKETS), "context": 16384, "chunk": 512, "reps": 10,
                            "output": None}]


def test_a_failing_bucket_is_the_exit_status(monkeypatch, tuner_calls):
    monkeypatch.setattr(tune, "require_gpu", lambda: "fake GPU")
    monkeypatch.setattr(prefill_tune, "run_tune", lambda *a, **k: 1)
    assert main(["tune", "--buckets", "D128_T128_V2"]) == 1
