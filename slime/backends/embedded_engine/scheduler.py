"""Continuous-batching policy, in pure Python (no torch): who waits, who runs, who leaves.

Invariant: ``running[i].slot == i``. Running requests occupy cache slots ``0..len(running)-1``
contiguously, so the decode step reads the cache without a gather. When a request leaves, the
last running request moves into its slot; the scheduler returns that move as a
:class:`SlotMove` for the engine to apply to the KV cache.

At every engine step, waiting requests join (FIFO) as long as a slot is free, the request fits a
slot (else it waits until the engine, idle, lengthens the slots) and the step's prefill token budget
allows, then all running requests decode one token together. A full cache therefore
makes new requests wait; they never push running ones out. ``retract_all`` (pause mode
``retract``) sends running requests back to the front of the queue with their output kept; they are
re-prefilled (prompt + output so far) when they rejoin.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from slime.backends.embedded_engine.io_struct import GenerateRequest

ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


@dataclass
class Sequence:
    """A request's state inside the engine."""

    request: GenerateRequest
    max_new_tokens: int  # effective budget (None in the request = what fits the slot)
    on_event: Callable[["Sequence", bool], None] | None = None  # (sequence, finished) -> None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict | None = None
    slot: int | None = None
    num_computed: int = 0  # tokens of fill_ids whose keys/values are in the cache
    num_retractions: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys/values were copied from another request's prefill
    created: float = field(default_factory=time.monotonic)
    admitted: float | None = None  # time.monotonic() of the first admission (end of queueing)
    first_token: float | None = None  # first sampled token (end of prefill)
    finished: float | None = None
    text_cache: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None  # int32 [seqlen - 1 - start, layers, top-k] read at the end (return_routed_experts)
    spec: Any = None  # speculative-decoding state (speculative.SpecState) when the engine speculates

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.input_ids

    @property
    def need(self) -> int:
        """Cache positions the request may hold by its end (prompt + its whole output budget)."""
        return len(self.request.input_ids) + self.max_new_tokens

    @property
    def fill_ids(self) -> list[int]:
        """Tokens that must be in the cache before the next token can be sampled."""
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class SlotMove:
    src: int
    dst: int
    length: int


@dataclass
class SchedulerStats:
    max_running_batch: int = 0  # largest decode batch seen
    joins_while_decoding: int = 0  # requests admitted while others were mid-generation
    decode_steps: int = 0
    prefill_forwards: int = 0
    generated_tokens: int = 0
    # Decode-only accounting (benchmarks: roofline of the decode forward). ``decode_seconds`` is the
    # wall time of the decode forward + sampling (sampling ends in a host copy, so on CUDA the time
    # includes the device work); ``decode_rows`` sums the batch size over decode steps and
    # ``decode_kv_tokens`` the cache positions the running rows hold (their lengths) at each step.
    decode_seconds: float = 0.0
    decode_rows: int = 0
    decode_kv_tokens: int = 0
    # Where the rest of a burst goes: time in prefill (forwards + first-token sampling), time inside
    # engine steps at all (the remainder of a burst's wall time is the engine waiting for requests).
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_shared_rows: int = 0  # requests that took another's prefill (same tokens admitted together)
    busy_seconds: float = 0.0
    # Speculative decoding (speculative/decoder.py): target forwards that verified drafts, drafts proposed
    # and accepted over all requests (decode_steps counts verify forwards too); verify forwards that ran
    # as T-token decode steps (ModelRunner.verify: a CUDA graph on CUDA), the others the generic forward.
    spec_verify_forwards: int = 0
    spec_verify_decode_steps: int = 0
    spec_proposed_drafts: int = 0
    spec_accepted_drafts: int = 0


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int, slot_capacity: int | None = None):
        self.num_slots = num_slots
        self.slot_capacity = slot_capacity  # a request needing longer slots waits (the engine grows them)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def rid_in_flight(self, rid: str) -> bool:
        return any(s.rid == rid for s in list(self.waiting) + self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into free slots (FIFO, bounded by the prefill token budget)."""
        admitted, budget = [], self.max_prefill_tokens
        decoding = any(s.output_ids for s in self.running)
        while self.waiting and len(self.running) < self.num_slots:
            seq = self.waiting[0]
            if self.slot_capacity is not None and seq.need > self.slot_capacity:
                break  # FIFO: it and those behind it wait until the slots are lengthened
            need = len(seq.fill_ids)
            if admitted and need > budget:
                break
            self.waiting.popleft()
            seq.slot = len(self.running)
            seq.num_computed = 0
            self.running.append(seq)
            admitted.append(seq)
            budget -= need
            if decoding:
                self.stats.joins_while_decoding += 1
        return admitted

    def finish(self, seq: Sequence, reason: dict) -> list[SlotMove]:
        """Mark ``seq`` finished and free its slot; return the cache move that keeps slots contiguous."""
        return self.finish_all([(seq, reason)])

    def finish_all(self, finished: list[tuple[Sequence, dict]]) -> list[SlotMove]:
        """Mark each sequence finished and free their slots together; return the cache moves that keep the
        running batch in slots 0..B-1: the survivors beyond the new end fill the freed slots below it, one move
        each (none when the whole batch ends at one step; freeing the rows one by one would move the last row
        into each freed slot, half the batch's cache for rows that are about to be freed too)."""
        leaving = []
        for seq, reason in finished:
            seq.finish_reason = reason
            if seq.slot is None:  # waiting (never ran, or retracted)
                if seq in self.waiting:
                    self.waiting.remove(seq)
            else:
                leaving.append(seq)
        if not leaving:
            return []
        end = len(self.running) - len(leaving)
        gone = {id(seq) for seq in leaving}
        holes = sorted(seq.slot for seq in leaving if seq.slot < end)
        movers = [seq for seq in self.running[end:] if id(seq) not in gone]
        moves = []
        for hole, seq in zip(holes, movers, strict=True):
            moves.append(SlotMove(src=seq.slot, dst=hole, length=seq.num_computed))
            self.running[hole] = seq
            seq.slot = hole
        del self.running[end:]
        for seq in leaving:
            seq.slot = None
        return moves

    def select_abort(self, rid: str | None, abort_all: bool) -> list[Sequence]:
        """Requests an abort applies to: all, or those whose rid starts with ``rid`` (SGLang semantics)."""
        candidates = list(self.waiting) + list(self.running)
        if abort_all:
            return candidates
        if not rid:
            return []
        return [s for s in candidates if s.rid.startswith(rid)]

    def abort_reason(self, seq: Sequence) -> dict:
        return dict(ABORT_WAITING if seq in self.waiting and not seq.output_ids else ABORT_RUNNING)

    def retract_all(self) -> list[SlotMove]:
        """Send every running request back to the front of the queue (its cache is dropped)."""
        for seq in reversed(self.running):
            seq.slot, seq.num_computed = None, 0
            seq.num_retractions += 1
            self.waiting.appendleft(seq)
        self.running = []
        return []
