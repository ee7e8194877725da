"""The cluster kernel's iteration exchange (csrc/compress.cu, above compress_impl) as a model, on CPU.

Each rank is one sequential program (its __syncthreads order all of its threads): thread 0's
arrive.expect_tx on the mbarrier of the iteration's parity, the pushes to every other rank (st.async:
messages that land at any later time, each completing its bytes on the destination's mbarrier of that
parity), the wait for phase it >> 1, the reads of the R slots. Random schedules check that no push is
counted in an earlier phase, overwrites a slot not yet read, or leaves a read stale, and that nothing
deadlocks; with one mbarrier and one buffer instead of two parities the first of these happens.
This checks the protocol, not the CUDA code (the GPU byte-identity tests and compute-sanitizer do that).
"""

from __future__ import annotations

import random

import pytest


def _schedule(R: int, iters: int, seed: int, parities: int = 2) -> None:
    rnd = random.Random(seed)
    bars = [[{"phase": 0, "pending": 1, "tx": 0} for _ in range(parities)] for _ in range(R)]
    slots = [[[None] * R for _ in range(parities)] for _ in range(R)]  # the iteration whose data is there
    read = [[None] * parities for _ in range(R)]  # the last iteration whose slots of that parity were read
    pc = [[0, 0] for _ in range(R)]  # (iteration, step): 0 expect_tx, 1 push, 2 wait, 3 read
    flight: list[tuple[int, int, int]] = []
    done = [False] * R

    def phase_of(it: int) -> int:
        return it // parities

    def complete(bar: dict) -> None:
        if bar["pending"] == 0 and bar["tx"] == 0:
            bar.update(phase=bar["phase"] + 1, pending=1, tx=0)

    for _ in range(100_000):
        if all(done) and not flight:
            return
        moves = [("rank", q) for q in range(R) if not done[q]] + [("land", i) for i in range(len(flight))]
        kind, x = rnd.choice(moves)
        if kind == "land":
            src, dst, it = flight.pop(x)
            b = it % parities
            bar = bars[dst][b]
            assert bar["phase"] == phase_of(it), f"push of iteration {it} counted in an earlier phase (seed {seed})"
            assert it < parities or read[dst][b] == it - parities, f"push of iteration {it} overwrites an unread slot"
            slots[dst][b][src] = it
            bar["tx"] -= 1
            complete(bar)
            continue
        q = x
        it, step = pc[q]
        b = it % parities
        if step == 0:  # thread 0, after its wait of it - parities: the phase's arrival
            bar = bars[q][b]
            bar["pending"] -= 1
            bar["tx"] += R - 1
            complete(bar)
            pc[q][1] = 1
        elif step == 1:  # own slot by a plain store, the others by st.async
            slots[q][b][q] = it
            flight.extend((q, (q + d) % R, it) for d in range(1, R))
            pc[q][1] = 2
        elif step == 2:  # try_wait.parity for phase it // parities
            if bars[q][b]["phase"] > phase_of(it):
                pc[q][1] = 3
        else:  # reads, then __syncthreads before the next iteration's pushes
            assert all(slots[q][b][s] == it for s in range(R)), f"stale slot read at iteration {it} (seed {seed})"
            read[q][b] = it
            done[q] = it == iters
            if not done[q]:
                pc[q] = [it + 1, 0]
    raise AssertionError(f"deadlock (seed {seed})")


@pytest.mark.parametrize("R", [2, 4, 8])
def test_two_parities_are_race_free(R):
    for seed in range(400):
        _schedule(R, 4, seed)


def test_one_mbarrier_is_not():
    failures = 0
    for seed in range(400):
        try:
            _schedule(4, 4, seed, parities=1)
        except AssertionError:
            failures += 1
    assert failures > 0
