"""The fused prefill kernel's stage hand-over (csrc/prefill_fused.cu, the producers' block loop) as a model, on CPU.

Producer groups and consumers are sequential programs over the CTA's blocks (tile blocks, then exact blocks):
block bi uses stage bi % NSTAGE; a group owns the stages s with s / BPT == its index (every stage with one
group). A producer waits EMPTY for the block that last used the stage (bi - NSTAGE), fills the stage and arrives
FULL; the consumers take the blocks in order: wait FULL, read, arrive EMPTY, except that wgmma's consumers keep
a block until the next one is FULL (its P . V is issued with the next block's scores; the tiles' last block is
flushed at once). An exact block's copies are cp.async groups: the producer hands over the group's previous
exact block (wait_group 1: all but the newest landed) only after issuing the next one, unless the consumers need
the pending block to free the stage the producer waits for (it is at most bi - NSTAGE + CONSUMER_HOLD).
Random schedules (and copies landing at any time) check that no block is handed over before its copies landed
and that nothing deadlocks, for every kernel shape the configs build; the rule the sixth session shipped
(hand over first only when the pending block holds the same stage) deadlocks two wgmma producer groups of two
blocks per tile (the tuned D=128 config; found here before the GPU ran it), so the model can fail. This checks the protocol, not the CUDA code (the
GPU tests do that).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

SOURCE = (Path(__file__).resolve().parents[1] / "kvarn_cutlass/csrc/prefill_fused.cu").read_text()


def nstage(ng: int, bpt: int, wgmma: bool, d: int, bn: int = 32) -> int:
    """The kernel's NSTAGE (asserted below to be the source's formula; bn: BLOCK_N)."""
    return (4 if wgmma and d <= 128 else (2 if d == 256 and bn == 64 else 3)) if ng == 1 else ng * bpt


def test_the_model_uses_the_kernels_stage_count_and_rules():
    assert ("constexpr int NSTAGE = NG == 1 ? (WGMMA && D <= 128 ? 4 : (D == 256 && BN == 64 ? 2 : 3)) : NG * BPT;"
            in SOURCE)
    assert "constexpr int CONSUMER_HOLD = WGMMA ? 1 : 0;" in SOURCE
    assert "if (NG > 1 && s / BPT != pg) continue;  // another group's stage" in SOURCE
    for line in ("if (pend >= 0 && bi >= NSTAGE && pend <= bi - NSTAGE + CONSUMER_HOLD) {",
                 "if (bi >= NSTAGE) bar_sync(BAR_EMPTY + s, HANDOFF);", "if (pend >= 0) hand_over(pend % NSTAGE, true);",
                 "pend = bi;", "if (newest_in_flight) cp_async_wait_group<1>();",
                 # the consumers' release points the model's hold follows
                 "if (PV != 0) release(pv_bi);", "turn(K0{}, K1{}, 0);\n                end_of_tiles();"):
        assert line in SOURCE, line


def _run(ng: int, bpt: int, ns: int, nba: int, nexact: int, seed: int, hold: int,
         same_stage_rule: bool = False) -> None:
    """One random schedule; ``hold``: CONSUMER_HOLD (1 for wgmma); ``same_stage_rule``: the shipped-then-
    deadlocked rule (hand over first only when the pending block's stage is the one being reused)."""
    rnd = random.Random(seed)
    nb = nba + nexact
    full, empty = set(), set()  # blocks handed over / released
    landed: set[int] = set()
    in_flight: dict[int, list[int]] = {g: [] for g in range(ng)}  # a group's issued exact blocks, oldest first

    def producer(pg: int):
        pend = -1  # the block (not stage) handed over late; its stage is pend % ns

        def hand_over(block: int, newest_in_flight: bool):
            keep = in_flight[pg][-1:] if newest_in_flight else []
            while any(b not in landed for b in in_flight[pg] if b not in keep):
                yield "copies"
            in_flight[pg][:] = [b for b in in_flight[pg] if b in keep]
            assert block in landed, f"block {block} handed over before its copies landed"
            full.add(block)

        for bi in range(nb):
            s = bi % ns
            if ng > 1 and s // bpt != pg:
                continue
            first = pend % ns == s if same_stage_rule else bi >= ns and pend <= bi - ns + hold
            if bi >= nba and pend >= 0 and first:
                yield from hand_over(pend, False)
                pend = -1
            while bi >= ns and bi - ns not in empty:
                yield "empty"
            if bi < nba:
                full.add(bi)  # a tile block: dequantized by the group's threads, handed over at once
                continue
            in_flight[pg].append(bi)
            if pend >= 0:
                yield from hand_over(pend, True)
            pend = bi
        if pend >= 0:
            yield from hand_over(pend, False)

    def consumers():
        held = -1  # the block whose P . V waits for the next block's turn
        for bi in range(nb):
            while bi not in full:
                yield "full"
            if not hold:
                empty.add(bi)
                continue
            if held >= 0:
                empty.add(held)
            held = bi
            if bi == nba - 1:  # the tiles' last P . V is flushed before the exact phase
                empty.add(bi)
                held = -1
        if held >= 0:
            empty.add(held)

    actors = [producer(g) for g in range(ng)] + [consumers()]
    live = list(range(len(actors)))
    for _ in range(200_000):
        if not live:
            return
        pending = [b for g in in_flight.values() for b in g if b not in landed]
        moves = [("actor", a) for a in live] + [("land", b) for b in pending]
        kind, x = rnd.choice(moves)
        if kind == "land":
            landed.add(x)
            continue
        try:
            next(actors[x])
        except StopIteration:
            live.remove(x)
    raise AssertionError(f"no progress: ng={ng} bpt={bpt} ns={ns} nba={nba} nexact={nexact} "
                         f"full={sorted(full)} empty={sorted(empty)}")


SHAPES = [(ng, bpt, nstage(ng, bpt, wg, d, bn), int(wg)) for ng, bpt, wg, d, bn in
          [(1, 1, True, 128, 64), (1, 2, True, 128, 64), (1, 2, False, 128, 64), (1, 4, False, 64, 32),
           (1, 4, True, 256, 32), (1, 2, True, 256, 64), (1, 1, True, 256, 64),  # D=256: 32- and 64-token blocks
           (2, 1, True, 128, 64), (2, 1, False, 128, 64), (2, 2, True, 128, 64), (2, 2, False, 64, 32)]]


@pytest.mark.parametrize("ng,bpt,ns,hold", SHAPES)
@pytest.mark.parametrize("n_tiles,nexact", [(0, 1), (0, 5), (1, 3), (2, 7), (3, 2), (5, 9)])
def test_hand_over_never_early_and_never_stuck(ng, bpt, ns, hold, n_tiles, nexact):
    for seed in range(20):
        _run(ng, bpt, ns, n_tiles * bpt, nexact, seed, hold)


def test_the_same_stage_rule_deadlocks_two_wgmma_groups():
    # two wgmma producer groups of two blocks per tile (the tuned D=128 config): group 0's blocks 0, 1, 4;
    # at block 4 it waits for stage 0, which the consumers free only once block 1 is FULL, and block 1 is
    # the one it has not handed over
    with pytest.raises(AssertionError, match="no progress"):
        _run(2, 2, nstage(2, 2, True, 128), 0, 5, seed=0, hold=1, same_stage_rule=True)
