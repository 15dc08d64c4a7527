"""The decode graphs' bookkeeping (``cuda_graphs.DecodeGraphs``) on the CPU, each graph replaced by a replay of
the forward it recorded: which graphs exist, when they are captured, and that steps through them decode what
eager steps decode."""

from __future__ import annotations

import pytest

from slime.backends.embedded_engine.cuda_graphs import _buckets
from slime.backends.embedded_engine.model_runner import ModelRunner


@pytest.fixture
def replayed_graphs(monkeypatch):
    """Graphs replaced by replays of the forward they recorded (the CPU has no CUDA graphs); the list counts
    the replays."""
    from engine_test_utils import replay_graph_forwards

    return replay_graph_forwards(monkeypatch)


def run_engine(runner, prompts, params):
    from engine_test_utils import generate_in_engine
    from slime.backends.embedded_engine.engine import Engine

    engine = Engine(runner, seed=1)
    engine.start()
    try:
        return [s.output_ids for s in generate_in_engine(engine, prompts, params)]
    finally:
        engine.stop()


def test_length_free_graphs_are_captured_ahead_and_serve_every_length(tiny_model_dir, monkeypatch, replayed_graphs):
    """Where attention is the flash-decoding kernel (``ModelRunner.kernel_attention``), a decode graph reads the
    whole slot and the kernel stops at each row's own length: one graph per batch bucket, all recorded before
    the first request (``capture_ahead``). Requests whose lengths span four KV-length buckets of a per-length capture
    then decode without one more capture, every step a replay; a request longer than the slots grows the cache,
    which records the graphs again at the new capacity. Greedy outputs equal an engine without graphs."""
    from slime.backends.embedded_engine.io_struct import SamplingParams

    monkeypatch.setattr(ModelRunner, "kernel_attention", property(lambda self: True))  # the CUDA default
    monkeypatch.setattr(ModelRunner, "INITIAL_SLOT_CAPACITY", 192)
    short = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(5)]  # up to 14 + 150 tokens: fits 192
    short_params = [SamplingParams(max_new_tokens=150 - 20 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    long = [[11, 12, 13, 40, 41]]
    long_params = [SamplingParams(max_new_tokens=230, temperature=0.0, ignore_eos=True)]  # 235 > 192: grows

    eager = ModelRunner(tiny_model_dir, num_slots=8, cuda_graph=False)
    want = run_engine(eager, short, short_params), run_engine(eager, long, long_params)

    runner = ModelRunner(tiny_model_dir, num_slots=8)
    graphs = runner.graphs
    graphs.enabled, graphs.batch_buckets = True, _buckets(8)  # as on CUDA, where __init__ captures them itself
    graphs.capture_ahead()
    assert sorted(graphs.graphs) == [(1, 192), (2, 192), (4, 192), (8, 192)] and graphs.captures == 4
    graphs.capture_ahead()  # nothing left to record
    assert graphs.captures == 4
    assert run_engine(runner, short, short_params) == want[0]
    assert graphs.captures == 4, "a step captured a graph while serving"
    assert len(replayed_graphs) >= 150 - 4 * 2  # the decode steps replayed graphs (the 150-token request's ~149)
    assert run_engine(runner, long, long_params) == want[1]
    capacity = runner.kv_cache.shape.slot_capacity
    assert capacity > 192 and sorted(graphs.graphs) == [(b, capacity) for b in (1, 2, 4, 8)]
    assert graphs.captures == 8


def test_dense_attention_graphs_stay_lazy_per_kv_length_bucket(tiny_model_dir, replayed_graphs):
    """Without the kernel (the CPU's matmul attention reads a dense window), a graph is keyed by batch bucket
    and KV-length bucket and captured when a step first needs it; nothing is recorded ahead."""
    from slime.backends.embedded_engine.io_struct import SamplingParams

    runner = ModelRunner(tiny_model_dir, num_slots=8)
    assert not runner.kernel_attention
    runner.graphs.enabled, runner.graphs.batch_buckets = True, _buckets(8)
    runner.graphs.capture_ahead()
    assert runner.graphs.captures == 0
    run_engine(runner, [[5, 6, 7]], [SamplingParams(max_new_tokens=140, temperature=0.0, ignore_eos=True)])
    assert sorted(runner.graphs.graphs) == [(1, 128), (1, 160)]  # 3 + 140 tokens: two buckets of one row


def test_chosen_batch_sizes_are_the_graphs_and_larger_batches_run_eagerly(tiny_model_dir, monkeypatch, replayed_graphs):
    """``--cuda-graph-bs 2 6`` (SGLang's ``--cuda-graph-bs-decode``): graphs for exactly those batch sizes, captured
    ahead; a batch of 1 pads to 2, one of 3-6 pads to 6, a batch of 7 or 8 runs eagerly (no graph of its own); sizes
    past the slots are dropped. Greedy outputs equal an engine without graphs."""
    from slime.backends.embedded_engine.cuda_graphs import _buckets
    from slime.backends.embedded_engine.io_struct import SamplingParams

    assert _buckets(8, [6, 2, 2, 64]) == [2, 6] and _buckets(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="--cuda-graph-bs 16 32: no batch size is within 1..8"):
        _buckets(8, [16, 32])
    monkeypatch.setattr(ModelRunner, "kernel_attention", property(lambda self: True))
    prompts = [[5 + i, 6, 7, 8] for i in range(8)]
    params = [SamplingParams(max_new_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    want = run_engine(ModelRunner(tiny_model_dir, num_slots=8, cuda_graph=False), prompts, params)
    runner = ModelRunner(tiny_model_dir, num_slots=8)
    graphs = runner.graphs
    graphs.enabled, graphs.batch_buckets = True, _buckets(8, [2, 6, 64])
    graphs.capture_ahead()
    capacity = runner.kv_cache.shape.slot_capacity
    assert sorted(graphs.graphs) == [(2, capacity), (6, capacity)] and graphs.captures == 2
    assert run_engine(runner, prompts, params) == want
    assert graphs.captures == 2
    assert graphs.can_run(6, [10] * 6) and graphs.can_run(1, [10]) and not graphs.can_run(7, [10] * 7)
