"""The embedded engine serves the hybrid families (Qwen3.5 dense and MoE, Qwen3-Next): gated-DeltaNet linear attention in 3
of 4 layers, its convolution and delta-rule state kept per request in the slot cache beside the keys/values of
the gated softmax-attention layer. On tiny random fp32 checkpoints, against transformers' own model: log-probs
of prefill (whole, chunked, batched with left padding), greedy decoding of a batch whose requests join and leave
(slot moves carry the state), an aborted request's slot reused, shared prompt prefills, weight updates."""

from __future__ import annotations

import threading

import pytest
import torch

from engine_test_utils import hf_logprobs, load_hf
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def dense_dir(tiny_qwen3_5_dir):
    """The scheduling tests run on the dense Qwen3.5 (the MoE variant's layers are the same besides the MLP)."""
    return tiny_qwen3_5_dir


@pytest.fixture(scope="module")
def dense_hf(dense_dir):
    return load_hf(dense_dir)


def test_prefill_whole_chunked_and_padded_equals_hf(model_dir, hf):
    runner = ModelRunner(model_dir, num_slots=4, slot_capacity=64)
    shape = runner.kv_cache.shape
    assert shape.kv_layers == (3,) and shape.linear.layers == (0, 1, 2)  # keys/values in the softmax layer only
    with torch.no_grad():
        reference = hf(torch.tensor([PROMPT])).logits[0].float()
    _, whole = runner.forward([1], [ForwardRow(PROMPT, 0, want_all_logits=True)])
    assert (whole[0] - reference).abs().max() < 1e-4
    # two rows of different lengths (left padding), each prefilled in two chunks from its slot's state
    _, first = runner.forward([0, 2], [ForwardRow(PROMPT[:4], 0, True), ForwardRow(PROMPT[:7], 0, True)])
    _, second = runner.forward([0, 2], [ForwardRow(PROMPT[4:], 4, True), ForwardRow(PROMPT[7:], 7, True)])
    for row in (0, 1):
        assert (torch.cat([first[row], second[row]]) - reference).abs().max() < 1e-4
    # slot 2 now holds a finished prompt's state: a new request there starting at position 0 ignores it
    _, fresh = runner.forward([2], [ForwardRow(PROMPT[:5], 0, True)])
    assert (fresh[0] - reference[:5]).abs().max() < 1e-4


