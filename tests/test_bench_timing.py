"""CPU tests of kvarn_cutlass.bench.timing's event plumbing, with torch.cuda.Event replaced by a recorder: the
order of what reaches the stream and the host, not any time."""

from __future__ import annotations

import pytest
import torch

from kvarn_cutlass.bench import timing


class _Log:
    """The calls the timed code makes, in order; a fake event's elapsed time is the log positions between the
    two records, so a wrong pairing shows as a wrong number."""

    def __init__(self):
        self.calls: list[str] = []

    def event_class(self):
        log = self

        class Event:
            made = 0

            def __init__(self, enable_timing: bool = False):
                assert enable_timing, "a timing event needs enable_timing=True"
                Event.made += 1
                self.name, self.at = f"e{Event.made}", None

            def record(self):
                self.at = len(log.calls)
                log.calls.append(f"{self.name}.record")

            def synchronize(self):
                log.calls.append(f"{self.name}.synchronize")

            def elapsed_time(self, other) -> float:
                assert self.at is not None and other.at is not None, "elapsed_time of an unrecorded event"
                return float(other.at - self.at)

        return Event


def test_elapsed_ms_brackets_the_work_once_and_syncs_after_the_second_event(monkeypatch):
    log = _Log()
    monkeypatch.setattr(torch.cuda, "Event", log.event_class())
    work = []

    def fn():
        work.append(1)
        log.calls.append("work")
        log.calls.append("more work")

    ms = timing.elapsed_ms(fn)
    assert work == [1]
    assert log.calls == ["e1.record", "work", "more work", "e2.record", "e2.synchronize"]
    assert ms == 3.0  # the fake's distance from the first record to the second: the work lies between them


def test_elapsed_ms_repeats_the_work_between_one_pair_of_events(monkeypatch):
    log = _Log()
    monkeypatch.setattr(torch.cuda, "Event", log.event_class())
    ms = timing.elapsed_ms(lambda: log.calls.append("work"), repeats=3)
    assert log.calls == ["e1.record", "work", "work", "work", "e2.record", "e2.synchronize"]
    assert ms == 4.0
    for bad in (0, -1):
        with pytest.raises(ValueError, match="repeats"):
            timing.elapsed_ms(lambda: None, repeats=bad)


def test_elapsed_ms_propagates_the_work_s_error_unsynchronized(monkeypatch):
    log = _Log()
    monkeypatch.setattr(torch.cuda, "Event", log.event_class())

    def fn():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        timing.elapsed_ms(fn)
    assert log.calls == ["e1.record"]


def _fake_stream(monkeypatch, log: _Log, rate: float = 1000.0):
    """torch.cuda's sleep, synchronize and device replaced by log entries; the sleep clock's rate preset."""
    monkeypatch.setattr(torch.cuda, "Event", log.event_class())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.calls.append(f"sleep {cycles}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 7)
    monkeypatch.setitem(timing._sleep_cycles_per_us, 7, rate)


def test_time_queued_puts_the_call_behind_a_sleep_and_times_it_between_two_events(monkeypatch):
    log = _Log()
    _fake_stream(monkeypatch, log, rate=1000.0)
    clock = iter([10.0, 10.0 + 250e-6])  # the host's perf_counter around the call: 250 us
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    gpu_us, host_us = timing.time_queued(lambda: log.calls.append("work"), lead_us=2000.0)
    assert log.calls == ["synchronize", "sleep 2000000", "e1.record", "work", "e2.record", "e2.synchronize"]
    assert gpu_us == 2000.0  # the fake event pair's distance (2 log entries) in ms, as us
    assert abs(host_us - 250.0) < 1e-6


def test_time_queued_refuses_a_lead_the_host_outran(monkeypatch):
    log = _Log()
    _fake_stream(monkeypatch, log)
    clock = iter([0.0, 1700e-6])  # 1,700 us of host time behind a 2,000 us lead: more than 0.8 of it
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    with pytest.raises(RuntimeError, match="pass a longer lead_us"):
        timing.time_queued(lambda: None, lead_us=2000.0)
