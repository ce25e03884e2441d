"""The stage ring of a 2-CTA cluster sharing one operand (sm90_fp8_gemm_1d2d.cuh with
kNumTMAMulticast = 2: dense multicast of A or B, contiguous pairs sharing B), simulated on the
CPU under random interleavings.

Each CTA has one producer and its math warpgroups (two here, each reading every k-block of the
ring: the kernel's math warps read the same stage). The producer waits for its stage's empty
barrier, arrives on its full barrier expecting both operands' bytes and loads its own operand.
The shared operand comes one of three ways, per k-block (contiguous pairs share it only where
both tiles are of one group): each CTA loads its own copy (no multicast); the leader (rank 0)
loads the whole box into the same stage of both CTAs (the kernel's form); or each CTA loads one
half of the box into both (`split`). A multicast lands in each CTA at its own time and
completes that CTA's full barrier by its bytes. A math warpgroup waits for the full barrier,
reads the stage, and releases it by arriving on empty barriers.

Which empty barriers a release arrives on, and how many arrivals each counts, is the design:
- "both": every release arrives on both CTAs' barriers, each counting both CTAs' warpgroups
  (the kernel's, and DeepGEMM's);
- "to_leader": a CTA arrives on its own barrier, the follower on the leader's too; the leader's
  counts both CTAs' warpgroups, the follower's its own. Right only while the leader alone
  writes into the follower, on every k-block: without multicast (contiguous pairs on tiles of
  two groups) the follower runs ahead and its releases complete the leader's barrier early, and
  with split halves the follower writes into the leader's stages;
- "own": each CTA arrives on its own barrier only (wrong: the leader's multicast can land in a
  follower stage whose readers are not done).

The model checks what the kernel relies on: no load lands in a stage before every warpgroup of
that CTA has released what the stage held a ring earlier; every warpgroup reads each k-block's
two operands from the stage that holds them; and the cluster always finishes.
"""

from __future__ import annotations

import random

import pytest

from helpers import MBarrier

CTAS = 2
READERS = 2  # math warpgroups a CTA


def empty_count(design: str, rank: int) -> int:
    if design == "both":
        return CTAS * READERS
    if design == "to_leader":
        return CTAS * READERS if rank == 0 else READERS
    return READERS


def release_targets(design: str, rank: int) -> list[int]:
    if design == "both":
        return list(range(CTAS))
    if design == "to_leader":
        return [rank] if rank == 0 else [rank, 0]
    return [rank]


# the shared operand's box in two halves (the transaction units of a full barrier: the own
# operand 2, the shared one 2, a half 1)
HALVES = 2


class Pair:
    def __init__(self, stages: int, n: int, design: str, multicast=None,
                 split: bool = False) -> None:
        self.stages, self.n, self.design, self.split = stages, n, design, split
        self.multicast = multicast or (lambda kb: True)
        self.full = [[MBarrier(1) for _ in range(stages)] for _ in range(CTAS)]
        self.empty = [[MBarrier(empty_count(design, r)) for _ in range(stages)]
                      for r in range(CTAS)]
        # the k-block of each operand (each half of the shared one) a stage holds, and the
        # releases of each k-block
        self.own = [[None] * stages for _ in range(CTAS)]
        self.shared = [[[None] * HALVES for _ in range(stages)] for _ in range(CTAS)]
        self.released = [[0] * n for _ in range(CTAS)]
        self.issued = [0] * CTAS  # k-blocks each producer has issued

    def land(self, rank: int, stage: int, which, kb: int) -> None:
        """A load of k-block kb lands in `rank`'s stage: a ring earlier's readers must be done.
        `which`: "own", or the halves of the shared operand it brings."""
        assert kb < self.stages or self.released[rank][kb - self.stages] == READERS, \
            f"k-block {kb} landed in CTA {rank} stage {stage} before its readers released " \
            f"k-block {kb - self.stages}"
        if which == "own":
            self.own[rank][stage] = kb
            self.full[rank][stage].complete_tx(HALVES)
            return
        for h in which:
            self.shared[rank][stage][h] = kb
        self.full[rank][stage].complete_tx(len(which))


