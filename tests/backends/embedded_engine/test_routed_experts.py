"""``--enable-return-routed-experts``: the experts the engine reports for each position and MoE layer
are the ones transformers' own forward picks on the same tokens (DeepSeek-V3's and GLM-4.5's sigmoid,
group-limited routers, Qwen3-MoE's and the hybrid Qwen3.5-MoE's softmax top-k), over prefill and decode positions, batched rows
of different lengths, shared prefills, slot moves and ``routed_experts_start_len``; the HTTP answer
is SGLang's wire format, which the rollout's decoder (``Sample``) reads back (``test_moe_models.py``,
whose server runs with the flag)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine_test_utils import load_hf
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner
from slime.utils.moe_routing import hf_routers

pytestmark = pytest.mark.timeout(300)


@torch.no_grad()
def hf_routed_experts(model, tokens: list[int]) -> np.ndarray:
    """Experts transformers' forward picks at every position of ``tokens`` but the last: ``[len − 1,
    layers, k]``, each position's k experts sorted (dense layers zero)."""
    layers, topk = model.config.num_hidden_layers, model.config.num_experts_per_tok
    out = np.zeros((len(tokens), layers, topk), dtype=np.int64)
    handles = []
    for layer, router in hf_routers(model):
        def keep(module, args, output, layer=layer):
            out[:, layer] = output[2].numpy()
        handles.append(router.register_forward_hook(keep))
    try:
        model(torch.tensor([tokens]))
    finally:
        for handle in handles:
            handle.remove()
    return np.sort(out[:-1], axis=-1)


def run_engine(engine: Engine, requests: list[GenerateRequest]):
    done, left = threading.Event(), [len(requests)]

    def on_event(seq, finished):  # on the engine thread
        if finished:
            left[0] -= 1
            if not left[0]:
                done.set()

    seqs = engine.call(lambda: [engine.add_request(r, on_event) for r in requests]).result(30)
    assert done.wait(120)
    return seqs


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "qwen3_moe", "qwen3_5_moe"])
def test_engine_experts_equal_hf_routing(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = load_hf(model_dir)
    runner = ModelRunner(model_dir, num_slots=8, slot_capacity=64, routed_experts=True)
    engine = Engine(runner, chunked_prefill_size=16)  # the 19-token prompt prefills in two chunks
    engine.start()
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10], [11, 12], list(range(100, 119)), [42]]
        lengths = [12, 10, 3, 9, 6]  # different ends: finished rows leave, the last rows move into their slots
        requests = [GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(max_new_tokens=n, temperature=1.0,
                                                                                   ignore_eos=True, sampling_seed=i),
                                    return_routed_experts=True, routed_experts_start_len=3 if i == 3 else 0)
                    for i, (p, n) in enumerate(zip(prompts, lengths))]
        requests.append(GenerateRequest(rid="plain", input_ids=[7, 7, 7], params=SamplingParams(max_new_tokens=4)))
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    assert engine.scheduler.stats.prefill_shared_rows >= 1  # prompts 0 and 1 shared one prefill
    assert seqs[-1].routed_experts is None  # a request that did not ask gets none
    dense = set(range(getattr(hf.config, "first_k_dense_replace", 0)))
    for seq, req in zip(seqs[:-1], requests):
        tokens = req.input_ids + seq.output_ids
        got = seq.routed_experts
        assert got.dtype == np.int32 and got.shape == (len(tokens) - 1 - req.routed_experts_start_len,
                                                       hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
        want = hf_routed_experts(hf, tokens)[req.routed_experts_start_len:]
        np.testing.assert_array_equal(np.sort(got, axis=-1), want, err_msg=f"request {req.rid}")
        for layer in range(hf.config.num_hidden_layers):
            assert (got[:, layer] == 0).all() == (layer in dense)


def test_flag_needs_an_moe_model(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-return-routed-experts needs an MoE model"):
        ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=32, routed_experts=True)


def test_a_server_without_the_flag_answers_without_the_field(tiny_glm4_moe_dir):
    """As SGLang without --enable-return-routed-experts (no capturer): the request is served and its
    meta_info has no routed_experts."""
    from slime.backends.embedded_engine.serving.async_engine import AsyncEngine

    engine = Engine(ModelRunner(tiny_glm4_moe_dir, num_slots=2, slot_capacity=32))
    engine.start()
    try:
        request = GenerateRequest(rid="r", input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3),
                                  return_routed_experts=True, return_logprob=True)
        seq, = run_engine(engine, [request])
        meta = AsyncEngine(engine).meta_info(seq, latency=0.1)
    finally:
        engine.stop()
    assert len(seq.output_ids) == 3 and len(meta["output_token_logprobs"]) == 3
    assert "routed_experts" not in meta


@pytest.mark.gpu
def test_cuda_graph_decode_records_the_experts(tiny_deepseek_v3_dir):
    """On CUDA the decode steps replay graphs captured with the recording in them (and run one step
    ahead): the experts still equal transformers' on every position."""
    hf = load_hf(tiny_deepseek_v3_dir)
    runner = ModelRunner(tiny_deepseek_v3_dir, device="cuda", dtype="float32", num_slots=4, slot_capacity=64,
                         routed_experts=True)
    assert runner.graphs.enabled
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [42]]
        requests = [GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(max_new_tokens=20 - 4 * i, temperature=0,
                                                                                   ignore_eos=True),
                                    return_routed_experts=True) for i, p in enumerate(prompts)]
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    assert runner.graphs.captures > 0  # the decode steps ran as graphs
    for seq, req in zip(seqs, requests):
        np.testing.assert_array_equal(np.sort(seq.routed_experts, axis=-1),
                                      hf_routed_experts(hf, req.input_ids + seq.output_ids))


def test_speculative_verify_steps_record_the_accepted_tokens_experts(tiny_deepseek_v3_dir, tmp_path):
    """NEXTN speculation (a "Markov" DeepSeek-V3 whose MTP layer drafts exactly, so most drafts are
    accepted): positions filled by verify forwards — accepted drafts, rejected ones overwritten later
    — report the experts of the tokens finally there."""
    from engine_test_utils import markov_checkpoint
    from slime.backends.embedded_engine.speculative.mtp import NextNDrafter
    from slime.backends.embedded_engine.speculative.decoder import SpeculativeConfig, SpeculativeDecoder

    model_dir = markov_checkpoint(tiny_deepseek_v3_dir, tmp_path / "markov", "exact", 0.03)
    hf = load_hf(model_dir)
    runner = ModelRunner(model_dir, num_slots=4, slot_capacity=64, routed_experts=True)
    engine = Engine(runner, speculative=SpeculativeDecoder(SpeculativeConfig("NEXTN", 4), NextNDrafter(runner, 64)), seed=1)
    engine.start()
    try:
        prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11]]
        requests = [GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(max_new_tokens=14, temperature=1.0,
                                                                                   ignore_eos=True),
                                    return_routed_experts=True) for i, p in enumerate(prompts)]
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    stats = engine.scheduler.stats
    assert stats.spec_accepted_drafts > 0 and stats.spec_accepted_drafts < stats.spec_proposed_drafts, vars(stats)
    for seq, req in zip(seqs, requests):
        np.testing.assert_array_equal(np.sort(seq.routed_experts, axis=-1),
                                      hf_routed_experts(hf, req.input_ids + seq.output_ids))
