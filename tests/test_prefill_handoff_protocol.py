"""The fused prefill kernel's stage hand-over (csrc/prefill_fused.cu, the producers' block loop) as a model, on CPU.

Producer groups and consumers are sequential programs over the CTA's blocks (tile blocks, then exact blocks):
block bi uses stage bi % NSTAGE; a group owns the stages s with s / BPT == its index (every stage with one
group). A producer waits EMPTY for the block that last used the stage (bi - NSTAGE), fills the stage and arrives
FULL; the consumers take the blocks in order: wait FULL, read, arrive EMPTY. An exact block's copies are
cp.async groups: the producer hands over the group's previous exact block (wait_group 1: all but the newest
landed) only after issuing the next one, and a group with one stage hands it over before reusing that stage.
Random schedules (and copies landing at any time) check that no block is handed over before its copies landed
and that nothing deadlocks, for every kernel shape the configs build; the old rule that let a one-stage group
defer deadlocks, so the model can fail. This checks the protocol, not the CUDA code (the GPU tests do that).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

SOURCE = (Path(__file__).resolve().parents[1] / "kvarn_cutlass/csrc/prefill_fused.cu").read_text()


def nstage(ng: int, bpt: int, wgmma: bool, d: int) -> int:
    """The kernel's NSTAGE (asserted below to be the source's formula)."""
    return (4 if wgmma and d <= 128 else 3) if ng == 1 else ng * bpt


def test_the_model_uses_the_kernels_stage_count_and_rules():
    assert "constexpr int NSTAGE = NG == 1 ? (WGMMA && D <= 128 ? 4 : 3) : NG * BPT;" in SOURCE
    assert "if (NG > 1 && s / BPT != pg) continue;  // another group's stage" in SOURCE
    for line in ("if (pend == s) {", "if (bi >= NSTAGE) bar_sync(BAR_EMPTY + s, HANDOFF);",
                 "if (pend >= 0) hand_over(pend, true);", "if (newest_in_flight) cp_async_wait_group<1>();"):
        assert line in SOURCE, line


def _run(ng: int, bpt: int, ns: int, nba: int, nexact: int, seed: int, defer_single_stage: bool = False) -> None:
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
            if bi >= nba and pend >= 0 and pend % ns == s and not defer_single_stage:
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
        for bi in range(nb):
            while bi not in full:
                yield "full"
            empty.add(bi)

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


SHAPES = [(ng, bpt, nstage(ng, bpt, wg, d)) for ng, bpt, wg, d in
          [(1, 1, True, 128), (1, 2, True, 128), (1, 2, False, 128), (1, 4, False, 64), (1, 4, True, 256),
           (2, 1, True, 128), (2, 2, True, 128), (2, 2, False, 64)]]


@pytest.mark.parametrize("ng,bpt,ns", SHAPES)
@pytest.mark.parametrize("n_tiles,nexact", [(0, 1), (0, 5), (1, 3), (2, 7), (3, 2), (5, 9)])
def test_hand_over_never_early_and_never_stuck(ng, bpt, ns, n_tiles, nexact):
    for seed in range(20):
        _run(ng, bpt, ns, n_tiles * bpt, nexact, seed)


def test_deferring_a_one_stage_group_would_deadlock():
    # two groups of one stage each (two producer groups, one block per tile): deferring without the
    # pend == s hand-over waits for the stage the pending block still holds
    with pytest.raises(AssertionError, match="no progress"):
        _run(2, 1, nstage(2, 1, True, 128), 0, 4, seed=0, defer_single_stage=True)
