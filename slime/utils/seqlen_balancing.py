"""Token balancing: partitions of samples across data-parallel ranks and micro-batch packing.

* :func:`balanced_partition` — split weighted items into k groups with near-equal weight sums
  (greedy longest-processing-time: heaviest first onto the lightest group). Used for
  ``--balance-data`` (rollouts → DP ranks, by token count).
* :func:`pack_micro_batches` — pack sequence lengths into a given or minimal number of micro-batches
  of at most ``max_tokens`` tokens each (``--max-tokens-per-gpu`` with ``--use-dynamic-batch-size``).
  A single sample longer than the budget gets a micro-batch of its own.
* :func:`micro_batch_schedule` — the per-rank micro-batches of one optimizer step with the *same
  number of micro-batches on every DP rank* (FSDP collectives run once per micro-batch; a rank
  with fewer samples than micro-batches gets empty ones, which the trainer runs as zero-weight
  dummies).

``--balance-by-flops`` passes each sample's training-FLOPs estimate as its cost: partitions and
micro-batches are then balanced by cost while ``max_tokens`` still caps a micro-batch's tokens (the
memory bound). Without costs, the cost of a sample is its token count.

Slow references for the tests are plain enumeration; these functions are pure Python.
"""

from __future__ import annotations

import math

__all__ = ["balanced_partition", "pack_micro_batches", "minimum_micro_batches", "micro_batch_schedule"]


def balanced_partition(weights: list[float], k: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` groups with balanced sums (LPT greedy).

    Ties go to the group with fewer items, then the lower group index, so the result is
    deterministic. Each group's indices are returned in ascending order.
    """
    if k < 1:
        raise ValueError(f"need at least one partition, got k={k}")
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min(range(k), key=lambda g: (loads[g], len(groups[g]), g))
        groups[target].append(index)
        loads[target] += weights[index]
    return [sorted(g) for g in groups]


def minimum_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """Smallest micro-batch count first-fit-decreasing achieves under ``max_tokens`` (≥ 1)."""
    return len(_first_fit_decreasing(lengths, max_tokens)) if lengths else 1


def _first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[index] <= max_tokens:
                bins[b].append(index)
                loads[b] += lengths[index]
                break
        else:
            bins.append([index])
            loads.append(lengths[index])
    return bins


def _pack_into(lengths: list[int], k: int, max_tokens: int, costs: list[float]) -> list[list[int]] | None:
    """Packing into exactly k bins under the token cap, balanced by cost, or None if the greedy fails."""
    bins: list[list[int]] = [[] for _ in range(k)]
    tokens = [0] * k
    loads = [0.0] * k
    for index in sorted(range(len(lengths)), key=lambda i: (-costs[i], -lengths[i], i)):
        n = lengths[index]
        fitting = [b for b in range(k) if tokens[b] + n <= max_tokens or (n > max_tokens and not bins[b])]
        if not fitting:
            return None
        target = min(fitting, key=lambda b: (loads[b], len(bins[b]), b))
        bins[target].append(index)
        tokens[target] += n
        loads[target] += costs[index]
    return bins


def pack_micro_batches(lengths: list[int], max_tokens: int, num_micro_batches: int | None = None,
                       costs: list[float] | None = None) -> list[list[int]]:
    """Pack sample ``lengths`` into micro-batches of ≤ ``max_tokens`` tokens (oversized samples alone),
    balancing the micro-batches' summed ``costs`` (default: the lengths).

    With ``num_micro_batches`` the result has exactly that many micro-batches (some may be empty when
    there are fewer samples); otherwise the smallest count the greedy finds. Micro-batches are ordered
    by their first sample; indices inside a micro-batch ascend.
    """
    if max_tokens is None or max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu must be a positive integer, got {max_tokens}")
    costs = list(lengths) if costs is None else costs
    target = num_micro_batches if num_micro_batches is not None else 0
    lower = max(1, math.ceil(sum(lengths) / max_tokens) if lengths else 1, target)
    bins = None
    for k in range(lower, max(lower, len(lengths)) + 1):
        bins = _pack_into(lengths, k, max_tokens, costs)
        if bins is not None:
            break
    if bins is None:  # every sample alone always fits the rule
        bins = [[i] for i in range(len(lengths))]
    non_empty = sorted((sorted(b) for b in bins if b), key=lambda b: b[0])
    count = len(bins)
    if num_micro_batches is not None:
        if len(non_empty) > num_micro_batches:
            raise ValueError(
                f"cannot pack {len(lengths)} samples into {num_micro_batches} micro-batches of {max_tokens} tokens"
            )
        count = num_micro_batches
    return non_empty + [[] for _ in range(count - len(non_empty))]


def micro_batch_schedule(
    rank_lengths: list[list[int]], max_tokens: int | None = None, micro_batch_size: int = 1,
    rank_costs: list[list[float]] | None = None,
) -> list[list[list[int]]]:
    """Micro-batches (local positions) for every DP rank, with one common micro-batch count.

    Dynamic batching (``max_tokens`` set): count = max over ranks of the minimal packing count; each
    rank's micro-batches balanced by ``rank_costs`` (default: tokens).
    Fixed batching: ``micro_batch_size`` consecutive samples per micro-batch; count = max over
    ranks of ceil(n / micro_batch_size).
    """
    if max_tokens is not None:
        count = max(max(minimum_micro_batches(lengths, max_tokens) for lengths in rank_lengths), 1)
        while True:
            try:
                costs = rank_costs or [None] * len(rank_lengths)
                return [pack_micro_batches(lengths, max_tokens, count, c) for lengths, c in zip(rank_lengths, costs)]
            except ValueError:
                count += 1
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    count = max(max((math.ceil(len(lengths) / micro_batch_size) for lengths in rank_lengths), default=1), 1)
    schedule = []
    for lengths in rank_lengths:
        positions = list(range(len(lengths)))
        chunks = [positions[i : i + micro_batch_size] for i in range(0, len(positions), micro_batch_size)]
        schedule.append(chunks + [[] for _ in range(count - len(chunks))])
    return schedule