def producer(p: Pair, rank: int, loads: list):
    for kb in range(p.n):
        s, phase = kb % p.stages, (kb // p.stages) & 1
        yield lambda s=s, ph=phase: p.empty[rank][s].done(ph ^ 1)
        p.full[rank][s].arrive(tx=2 * HALVES)  # its own operand and the shared one
        p.issued[rank] += 1
        loads.append((rank, s, "own", kb))
        if not p.multicast(kb):  # its own copy of the shared operand
            loads.append((rank, s, range(HALVES), kb))
        elif p.split:  # its half, into both CTAs' stage s
            loads.extend((q, s, (rank,), kb) for q in range(CTAS))
        elif rank == 0:  # the whole box, into both CTAs' stage s
            loads.extend((q, s, range(HALVES), kb) for q in range(CTAS))


def math_wg(p: Pair, rank: int):
    for kb in range(p.n):
        s, phase = kb % p.stages, (kb // p.stages) & 1
        yield lambda s=s, ph=phase: p.full[rank][s].done(ph)
        assert p.own[rank][s] == kb and p.shared[rank][s] == [kb] * HALVES, \
            (rank, kb, p.own[rank][s], p.shared[rank][s])
        p.released[rank][kb] += 1
        for q in release_targets(p.design, rank):
            p.empty[q][s].arrive()


def simulate(stages: int, n: int, design: str, seed: int, prefer=None, observe=None,
             multicast=None, split: bool = False) -> bool:
    """One random interleaving (loads landing late, one CTA's threads running ahead of the
    other's); False when the pair deadlocks. `prefer`: a key that picks the thread to run among
    the ready ones (lowest first) instead of chance; `observe(pair)` runs after every step;
    `multicast(kb)`: whether k-block kb's shared operand is multicast (default: every one);
    `split`: multicast as two halves, one from each CTA."""
    rng = random.Random(seed)
    p = Pair(stages, n, design, multicast, split)
    loads: list = []
    threads = {("p", r): producer(p, r, loads) for r in range(CTAS)}
    threads.update({("m", r, w): math_wg(p, r) for r in range(CTAS) for w in range(READERS)})
    waiting = {k: (lambda: True) for k in threads}
    # a bias per seed: one CTA's threads slower than the rest
    slow = rng.choice([None, 0, 1])
    while threads:
        ready = [k for k in threads if waiting[k]()]
        if slow is not None and len(ready) > 1:
            fast = [k for k in ready if k[1] != slow]
            if fast and rng.random() < 0.8:
                ready = fast
        if loads and (not ready or rng.random() < 0.3):
            p.land(*loads.pop(rng.randrange(len(loads))))
            continue
        if not ready:
            return False
        k = min(ready, key=prefer) if prefer else rng.choice(ready)
        try:
            waiting[k] = next(threads[k])
        except StopIteration:
            del threads[k], waiting[k]
        if observe:
            observe(p)
    return not loads


def tiles_of(k_blocks: int, seed: int):
    """Tiles of `k_blocks` k-blocks, each multicast or not by chance (a contiguous pair's tiles
    share B only where both are of one group)."""
    rng = random.Random(seed)
    shared = [rng.random() < 0.5 for _ in range(64)]
    return lambda kb: shared[kb // k_blocks]


# (design, shared operand): "whole" the leader's multicast on every k-block, "split" both
# CTAs' halves, "tiles" the leader's multicast on some tiles and own copies on the others
RIGHT = [("both", "whole"), ("both", "split"), ("both", "tiles"), ("to_leader", "whole")]
WRONG = [("to_leader", "split"), ("to_leader", "tiles")]


def run(stages: int, n: int, design: str, mode: str, seed: int, **kw) -> bool:
    multicast = tiles_of(3, seed) if mode == "tiles" else None
    return simulate(stages, n, design, seed, multicast=multicast, split=mode == "split", **kw)


@pytest.mark.parametrize("design,mode", RIGHT)
@pytest.mark.parametrize("stages,n", [(1, 3), (2, 2), (2, 7), (3, 16), (4, 9), (5, 56)])
def test_the_pair_never_deadlocks_and_reads_what_it_loaded(design, mode, stages, n):
    for seed in range(60):
        assert run(stages, n, design, mode, seed), seed


@pytest.mark.parametrize("design,mode", WRONG)
def test_releasing_to_the_leader_only_fails_where_the_follower_loads_for_itself(design, mode):
    """The follower's barriers count its own warpgroups alone: where it loads a tile's shared
    operand itself, its math runs ahead of the leader's and its releases complete the leader's
    barrier early (a load then lands in a leader stage still read, or the pair stalls); where it
    loads its half into the leader, it overwrites a stage the leader's readers still hold."""
    failures = 0
    for seed in range(60):
        try:
            failures += not run(4, 24, design, mode, seed)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_releasing_only_to_the_own_cta_lets_the_multicast_overwrite_the_follower():
    """The check can fail: with each CTA's barriers counting its own warpgroups alone, the
    leader refills a stage of the follower that its readers still hold."""
    failures = 0
    for seed in range(60):
        try:
            simulate(3, 16, "own", seed)
        except AssertionError as e:
            assert "landed in CTA 1" in str(e) and "before its readers released" in str(e), e
            failures += 1
    assert failures > 0


def test_the_follower_runs_ahead_of_the_leader_only_when_releasing_to_the_leader():
    """With releases to both CTAs the follower's producer never loads more than a ring past
    the last k-block the leader's math released; releasing to the leader only, it may (its
    loads wait for its own math alone)."""
    def max_lead(design: str) -> int:
        lead = [0]

        def observe(p: Pair) -> None:
            lead[0] = max(lead[0], p.issued[1] - p.released[0].count(READERS))

        # the follower's producer first, the leader's math last
        def prefer(k) -> tuple:
            return (k != ("p", 1), k[0] == "m" and k[1] == 0)

        for seed in range(40):
            assert simulate(2, 12, design, seed, prefer, observe)
        return lead[0]

    assert max_lead("both") == 2  # the ring's two stages
    assert max_lead("to_leader") > 2
