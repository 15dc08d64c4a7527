"""Rows that finish at the same step leave the batch together: the scheduler compacts the running batch
once, with the fewest KV-cache moves, and the survivors keep decoding exactly as before."""

from __future__ import annotations

import threading

import pytest

from engine_test_utils import hf_greedy, load_hf
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner
from slime.backends.embedded_engine.scheduler import Scheduler, Sequence, SlotMove

pytestmark = pytest.mark.timeout(120)


def running_batch(n: int) -> tuple[Scheduler, list[Sequence]]:
    sched = Scheduler(num_slots=n, max_prefill_tokens=1024, slot_capacity=64)
    seqs = []
    for i in range(n):
        seq = Sequence(request=GenerateRequest(rid=f"r{i}", input_ids=[1, 2, 3], params=SamplingParams()),
                       max_new_tokens=8)
        seq.slot, seq.num_computed = i, 10 + i
        sched.running.append(seq)
        seqs.append(seq)
    return sched, seqs


def test_a_batch_that_ends_together_moves_no_cache():
    sched, seqs = running_batch(6)
    moves = sched.finish_all([(seq, {"type": "length"}) for seq in seqs])
    assert moves == [] and sched.running == []
    assert all(seq.slot is None and seq.finish_reason == {"type": "length"} for seq in seqs)


def test_survivors_beyond_the_new_end_fill_the_freed_slots_one_move_each():
    sched, seqs = running_batch(6)
    # slots 1, 4 and 5 finish: the new end is 3, slot 1 is the only hole below it, slot 3 the only survivor above
    moves = sched.finish_all([(seqs[i], {"type": "stop"}) for i in (4, 1, 5)])
    assert moves == [SlotMove(src=3, dst=1, length=13)]
    assert sched.running == [seqs[0], seqs[3], seqs[2]]
    assert [seq.slot for seq in sched.running] == [0, 1, 2]
    # one by one, the same three finishes move the last row into each freed slot: row 5's cache twice, though
    # it leaves at the same step
    sched, seqs = running_batch(6)
    one_by_one = [move for i in (4, 1, 5) for move in sched.finish(seqs[i], {"type": "stop"})]
    assert one_by_one == [SlotMove(5, 4, 15), SlotMove(4, 1, 15), SlotMove(3, 1, 13)]


def test_a_waiting_sequence_leaves_the_queue():
    sched, seqs = running_batch(2)
    waiting = Sequence(request=GenerateRequest(rid="w", input_ids=[1], params=SamplingParams()), max_new_tokens=4)
    sched.add(waiting)
    assert sched.finish_all([(waiting, {"type": "abort"}), (seqs[0], {"type": "abort"})]) == [SlotMove(1, 0, 11)]
    assert list(sched.waiting) == [] and sched.running == [seqs[1]]


class CountingRunner(ModelRunner):
    moves = 0  # rows whose cache was moved
    calls = 0  # cache copies issued (each one kernel per buffer on a GPU)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        type(self).moves += 1
        type(self).calls += 1
        super().move_slot(src, dst, length)

    def copy_slots(self, srcs: list[int], dsts: list[int], length: int) -> None:
        type(self).moves += len(srcs)
        type(self).calls += 1
        super().copy_slots(srcs, dsts, length)


def run_greedy(engine, prompts, lengths):
    """Greedy outputs of requests handed to the engine in one command (one prefill, as the server's batch)."""
    events = [threading.Event() for _ in prompts]
    requests = [GenerateRequest(rid=f"q{i}", input_ids=prompt,
                                params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                for i, (prompt, n) in enumerate(zip(prompts, lengths))]
    seqs = engine.call(lambda: [engine.add_request(r, lambda s, f, d=d: f and d.set())
                                for r, d in zip(requests, events)]).result(10)
    for done in events:
        assert done.wait(60)
    return [list(seq.output_ids) for seq in seqs]


def test_rows_ending_together_free_their_slots_without_copies_and_survivors_decode_unchanged(tiny_model_dir):
    hf = load_hf(tiny_model_dir)
    runner = CountingRunner(tiny_model_dir, device="cpu", num_slots=8, slot_capacity=64)
    engine = Engine(runner, chunked_prefill_size=256)
    engine.start()
    try:
        prompts = [[5 + i, 17, 33 + 2 * i, 9] for i in range(6)]
        CountingRunner.moves = CountingRunner.calls = 0
        outputs = run_greedy(engine, prompts, [12] * 6)  # one batch, every row ends at the same step
        assert CountingRunner.moves == 0
        # rows 0, 2 and 4 end first (at the same step), the others decode on in compacted slots
        lengths = [5, 14, 5, 14, 5, 14]
        CountingRunner.moves = CountingRunner.calls = 0
        mixed = run_greedy(engine, prompts, lengths)
        # slots 3 and 5 fill holes 0 and 2 (one indexed copy for both); row 1 stays in place; nothing else moves
        assert (CountingRunner.moves, CountingRunner.calls) == (2, 1)
    finally:
        engine.stop()
    for prompt, n, out, out_mixed in zip(prompts, lengths, outputs, mixed):
        reference = hf_greedy(hf, prompt, 14)
        assert out == reference[:12]
        assert out_mixed == reference[:n]
