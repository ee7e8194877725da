"""CPU tests of tools/decode_trace.py: its phase summary of a trace buffer, on synthetic block timelines whose
phases are known, and the trace variant's SASS (the only kernel that reads the timers)."""

from __future__ import annotations

import re

import pytest

from kvarn_cutlass import decode
from kvarn_cutlass.format import TileSpec
from kvarn_cutlass.runtime import build

from _helpers import load_tool, require_disassembler


def _row(t, sm, tiles, exact=False, last=False, cycles_per_tile=None, sub=(0, 0, 0, 0, 0)):
    """One trace row: globaltimer marks t[0..6] (ns), the info word, clock64 marks (only the loop's used), the
    ticket's and merge's globaltimer marks ``sub`` (fields 16-20)."""
    row = [0] * 24
    row[:7] = t
    row[16:21] = sub
    row[7] = sm | tiles << 16 | int(exact) << 32 | int(last) << 33
    if cycles_per_tile is not None:
        row[10], row[11] = 1_000_000, 1_000_000 + cycles_per_tile * tiles
    return row


def test_summary_of_known_timelines():
    """Three tile blocks on two SMs, one of them without tiles, an exact block, and the merging block: each summary
    number is the phase arithmetic done here by hand, in us."""
    tool = load_tool("decode_trace")
    rows = [
        # entry, wait, first records, loop end, partial, ticket, merge end
        _row([1000, 1500, 4000, 20000, 21000, 22000, 0], sm=0, tiles=4, cycles_per_tile=3000, sub=(21200,)),
        _row([1200, 1600, 5000, 25000, 26000, 27500, 0], sm=1, tiles=4, cycles_per_tile=4000, sub=(26600,)),
        _row([1100, 1400, 0, 0, 1600, 2000, 0], sm=1, tiles=0, sub=(1700,)),
        _row([1300, 1700, 0, 0, 9000, 9500, 0], sm=0, tiles=0, exact=True, sub=(9400,)),
        _row([1000, 1300, 3000, 29000, 30000, 31000, 34000], sm=0, tiles=5, last=True, cycles_per_tile=5000,
             sub=(30300, 31500, 32100, 33300, 33800)),
    ]
    rows += [[7] * 24] * 3  # rows past the launch's blocks are not read
    s = tool.summarize(rows, 5)
    assert (s["blocks"], s["tile_blocks"], s["merging_blocks"], s["sms"], s["blocks_per_sm_max"]) == (5, 3, 1, 2, 3)
    assert s["span_us"] == pytest.approx(33.0)  # first entry 1000 ns to the merge's end 34000
    assert s["entry_spread_us"] == pytest.approx(0.3)
    assert s["first_records_med_us"] == pytest.approx(2.5)  # 2.5, 3.4, 1.7 us
    assert s["first_records_max_us"] == pytest.approx(3.4)
    assert s["loop_med_us"] == pytest.approx(20.0) and s["loop_max_us"] == pytest.approx(26.0)  # 16, 20, 26
    assert s["per_tile_med_us"] == pytest.approx(5.0)  # 4, 5, 5.2
    assert s["ticket_max_us"] == pytest.approx(1.5)
    assert s["last_ticket_us"] == pytest.approx(30.0) and s["after_last_ticket_us"] == pytest.approx(3.0)
    assert s["tail_us"] == pytest.approx(30.0 - 21.0)  # ticket ends 21, 26.5, 1, 8.5, 30 us: median 21
    assert s["merge_med_us"] == pytest.approx(3.0)
    assert s["loop_cycles_per_tile_med"] == pytest.approx(4000)
    assert s["ticket_barrier_med_us"] == pytest.approx(0.3)  # 0.2, 0.6, 0.1, 0.4, 0.3
    assert s["merge_reset_med_us"] == pytest.approx(0.5)  # ticket 31000 -> 31500
    assert s["merge_first_batch_med_us"] == pytest.approx(0.6)
    assert s["merge_rows_med_us"] == pytest.approx(1.2) and s["merge_store_med_us"] == pytest.approx(0.5)


def test_only_the_trace_variant_reads_the_timers():
    """The trace kernel reads %globaltimer at its seven marks and five ticket and merge steps, clock64 at the seven
    marks (both kernels of the module); the shipped
    kernel reads neither, so the diagnostic cannot leak into what is timed elsewhere."""
    require_disassembler()
    from kvarn_cutlass.cli.sass import disassemble

    counts = {}
    for v in (decode.DecodeVariant(), decode.DecodeVariant(trace=1)):
        sass = disassemble(build(decode.decode_spec(TileSpec(), v), "sm90").cubin)
        counts[str(v)] = (len(re.findall(r"SR_GLOBALTIMERLO", sass)), len(re.findall(r"SR_CLOCKLO", sass)))
    assert counts["default"] == (0, 0)
    assert counts["trace=1"] == (2 * 12, 2 * 7), counts


def test_variant_arguments():
    """--variant plan is the plan's own kernel (None); any other text is a variant, a bad one rejected."""
    tool = load_tool("decode_trace")
    assert tool._variant("plan") is None and tool._variant(" plan ") is None
    assert tool._variant("merge_group=8") == decode.DecodeVariant(merge_group=8)
    with pytest.raises(ValueError):
        tool._variant("ticket=1")


def test_merge_steps_skip_merging_blocks_without_them():
    """With merge_group the groups' last blocks are merging blocks too, but only the final merge stamps the merge's
    steps (fields 18-20): the steps are summarized over the blocks that stamped them."""
    tool = load_tool("decode_trace")
    rows = [
        _row([1000, 1300, 3000, 29000, 30000, 31000, 34000], sm=0, tiles=5, last=True, cycles_per_tile=5000,
             sub=(30300, 31500, 32100, 33300, 33800)),
        _row([1000, 1300, 3000, 20000, 21000, 22000, 23000], sm=1, tiles=5, last=True, cycles_per_tile=5000,
             sub=(21300, 22200, 0, 0, 0)),
    ]
    s = tool.summarize(rows, 2)
    assert s["merging_blocks"] == 2 and s["merge_reset_med_us"] == pytest.approx(0.35)  # 0.5 and 0.2
    assert s["merge_first_batch_med_us"] == pytest.approx(0.6) and s["merge_rows_med_us"] == pytest.approx(1.2)
    assert s["merge_store_med_us"] == pytest.approx(0.5)
