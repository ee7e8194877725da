"""The fused prefill kernel's launch shapes, on CPU: the CTA order (``ops.prefill.launch_grid`` and ``cta_rows`` in
``csrc/prefill_fused.cu``), mirrored and checked to cover every folded row of every KV head exactly once in both
orders, the heavy-first order launching CTAs in non-increasing order of the keys their last query sees (the causal
exact phase's work), with the source checked to compute what the mirror does; and the split-tile plan
(``ops.prefill.split_plan``): every tile in exactly one split, splits only where the grid leaves SMs idle."""

from __future__ import annotations

import heapq
import re
from pathlib import Path

import pytest

from kvarn_cutlass.ops import prefill as OP

SOURCE = (Path(__file__).resolve().parents[1] / "kvarn_cutlass/csrc/prefill_fused.cu").read_text()


def test_the_mirror_is_the_kernels_map():
    for line in ("c.b = min((int)blockIdx.z, batch - 1);", "const int j = blockIdx.y;", "c.h = blockIdx.x;",
                 "c.r0 = j * n + (gridDim.z - 1 - blockIdx.z) * BM;", "c.M = (j + 1) * n;",
                 "c.h = blockIdx.y;", "c.r0 = blockIdx.x * BM;", "c.M = G * n;",
                 "const CtaRows cr = cta_rows(G, n, heavy_first, batch);"):
        assert line in SOURCE, line
    assert SOURCE.count("cta_rows(G, n, heavy_first, batch)") == 3  # the start, the re-staged q, the store


def _params(symbol_define):
    body = SOURCE.split(f"{symbol_define}(", 1)[1].split(") {", 1)[0]
    return [re.sub(r"\W", "", item.split()[-1]) for item in body.replace("\n", " ").split(",")]


def test_the_launch_signatures_are_the_kernels():
    assert _params("KERNEL_NAME") == [entry.split()[1] for entry in OP._SIG]
    assert _params("MERGE_NAME") == [entry.split()[1] for entry in OP._MERGE_SIG]


def _blocks(order, n, group, hkv, rows, batch=1):
    """(heavy, KV head, sequence, rows) per CTA in launch order (x fastest, then y, then z): the kernel's cta_rows
    mirrored."""
    grid, heavy = OP.launch_grid(order, n, group, hkv, batch, rows)
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                if heavy:
                    h, b, r0, end = x, 0, y * n + (grid[2] - 1 - z) * rows, (y + 1) * n
                else:
                    h, b, r0, end = y, z, x * rows, group * n
                yield heavy, h, b, range(r0, min(end, r0 + rows))


@pytest.mark.parametrize("order", OP.ORDERS)
@pytest.mark.parametrize("n", [1, 5, 63, 64, 127, 128, 129, 300, 512, 700, 2048])
@pytest.mark.parametrize("group,hkv", [(1, 1), (3, 2), (4, 8), (8, 1)])
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("batch", [1, 3])
def test_every_folded_row_once(order, n, group, hkv, rows, batch):
    seen = {}
    for heavy, h, b, rs in _blocks(order, n, group, hkv, rows, batch):
        assert 0 <= h < hkv and 0 <= b < batch and len(rs) > 0, (h, b, rs)
        if heavy:
            assert rs[0] // n == rs[-1] // n, "a heavy-first CTA holds one query head's rows"
        for r in rs:
            assert 0 <= r < group * n
            seen[(b, h, r)] = seen.get((b, h, r), 0) + 1
    assert seen == {(b, h, r): 1 for b in range(batch) for h in range(hkv) for r in range(group * n)}


def _last_query(rs, n):
    return n - 1 if rs[0] // n != rs[-1] // n else rs[-1] % n


@pytest.mark.parametrize("n", [128, 300, 512, 2048])
def test_heavy_first_launches_the_most_keys_first(n):
    group, hkv, rows = 4, 8, 128
    blocks = list(_blocks("heavy", n, group, hkv, rows))
    assert all(heavy for heavy, *_ in blocks)
    last = [_last_query(rs, n) for *_, rs in blocks]
    assert last == sorted(last, reverse=True)
    if n > rows:  # the row order takes each query head's token blocks lightest first
        row_order = [_last_query(rs, n) for *_, rs in _blocks("rows", n, group, hkv, rows)]
        assert row_order != sorted(row_order, reverse=True)


