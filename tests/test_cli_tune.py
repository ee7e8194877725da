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


@pytest.mark.parametrize("context", [0, 200, 1000])
def test_call_bytes_are_the_operands_one_call_touches(context):
    # what the rotation is sized from: the layer's live records, sink and window tokens, and the chunk's q, k, v
    # and output, counted from the cache's own buffers
    import torch

    import kvarn_cutlass as kc
    from kvarn_cutlass.ops.prefill_tune import HKV, HQ, call_bytes

    spec = prefill_tune.parse_bucket("D64_T128_V2")
    cache = kc.KVarNCache(1, 1, HKV, 64, preset=spec.preset, window=256, sink_tokens=128,
                          max_seq_len=context + 64)
    if context:
        g = torch.Generator().manual_seed(context)
        k = torch.randn(1, HKV, context, 64, generator=g, dtype=torch.float16)
        cache.append(0, k, torch.randn(1, HKV, context, 64, generator=g, dtype=torch.float16))
    st = cache._layer(0)
    live = (st.tiles[:, : st.n_tiles].nbytes + 2 * st.window_k[:, :, : st.window_len].nbytes
            + 2 * st.sink_k[:, :, : st.sink_len].nbytes)
    chunk = 64
    q_out = 2 * torch.empty(1, HQ, chunk, 64, dtype=torch.float16).nbytes
    kv = 2 * torch.empty(1, HKV, chunk, 64, dtype=torch.float16).nbytes
    assert call_bytes(spec, cache, chunk) == live + q_out + kv
    assert (st.n_tiles > 0) == (context >= 128 + 256 + 128)
