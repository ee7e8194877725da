"""CPU tests of tools/decode_timing_check.py: its two timings of one graph, with the timers replaced by fakes
whose numbers are known, so the per-call arithmetic and the replays each method makes are checked."""

from __future__ import annotations

from kvarn_cutlass.bench.timing import Timing

from _helpers import load_tool


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_both_methods_time_the_same_work_per_call(monkeypatch):
    tool = load_tool("decode_timing_check")
    g, calls = _Graph(), 4
    per_replay_calls = []

    def fake_time_cuda(fn, inputs=None, *, warmup=10, runs=100, graph=False):
        assert inputs is None and not graph and warmup == 5 and runs == tool.PER_REPLAY_RUNS
        before = g.replays
        fn()
        per_replay_calls.append(g.replays - before)  # one replay between each event pair
        return Timing(median_us=400.0, min_us=380.0, p10_us=390.0, p90_us=440.0, runs=runs, calls_per_run=1,
                      graph=False)

    samples = iter([1.0 + 0.1 * k for k in range(tool.SAMPLES)])  # ms of one sample (20 replays)

    def fake_elapsed_ms(fn, repeats=1):
        before = g.replays
        for _ in range(repeats):
            fn()
        assert g.replays - before == tool.REPLAYS_PER_SAMPLE
        return next(samples)

    monkeypatch.setattr(tool, "time_cuda", fake_time_cuda)
    monkeypatch.setattr(tool, "elapsed_ms", fake_elapsed_ms)
    row = tool._methods(g.replay, calls)
    assert per_replay_calls == [1]
    assert (row["per_replay_us"], row["per_replay_p10_us"], row["per_replay_p90_us"]) == (100.0, 97.5, 110.0)
    per_sample = [(1.0 + 0.1 * k) * 1000.0 / (tool.REPLAYS_PER_SAMPLE * calls) for k in range(tool.SAMPLES)]
    assert row["back_to_back_min_us"] == round(per_sample[0], 2)
    assert row["back_to_back_max_us"] == round(per_sample[-1], 2)
    mid = sorted(per_sample)
    assert row["back_to_back_us"] == round((mid[len(mid) // 2 - 1] + mid[len(mid) // 2]) / 2, 2)