def _makespan(costs, sms=132):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def test_heavy_first_shortens_a_greedy_schedule_of_an_exact_only_chunk():
    # the reason for the order, in the model it was predicted with (docs/perf-notes.md): CTAs taken in launch order
    # by 132 SMs, one at a time, each costing its exact blocks of 64 keys; 2048 tokens, G = 4, 8 KV heads
    n, group, hkv, rows = 2048, 4, 8, 128
    span = {order: _makespan([(_last_query(rs, n) + 64) // 64 for *_, rs in _blocks(order, n, group, hkv, rows)])
            for order in OP.ORDERS}
    assert span["heavy"] < 0.85 * span["rows"], span


def test_short_chunks_and_batches_keep_the_row_order():
    assert OP.launch_grid("heavy", 100, 4, 8, 1, 128) == ((4, 8, 1), False)
    assert OP.launch_grid("heavy", 128, 4, 8, 1, 128) == ((8, 4, 1), True)
    assert OP.launch_grid("heavy", 2048, 4, 8, 2, 128) == ((64, 8, 2), False)
    assert OP.launch_grid("rows", 2048, 4, 8, 1, 128) == ((64, 8, 1), False)


def test_block_order_knob(monkeypatch):
    monkeypatch.delenv(OP.ORDER_ENV, raising=False)
    assert OP.block_order() == "heavy"
    monkeypatch.setenv(OP.ORDER_ENV, "rows")
    assert OP.block_order() == "rows"
    monkeypatch.setenv(OP.ORDER_ENV, "reverse")
    with pytest.raises(ValueError, match=OP.ORDER_ENV):
        OP.block_order()


# ---- split tiles ----------------------------------------------------------------------------------------------
def test_split_mode_in_the_source():
    for line in ("const int g0 = (int)blockIdx.z * split_tiles;", "tile_table += g0;",
                 "n_tiles = max(0, min(split_tiles, n_tiles - g0));",
                 "schedule(n_tiles, sink_len, win_len, n, M, r0, (int)blockIdx.z == splits - 1 || splits <= 1)",
                 "sc.e_end = min(sc.E, sc.E0 + q_last + 1) * (int)exact_phase;",
                 "extern \"C\" __global__ void __launch_bounds__(128) MERGE_NAME("):
        assert line in SOURCE, line


@pytest.mark.parametrize("ctas", [1, 4, 8, 32, 66, 67, 132, 512])
@pytest.mark.parametrize("n_tiles", [0, 1, 7, 8, 9, 16, 63, 254, 1000])
@pytest.mark.parametrize("batch", [1, 2])
def test_split_plan_covers_every_tile_once(ctas, n_tiles, batch):
    sms = 132
    splits, per = OP.split_plan(ctas, n_tiles, batch, sms)
    if splits == 1:
        assert per == n_tiles
        assert batch != 1 or 2 * ctas > sms or n_tiles < 2 * OP.MIN_SPLIT_TILES
        return
    assert batch == 1 and 2 * ctas <= sms and splits * ctas <= sms  # one wave
    ranges = [range(z * per, min(n_tiles, (z + 1) * per)) for z in range(splits)]  # the kernel's g0 and count
    assert all(len(r) >= OP.MIN_SPLIT_TILES for r in ranges[:-1]) and len(ranges[-1]) >= 1
    assert [g for r in ranges for g in r] == list(range(n_tiles))


def test_split_knob(monkeypatch):
    monkeypatch.delenv(OP.SPLIT_ENV, raising=False)
    assert OP.split_tiles_enabled() is True
    monkeypatch.setenv(OP.SPLIT_ENV, "0")
    assert OP.split_tiles_enabled() is False
    monkeypatch.setenv(OP.SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match=OP.SPLIT_ENV):
        OP.split_tiles_enabled()

