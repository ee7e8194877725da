"""The fused prefill kernel's stage hand-over (csrc/prefill_fused.cu, the producers' block loop) as a model, on CPU.

Producer groups and consumers are sequential programs over the CTA's blocks (tile blocks, then exact blocks):
block bi uses stage bi % NSTAGE; a group owns the stages s with s / BPT == its index (every stage with one
group). A producer waits EMPTY for the block that last used the stage (bi - NSTAGE), fills the stage and arrives
FULL; the consumers take the blocks in order: wait FULL, read, arrive EMPTY, except that wgmma's consumers keep
a block until the next one is FULL (its P . V is issued with the next block's scores; the tiles' last block is
flushed at once). An exact block's copies are cp.async groups: the producer hands over the group's previous
exact block (wait_group 1: all but the newest landed) only after issuing the next one, unless the consumers need
the pending block to free the stage the producer waits for (it is at most bi - NSTAGE + CONSUMER_HOLD).
With two producer groups the hand-off is a FULL and an EMPTY mbarrier per stage, whose waits name the parity of
the phase they wait for (block bi: the stage's phase bi // NSTAGE): the model counts each barrier's completed
phases and checks that a waiter always finds exactly the phase it named completed and the next one not, so that
a parity cannot stand for a later phase (with one group, named barriers, whose phases the hardware keeps). Random schedules (and copies landing at any time) check that no block is handed over before
its copies landed and that nothing deadlocks, for every kernel shape the configs build; the rule the sixth session shipped
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
                 "if (bi >= NSTAGE) stages.wait_empty(s, bi);", "if (pend >= 0) hand_over(pend % NSTAGE, true);",
                 "if (bi + NSTAGE < sc.nb) stages.release(bi);",
                 # the mbarrier form's parities and arrival counts
                 "static __device__ __forceinline__ u32 parity(int bi) { return (u32)(bi / NSTAGE) & 1u; }",
                 "if constexpr (MBAR_HANDOFF) mbar_wait(full + 8 * (bi % NSTAGE), parity(bi));",
                 "if constexpr (MBAR_HANDOFF) mbar_wait(empty + 8 * s, parity(bi) ^ 1u);",
                 "mbar_init(full + 8 * st, GT);", "mbar_init(empty + 8 * st, NC * 32);",
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
    # completed phases of each stage's FULL and EMPTY mbarriers: handing over (releasing) block b completes
    # phase b // ns of its stage's FULL (EMPTY) barrier, and a wait for block b's phase passes only on a
    # barrier that has completed exactly b // ns + 1 phases (one more, and the parity would alias)
    full_phases, empty_phases = [0] * ns, [0] * ns

    def complete(phases, block):
        assert phases[block % ns] == block // ns, f"block {block}: phase out of order"
        phases[block % ns] += 1

    def passes(phases, block) -> bool:
        done = phases[block % ns]
        assert done <= block // ns + 1, f"block {block}: the barrier ran a phase past the one waited for"
        return done == block // ns + 1
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
            complete(full_phases, block)

        for bi in range(nb):
            s = bi % ns
            if ng > 1 and s // bpt != pg:
                continue
            first = pend % ns == s if same_stage_rule else bi >= ns and pend <= bi - ns + hold
            if bi >= nba and pend >= 0 and first:
                yield from hand_over(pend, False)
                pend = -1
            while bi >= ns and not passes(empty_phases, bi - ns):
                yield "empty"
            assert bi < ns or bi - ns in empty
            if bi < nba:
                full.add(bi)  # a tile block: dequantized by the group's threads, handed over at once
                complete(full_phases, bi)
                continue
            in_flight[pg].append(bi)
            if pend >= 0:
                yield from hand_over(pend, True)
            pend = bi
        if pend >= 0:
            yield from hand_over(pend, False)

    def consumers():
        held = -1  # the block whose P . V waits for the next block's turn

        def release(block):
            empty.add(block)
            complete(empty_phases, block)

        for bi in range(nb):
            while not passes(full_phases, bi):
                yield "full"
            assert bi in full
            if not hold:
                release(bi)
                continue
            if held >= 0:
                release(held)
            held = bi
            if bi == nba - 1:  # the tiles' last P . V is flushed before the exact phase
                release(bi)
                held = -1
        if held >= 0:
            release(held)

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
