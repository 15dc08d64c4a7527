"""Packing and balancing in slime.utils.seqlen_balancing, checked against brute force."""

import itertools
import random


from slime.utils.seqlen_balancing import balanced_partition, micro_batch_schedule, minimum_micro_batches, pack_micro_batches


def test_balanced_partition_is_a_partition_and_near_optimal():
    rng = random.Random(0)
    for _ in range(20):
        weights = [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
        parts = balanced_partition(weights, 3)
        assert sorted(i for p in parts for i in p) == list(range(len(weights)))
        best = min(
            max(sum(w for w, a in zip(weights, assign) if a == g) for g in range(3))
            for assign in itertools.product(range(3), repeat=len(weights))
        )
        got = max(sum(weights[i] for i in p) for p in parts)
        assert got <= best * 4 / 3 + 1e-9  # LPT bound


def test_pack_respects_cap_and_covers_all():
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(0, 12))]
        bins = pack_micro_batches(lengths, 50)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 50 for b in bins)
        assert len(bins) >= max(1, -(-sum(lengths) // 50))


def test_oversized_sample_gets_its_own_micro_batch():
    bins = pack_micro_batches([100, 10, 10], 50)
    assert [0] in bins and all(sum([100, 10, 10][i] for i in b) <= 50 for b in bins if b != [0])


def test_schedule_same_count_on_every_rank():
    rank_lengths = [[40, 40, 40, 40], [5], []]
    schedule = micro_batch_schedule(rank_lengths, max_tokens=50)
    assert len({len(s) for s in schedule}) == 1 and len(schedule[0]) == 4
    assert schedule[2] == [[], [], [], []]
    fixed = micro_batch_schedule([[1, 2, 3], [1]], None, micro_batch_size=2)
    assert fixed == [[[0, 1], [2]], [[0], []]]
    assert minimum_micro_batches([30, 30, 30], 60) == 2


def test_micro_batches_balance_costs_under_the_token_cap():
    lengths, costs = [10, 10, 10, 10], [100.0, 1.0, 100.0, 1.0]
    by_tokens = pack_micro_batches(lengths, 20, 2)
    by_cost = pack_micro_batches(lengths, 20, 2, costs)
    assert by_tokens == [[0, 2], [1, 3]]  # equal tokens, costs 200 vs 2
    assert by_cost == [[0, 1], [2, 3]]  # costs 101 vs 101
    assert all(sum(lengths[i] for i in b) <= 20 for b in by_cost)  # the token cap still holds
    schedule = micro_batch_schedule([lengths, [5]], 20, rank_costs=[costs, [1.0]])
    assert schedule[0] == by_cost and schedule[1] == [[0], []]
