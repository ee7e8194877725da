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
    times, errors = _interleaved({
        "a": _method("a", log, [99.0, 3.0, 1.0, 2.0]),  # the warm-up's 99 is not a sample
        "b": _method("b", log, [50.0, 10.0, 30.0, 20.0]),
    }, reps=3)
    assert log == ["a", "b"] + ["a", "b"] * 3
    assert times == {"a": 2.0, "b": 20.0} and errors == {}


def test_an_optional_method_that_cannot_run_is_left_out_with_its_error():
    log = []

    def no_cudnn():
        log.append("c")
        raise RuntimeError("No available kernel. Aborting execution.")

    times, errors = _interleaved({"a": _method("a", log, [1.0, 4.0, 5.0]), "c": no_cudnn}, reps=2,
                                 optional=frozenset({"c"}))
    assert log == ["a", "c", "a", "a"] and times == {"a": 4.5}
    assert errors == {"c": "RuntimeError: No available kernel. Aborting execution."}


def test_a_required_method_that_fails_raises():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        _interleaved({"kvarn": broken}, reps=2, optional=frozenset({"cudnn"}))