@torch.no_grad()
def assert_greedy_as_hf(model, prompt: list[int], output: list[int], n: int) -> None:
    """``output`` is HF's greedy continuation (each token the argmax of one full forward over prompt + output)
    and the engine's log-probs are HF's: one forward instead of ``n`` generate steps."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].double()
    assert len(output) == n and logits.argmax(-1).tolist() == output, prompt
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output).view(-1, 1)).view(-1).tolist()


def _generate(engine, requests):
    done = [threading.Event() for _ in requests]
    seqs = engine.call(lambda: [engine.add_request(r, lambda s, f, d=d: f and d.set())
                                for r, d in zip(requests, done)]).result(30)
    return seqs, done


def _greedy(rid, prompt, n):
    return GenerateRequest(rid=rid, input_ids=prompt, params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                            ignore_eos=True))


def test_batched_decode_with_requests_joining_and_leaving_equals_hf(dense_dir, dense_hf):
    hf = dense_hf
    runner = ModelRunner(dense_dir, num_slots=6, slot_capacity=64)
    engine = Engine(runner, chunked_prefill_size=8)  # prompts of 11 tokens prefill in chunks
    engine.start()
    try:
        prompts = [PROMPT, [40, 41, 42], PROMPT[:6], [7, 300, 12, 99, 5]]
        lengths = [16, 4, 9, 14]  # rows leave at different steps: the survivors' states move into the holes
        first, first_done = _generate(engine, [_greedy(f"a{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))])
        assert first_done[1].wait(60)  # one has left; two more join the running batch
        joining = [[100, 200, 300, 400, 500, 17, 3, 250, 9, 8], PROMPT]  # the second shares nothing with a running row
        second, second_done = _generate(engine, [_greedy(f"b{i}", p, 12) for i, p in enumerate(joining)])
        # one more, aborted while it decodes: its slot is freed and taken by the next request
        aborted, aborted_done = _generate(engine, [_greedy("c", PROMPT[:3], 40)])
        assert engine.call(lambda: engine.abort("c")).result(10) == 1
        last, last_done = _generate(engine, [_greedy("d", [9, 8, 7, 6], 10)])
        for done in first_done + second_done + aborted_done + last_done:
            assert done.wait(120)
    finally:
        engine.stop()
    for seq, prompt, n in [*zip(first, prompts, lengths), *zip(second, joining, [12, 12]), (last[0], [9, 8, 7, 6], 10)]:
        assert seq.output_logprobs == pytest.approx(assert_greedy_as_hf(hf, prompt, seq.output_ids, n), abs=1e-4)


def test_a_prompt_group_shares_one_prefill_and_samples_apart(dense_dir, dense_hf):
    """n samples of one prompt: one prefill, its state copied to the others' slots; each row's sampled tokens
    have the log-probs HF gives them (a wrong copied state would give other probabilities)."""
    runner = ModelRunner(dense_dir, num_slots=4, slot_capacity=64)
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        requests = [GenerateRequest(rid=f"s{i}", input_ids=PROMPT, params=SamplingParams(
            max_new_tokens=10, temperature=1.0, ignore_eos=True, sampling_seed=i)) for i in range(4)]
        seqs, done = _generate(engine, requests)
        for event in done:
            assert event.wait(60)
        shared = engine.scheduler.stats.prefill_shared_rows
    finally:
        engine.stop()
    assert shared == 3 and len({tuple(s.output_ids) for s in seqs}) > 1
    for seq in seqs:
        assert seq.output_logprobs == pytest.approx(hf_logprobs(dense_hf, PROMPT, seq.output_ids, 1.0), abs=1e-4)


def test_weight_update_reaches_the_linear_attention_layers(model_dir, hf):
    """New weights for every tensor, the gated-DeltaNet ones (conv1d, A_log, dt_bias, in_proj_*) included:
    the engine then decodes as HF does with them."""
    runner = ModelRunner(model_dir, num_slots=2, slot_capacity=64)
    generator = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in hf.state_dict().items()}
    assert any(".linear_attn.A_log" in k for k in new) and any(".linear_attn.conv1d.weight" in k for k in new)
    assert runner.load_named_tensors(new.items()) == len(new)
    updated = load_hf(model_dir)
    updated.load_state_dict(new)
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        (seq,), (done,) = _generate(engine, [_greedy("w", PROMPT, 10)])
        assert done.wait(60)
    finally:
        engine.stop()
    assert seq.output_logprobs == pytest.approx(assert_greedy_as_hf(updated, PROMPT, seq.output_ids, 10), abs=1e-4)
    with pytest.raises(AssertionError):  # the old weights would have decoded something else
        assert_greedy_as_hf(hf, PROMPT, seq.output_ids, 10)


def test_speculative_decoding_is_refused(dense_dir):
    runner = ModelRunner(dense_dir, num_slots=2, slot_capacity=64)
    with pytest.raises(ValueError, match="speculative decoding over linear-attention .* rolled back"):
        Engine(runner, speculative=object())


def test_decode_graphs_captured_while_serving_advance_the_state_once(dense_dir, dense_hf, monkeypatch):
    """A decode graph captured inside a step (a new KV-length bucket) runs its forward twice to warm up before the
    recording, as on CUDA: the rows' linear-attention states are put back, so the replay advances them once and
    the output stays HF's."""
    import types

    from slime.backends.embedded_engine.cuda_graphs import DecodeGraphs, _buckets

    def record(self, forward):  # CUDA's order on the CPU: two eager warm-up forwards, then the graph replays
        forward()
        forward()
        return types.SimpleNamespace(replay=forward)

    monkeypatch.setattr(DecodeGraphs, "_record", record)
    monkeypatch.setattr(ModelRunner, "kernel_attention", property(lambda self: False))  # graphs per KV length
    runner = ModelRunner(dense_dir, num_slots=4, slot_capacity=64)
    runner.graphs.enabled, runner.graphs.batch_buckets = True, _buckets(4)
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        seqs, done = _generate(engine, [_greedy("g0", PROMPT, 24), _greedy("g1", [3, 4, 5], 20)])
        for event in done:
            assert event.wait(60)
    finally:
        engine.stop()
    assert runner.graphs.captures >= 2  # captured while the rows were decoding
    for seq, prompt, n in zip(seqs, [PROMPT, [3, 4, 5]], [24, 20]):
        assert seq.output_logprobs == pytest.approx(assert_greedy_as_hf(dense_hf, prompt, seq.output_ids, n), abs=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_on_cuda_decode_graphs_serve_the_hybrid_model_as_hf(arch, request):
    """On a GPU with the decode CUDA graphs on (fp32, so the comparison is tight): requests joining and leaving
    a running batch decode greedily as transformers' model on the CPU does, log-probs within 1e-3, from
    graph replays that carry each row's convolution and delta-rule state."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = load_hf(model_dir)
    runner = ModelRunner(model_dir, device="cuda", dtype="float32", num_slots=6, slot_capacity=64, cuda_graph=True)
    engine = Engine(runner, chunked_prefill_size=8)
    engine.start()
    try:
        prompts, lengths = [PROMPT, [40, 41, 42], PROMPT[:6]], [16, 4, 12]
        first, first_done = _generate(engine, [_greedy(f"a{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))])
        assert first_done[1].wait(120)
        second, second_done = _generate(engine, [_greedy("b", [9, 8, 7, 6], 10)])
        for done in first_done + second_done:
            assert done.wait(120)
    finally:
        engine.stop()
    assert runner.graphs.captures > 0
    for seq, prompt, n in [*zip(first, prompts, lengths), (second[0], [9, 8, 7, 6], 10)]:
        assert seq.output_logprobs == pytest.approx(assert_greedy_as_hf(hf, prompt, seq.output_ids, n), abs=1e-3)
