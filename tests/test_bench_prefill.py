"""``kvarn_cutlass.bench.prefill``'s timing on the CPU: the methods of a point take turns (the GPU part of the
section runs on a GPU only; its record is checked by tests/test_bench_report.py)."""

from __future__ import annotations

import pytest

from kvarn_cutlass.bench.prefill import _interleaved


def _method(name, log, times):
    it = iter(times)

    def fn():
        log.append(name)
        return next(it)

    return fn


def test_methods_take_turns_after_one_warm_up_each_and_report_medians():
    log = []
    times, errors, spreads = _interleaved({
        "a": _method("a", log, [99.0, 3.0, 1.0, 2.0, 8.0]),  # the warm-up's 99 is not a sample
        "b": _method("b", log, [50.0, 10.0, 30.0, 20.0, 40.0]),
        "c": _method("c", log, [7.0, 6.0, 5.0, 4.0, 3.0]),
        "d": _method("d", log, [0.5, 1.5, 1.5, 2.5, 2.5]),
    }, reps=4)
    assert log[:4] == ["a", "b", "c", "d"]  # the warm-ups, in the given order
    rounds = [log[4 + 4 * r: 8 + 4 * r] for r in range(4)]
    assert all(sorted(r) == ["a", "b", "c", "d"] for r in rounds)
    # no method always runs right after the same one: over the 4 rounds each follows 3 different methods (and
    # runs first once), where rotating one order keeps every method after the same one
    for m in "abcd":
        before = [r[r.index(m) - 1] for r in rounds if r.index(m) > 0]
        assert len(before) == 3 and len(set(before)) == 3, (m, rounds)
    assert times == {"a": 2.5, "b": 25.0, "c": 4.5, "d": 2.0} and errors == {}
    assert spreads == {"a": [1.0, 8.0], "b": [10.0, 40.0], "c": [3.0, 6.0], "d": [1.5, 2.5]}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 10])
def test_round_orders_are_permutations_and_balance_who_runs_before_whom(n):
    """Over 2n rounds every ordered pair of methods is adjacent equally often (a Williams design), odd n too."""
    from collections import Counter

    from kvarn_cutlass.bench.timing import williams_order

    rows = [williams_order(n, r) for r in range(2 * n)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    pairs = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(pairs.values())) <= 1


@pytest.mark.parametrize("n", [1, 4, 5])
def test_interleaved_samples_take_each_round_in_a_williams_row(n):
    """Every method runs once a round, the round's order a row of the Williams design, and each method's samples
    are what it returned, in round order."""
    from kvarn_cutlass.bench.timing import interleaved_samples, williams_order

    calls = []

    def method(i):
        def run():
            calls.append(i)
            return 10.0 * i + len(calls)
        return run

    samples = interleaved_samples([method(i) for i in range(n)], rounds=3)
    assert calls == [i for r in range(3) for i in williams_order(n, r)]
    for i in range(n):
        at = [k + 1 for k, c in enumerate(calls) if c == i]
        assert samples[i] == [10.0 * i + k for k in at]


def test_an_optional_method_that_cannot_run_is_left_out_with_its_error():
    log = []

    def no_cudnn():
        log.append("c")
        raise RuntimeError("No available kernel. Aborting execution.")

    times, errors, spreads = _interleaved({"a": _method("a", log, [1.0, 4.0, 5.0]), "c": no_cudnn}, reps=2,
                                          optional=frozenset({"c"}))
    assert log == ["a", "c", "a", "a"] and times == {"a": 4.5} and spreads == {"a": [4.0, 5.0]}
    assert errors == {"c": "RuntimeError: No available kernel. Aborting execution."}


def test_a_required_method_that_fails_raises():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        _interleaved({"kvarn": broken}, reps=2, optional=frozenset({"cudnn"}))


def test_idle_gaps_sum_the_uncovered_time_by_the_kernels_around_it():
    from kvarn_cutlass.bench.prefill import idle_gaps

    p, c, m = "kvarn_prefill_fused", "kvarn_append_compress_cluster_t128_d128_f16_s16_v2", "kvarn_append_commit_t128_d128_f16_s16_v2"
    spans = [(c, 110.0, 130.0), (p, 0.0, 100.0), (m, 133.0, 140.0), (p, 150.0, 300.0),
             ("Memcpy DtoH", 200.0, 210.0),  # inside the kernel's span: no gap
             (c, 305.0, 320.0), (m, 321.0, 330.0)]
    r = idle_gaps(spans)
    assert r["span_ms"] == 0.33 and r["idle_ms"] == round((10 + 3 + 10 + 5 + 1) / 1e3, 3)
    assert r["gaps"] == [
        {"after": "prefill_fused", "before": "append_compress_cluster", "ms": 0.015, "count": 2, "largest_us": 10.0},
        {"after": "append_commit", "before": "prefill_fused", "ms": 0.01, "count": 1, "largest_us": 10.0},
        {"after": "append_compress_cluster", "before": "append_commit", "ms": 0.004, "count": 2, "largest_us": 3.0},
    ]
    with pytest.raises(ValueError, match="spans"):
        idle_gaps([])


def test_paired_ratios_take_each_sample_against_its_rounds_reference():
    from kvarn_cutlass.bench.timing import paired_ratios

    # a drift that doubles both in the last round cancels: the ratios are 0.9, 1.1, 1.0
    assert paired_ratios([9.0, 11.0, 20.0], [10.0, 10.0, 20.0]) == pytest.approx((1.0, 0.9, 1.1))
    for bad in (([], []), ([1.0], [1.0, 2.0])):
        with pytest.raises(ValueError, match="one length"):
            paired_ratios(*bad)
