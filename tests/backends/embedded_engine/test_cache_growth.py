"""The engine's KV cache is sized by demand: short slots at start, lengthened (while nothing runs)
when a request needs more, within the token budget. Requests never fail or lose tokens for it."""

from __future__ import annotations

import threading

import pytest

from engine_test_utils import hf_greedy, load_hf
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(120)


class ShortSlotsRunner(ModelRunner):
    INITIAL_SLOT_CAPACITY = 16  # the tiny model's requests outgrow it at once
    SLOT_GRANULARITY = 16
    OPEN_REQUEST_LENGTH = 100


@pytest.fixture()
def engine(tiny_model_dir):
    runner = ShortSlotsRunner(tiny_model_dir, device="cpu", num_slots=8, max_total_tokens=256)
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    yield engine
    engine.stop()


def submit(engine, rid, prompt, max_new_tokens):
    done = threading.Event()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=max_new_tokens is not None)
    request = GenerateRequest(rid=rid, input_ids=prompt, params=params)
    seq = engine.call(lambda: engine.add_request(request, lambda s, finished: finished and done.set())).result(10)
    return seq, done


def test_initial_cache_holds_short_slots_within_the_budget(tiny_model_dir):
    runner = ShortSlotsRunner(tiny_model_dir, device="cpu", num_slots=8, max_total_tokens=256)
    assert (runner.kv_cache.shape.num_slots, runner.kv_cache.shape.slot_capacity) == (8, 16)
    assert runner.context_length == 256  # the budget caps the longest request
    assert runner.kv_cache.nbytes() == 8 * 16 * runner.kv_cache.shape.bytes_per_token(runner.dtype)
    with pytest.raises(ValueError, match="--max-total-tokens 100 is smaller than one request of --context-length 200"):
        ShortSlotsRunner(tiny_model_dir, device="cpu", num_slots=8, slot_capacity=200, max_total_tokens=100)


def test_long_request_waits_for_the_batch_then_slots_grow(engine, tiny_model_dir):
    hf = load_hf(tiny_model_dir)
    short = [submit(engine, f"short{i}", [5 + i, 6, 7], 8) for i in range(3)]  # need 11 <= 16: fit at once
    long_prompt = list(range(20, 40))
    long_seq, long_done = submit(engine, "long", long_prompt, 30)  # needs 50 tokens: slots of 64 (steps of 16)
    after = submit(engine, "after", [9, 9], 4)  # queued behind the long one (FIFO)
    for seq, done in short + [(long_seq, long_done), after]:
        assert done.wait(60), seq.rid
    for i, (seq, _) in enumerate(short):
        assert seq.output_ids == hf_greedy(hf, [5 + i, 6, 7], 8)
        assert seq.finished < long_seq.admitted  # the long request joined only once the batch was done
    assert long_seq.output_ids == hf_greedy(hf, long_prompt, 30)
    assert after[0].output_ids == hf_greedy(hf, [9, 9], 4)
    shape = engine.runner.kv_cache.shape
    assert (shape.slot_capacity, shape.num_slots) == (64, 4)  # 256-token budget / 64-token slots
    assert (engine.scheduler.slot_capacity, engine.scheduler.num_slots) == (64, 4)
    # the next short requests run in the grown slots; more of them than slots just queue
    more = [submit(engine, f"m{i}", [3, 4, i + 1], 5) for i in range(6)]
    for seq, done in more:
        assert done.wait(60)
        assert seq.output_ids == hf_greedy(hf, seq.prompt_ids, 5)
    assert engine.runner.kv_cache.shape.slot_capacity == 64  # grows only


def test_open_request_gets_the_open_length_not_the_context(engine):
    seq, done = submit(engine, "open", [5, 6, 7], None)
    assert done.wait(60)
    assert seq.max_new_tokens == ShortSlotsRunner.OPEN_REQUEST_LENGTH - 3
    assert engine.runner.kv_cache.shape.slot_capacity == 112  # what the 100 tokens need, in steps of 16


def test_request_longer_than_the_context_is_refused_by_the_server_checks(tiny_model_dir):
    from slime.backends.embedded_engine.io_struct import RequestError, parse_generate

    runner = ShortSlotsRunner(tiny_model_dir, device="cpu", num_slots=8, max_total_tokens=256)
    with pytest.raises(RequestError, match="context length"):
        parse_generate({"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 1}},
                       None, runner.vocab_size, runner.context_length)


def test_a_burst_of_requests_is_prefilled_in_few_forwards(engine, tiny_model_dir):
    """Requests arriving a millisecond apart while others decode join in a few prefills, not one
    prefill each; none waits longer than the gathering bound and the outputs stay exact."""
    import time

    hf = load_hf(tiny_model_dir)
    first, first_done = submit(engine, "first", [5, 6, 7], 10)
    before = engine.scheduler.stats.prefill_forwards
    burst = []
    for i in range(6):
        burst.append(submit(engine, f"b{i}", [7, 8, i + 1], 6))
        time.sleep(0.001)
    for seq, done in [(first, first_done)] + burst:
        assert done.wait(60)
        assert seq.output_ids == hf_greedy(hf, seq.prompt_ids, seq.max_new_tokens)
    assert engine.scheduler.stats.prefill_forwards - before <= 3  # (6 without gathering)
    for seq, _ in burst:
        assert seq.admitted - seq.created < Engine.ADMIT_MAX_WAIT_S + 0.5  # bounded wait (slack for a busy CI)
