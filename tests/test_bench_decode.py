"""CPU tests of kvarn_cutlass.bench.decode's sizing: how many layers its timed graphs rotate through."""

from __future__ import annotations

import math

from kvarn_cutlass.bench import decode as bench
from kvarn_cutlass.format import TileSpec


def test_rotated_layers_sizes_the_rotation_from_the_tile_records(monkeypatch):
    """The bytes handed to rotation_count are the layer's tile records (batch x 8 KV heads x the tiles before the
    window x the record size of TileSpec), and the answer is capped at 64 layers."""
    seen = []
    monkeypatch.setattr(bench, "rotation_count", lambda nbytes: seen.append(nbytes) or 7)
    assert bench.rotated_layers(16, 32768) == 7
    record = TileSpec(preset=bench.PRESET, head_dim=bench.D).tile_nbytes
    assert seen == [16 * bench.HKV * math.ceil((32768 - bench.WINDOW) / 128) * record]
    monkeypatch.setattr(bench, "rotation_count", lambda nbytes: 1000)
    assert bench.rotated_layers(1, 4096) == 64
    monkeypatch.setattr(bench, "rotation_count", lambda nbytes: seen.append(nbytes) or 1)
    assert bench.rotated_layers(1, 200) == 1 and seen[-1] == 1  # context inside the window: no tiles, 1 byte
