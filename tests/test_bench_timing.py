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


def test_elapsed_ms_propagates_the_work_s_error_unsynchronized(monkeypatch):
    log = _Log()
    monkeypatch.setattr(torch.cuda, "Event", log.event_class())

    def fn():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        timing.elapsed_ms(fn)
    assert log.calls == ["e1.record"]
