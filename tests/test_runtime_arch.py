"""``runtime.arch.sm_count`` without a GPU: which device it asks the driver about, and that it asks once per device
(launch planning calls it per launch)."""

from __future__ import annotations

import types

import torch

from kvarn_cutlass.runtime import arch


def test_sm_count_resolves_the_device_and_reads_it_once(monkeypatch):
    asked = []

    def props(index):
        asked.append(index)
        return types.SimpleNamespace(multi_processor_count=100 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    arch._sm_count_of.cache_clear()
    try:
        assert arch.sm_count(2) == 102
        assert arch.sm_count("cuda:2") == 102 and arch.sm_count(torch.device("cuda", 2)) == 102
        assert arch.sm_count() == 101 and arch.sm_count("cuda") == 101  # no index: the current device
        assert asked == [2, 1]
    finally:
        arch._sm_count_of.cache_clear()  # nothing faked outlives the test
