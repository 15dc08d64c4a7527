"""The speculative verify step as a decode step of T tokens a row (``ModelRunner.verify`` /
``decode_forward`` with ``[B, T]`` inputs): its logits and hidden states equal the generic forward's on
the same rows, on the CPU path and, under Triton's interpreter, on the CUDA path (the fused q/k-norm +
rotary kernel writing each token's keys and values, the T-token flash-decoding kernel); on CUDA
(``gpu``) through its CUDA graphs against the eager forward."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

from slime.backends.embedded_engine.kv_cache import DecodeCacheView
from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner

needs_interpreter = pytest.mark.skipif(  # scripts/test.sh runs these again with TRITON_INTERPRET=1
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")

PROMPTS = [[5, 17, 33, 2, 91, 40], [7, 7, 8], [60, 1, 2, 3, 4, 5, 6, 9, 11, 12, 13]]
# each row's last token and drafts; row 1 has fewer drafts than the step's width (padded after them)
STEP = [[3, 44, 12, 9], [8, 100], [14, 2, 2, 71]]
WIDTH = 4


def prefilled(runner: ModelRunner) -> list[int]:
    """The prompts (less their last token, which the verify step feeds) prefilled in slots 0..2."""
    runner.forward([0, 1, 2], [ForwardRow(p[:-1], 0) for p in PROMPTS])
    return [len(p) - 1 for p in PROMPTS]


def generic(runner: ModelRunner, starts: list[int], step=STEP):
    """What the engine's verify step computed before: the generic forward over the real tokens."""
    rows = [ForwardRow([p[-1]] + s[1:], start, want_all_logits=True) for p, s, start in zip(PROMPTS, step, starts)]
    _, logits, hidden = runner.forward_with_hidden([0, 1, 2], rows)
    return logits, hidden


def verified(runner: ModelRunner, starts: list[int], step=STEP):
    tokens = [[p[-1]] + s[1:] for p, s in zip(PROMPTS, step)]
    assert runner.can_verify(starts, WIDTH)
    logits, hidden = runner.verify([t + [0] * (WIDTH - len(t)) for t in tokens], starts, with_hidden=True)
    assert logits.shape == (3, WIDTH, runner.vocab_size) and hidden.shape[:2] == (3, WIDTH)
    return [logits[i, : len(t)] for i, t in enumerate(tokens)], [hidden[i, : len(t)] for i, t in enumerate(tokens)]


def assert_same_step(want, got, tol):
    for (w_logits, w_hidden), (g_logits, g_hidden) in zip(zip(*want), zip(*got)):
        torch.testing.assert_close(g_logits, w_logits, atol=tol, rtol=tol)
        torch.testing.assert_close(g_hidden.float(), w_hidden.float(), atol=tol, rtol=tol)


def check_against_the_generic_forward(model_dir: str, tol: float) -> ModelRunner:
    """A verify step on the CPU path against the generic forward over the same rows (fp32): every real
    token's logits and hidden states, and what it cached (the padding's positions lie past them)."""
    reference, runner = (ModelRunner(model_dir, num_slots=4, slot_capacity=32) for _ in range(2))
    starts = prefilled(reference)
    assert prefilled(runner) == starts
    assert_same_step(generic(reference, starts), verified(runner, starts), tol)
    for layer in range(len(runner.kv_cache.keys)):
        for slot, (start, step) in enumerate(zip(starts, STEP)):
            end = start + len(step)
            torch.testing.assert_close(runner.kv_cache.keys[layer][slot, :, :end],
                                       reference.kv_cache.keys[layer][slot, :, :end], atol=1e-5, rtol=1e-5)
    return runner


def test_verify_step_equals_the_generic_forward(tiny_model_dir):
    """fp32 on the CPU path (matmul attention over [B, T] queries): rows of different lengths, one with
    fewer drafts than the step's width; every real token's logits and hidden states as the generic
    forward's, and the keys/values it cached the same. A step whose padding would pass a slot's end is
    refused (the engine then runs the generic forward)."""
    runner = check_against_the_generic_forward(tiny_model_dir, 1e-5)
    assert not runner.can_verify([32 - WIDTH + 1, 0, 0], WIDTH) and runner.can_verify([32 - WIDTH, 0, 0], WIDTH)


def test_mla_verify_step_equals_the_generic_forward(tiny_deepseek_v3_dir):
    """Multi-latent attention (DeepSeek-V3, MoE): the verify step runs through the absorbed decode with
    T query tokens a row over the compressed-latent cache; logits and hidden states equal the generic
    forward's (transformers' expanded attention) in fp32, and the cached latents the same. With
    ``--mla-decode expanded`` the runner keeps the generic forward for verify steps."""
    runner = check_against_the_generic_forward(tiny_deepseek_v3_dir, 1e-4)
    assert runner.mla_layers and runner.verify_decode
    expanded = ModelRunner(tiny_deepseek_v3_dir, num_slots=4, slot_capacity=32, mla_decode="expanded")
    assert not expanded.can_verify([0, 0, 0], WIDTH)


@needs_interpreter
def test_verify_step_on_the_cuda_path_interpreted_equals_the_generic_forward(tiny_model_dir, monkeypatch):
    """The kernels a verify step runs on CUDA, on the CPU (interpreted, fp32): the fused q/k-norm + rotary
    kernel writes every token's key and value at its own slot and position, the T-token flash-decoding
    kernel reads them; the logits and hidden states equal the plain CPU runner's generic forward."""
    from slime.backends.embedded_engine.kernels import fused_ops

    writes = []

    def target(view, layer_idx):  # what DecodeCacheView offers on CUDA
        writes.append((layer_idx, view.tokens))
        cache = view.cache
        return (cache.keys[layer_idx], cache.values[layer_idx], view.slots, view.positions, cache.k_scales[layer_idx],
                cache.v_scales[layer_idx])

    reference = ModelRunner(tiny_model_dir, num_slots=4, slot_capacity=32)
    starts = prefilled(reference)
    want = generic(reference, starts)
    runner = ModelRunner(tiny_model_dir, num_slots=4, slot_capacity=32)
    prefilled(runner)
    runner.attention_backend = "triton"  # decode: per-row lengths + the flash-decoding kernel (interpreted)
    for module in runner.model.modules():
        if hasattr(module, "qkv_proj"):
            module.fused_norm_rope = types.MethodType(fused_ops._attention_norm_rope, module)
    monkeypatch.setattr(DecodeCacheView, "fused_write_target", target, raising=False)
    got = verified(runner, starts)
    assert writes == [(layer, WIDTH) for layer in range(runner.model.config.num_hidden_layers)]
    assert_same_step(want, got, 2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.15)])
def test_graphed_verify_step_equals_the_eager_forward_on_cuda(tiny_model_dir, dtype, tol):
    """On CUDA: the verify step replayed from its CUDA graph (batch bucket 4 for 3 rows: a padding row in a
    free slot; replayed twice, the second time for other drafts) against the generic eager forward of
    the same rows in a second runner; fp32 to rounding, bf16 within bf16 logit noise, the argmax equal."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reference, runner = (ModelRunner(tiny_model_dir, device="cuda", dtype=dtype, num_slots=8, slot_capacity=256)
                         for _ in range(2))
    assert runner.graphs.enabled and runner.attention_backend == "triton"
    starts = prefilled(reference)
    prefilled(runner)
    for step in (STEP, [[3, 9, 9, 9], [8], [14, 1, 2, 3]]):  # then other drafts: the same graph, new inputs
        want = generic(reference, starts, step)
        got = verified(runner, starts, step)
        assert_same_step(want, got, tol)
        for w, g in zip(want[0], got[0]):
            assert torch.equal(w.argmax(-1), g.argmax(-1)) or dtype == "bfloat16"
    assert runner.graphs.verify_captures == 1


def test_verify_steps_through_the_graph_bookkeeping_keep_greedy_outputs(tiny_model_dir, monkeypatch):
    """The engine's CUDA graph path on the CPU, a graph replaced by a replay of the forward it recorded
    (``DecodeGraphs._record``): decode and verify steps go through the static input buffers, batch
    buckets with padding rows in free slots, KV-length buckets longer than the step needs and the shared
    output buffers. NGRAM greedy outputs equal the plain engine's, and verify graphs were captured per
    (batch bucket, KV bucket) and replayed with other inputs."""
    from engine_test_utils import generate_in_engine, replay_graph_forwards
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import SamplingParams
    from slime.backends.embedded_engine.cuda_graphs import _buckets
    from slime.backends.embedded_engine.speculative.decoder import SpeculativeConfig, SpeculativeDecoder

    replays = replay_graph_forwards(monkeypatch)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(5)]
    params = [SamplingParams(max_new_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]

    def run(spec: bool):
        runner = ModelRunner(tiny_model_dir, num_slots=8)
        runner.graphs.enabled, runner.graphs.batch_buckets = True, _buckets(8)  # as on CUDA
        speculative = SpeculativeDecoder(SpeculativeConfig("NGRAM", 4)) if spec else None
        engine = Engine(runner, speculative=speculative, seed=1)
        engine.start()
        try:
            return [s.output_ids for s in generate_in_engine(engine, prompts, params)], runner, \
                dict(vars(engine.scheduler.stats))
        finally:
            engine.stop()

    plain, plain_runner, _ = run(False)
    outputs, runner, stats = run(True)
    assert outputs == plain
    graphs = runner.graphs
    assert stats["spec_verify_decode_steps"] == stats["spec_verify_forwards"] > graphs.verify_captures > 0
    assert {key[0] for key in graphs.verify_graphs} >= {8, 4} and all(key[2] == 4 for key in graphs.verify_graphs)
    assert replays.count(runner) == stats["spec_verify_forwards"]  # every verify step a replay
    assert plain_runner.graphs.captures > 0 and replays.count(plain_runner) > plain_runner.graphs.captures


def test_rows_running_to_their_slots_end_verify_in_windows_inside_the_slot(tiny_model_dir, monkeypatch):
    """Requests that fill their 32-token slots exactly: in the last steps a row's T tokens padded after its
    drafts would pass the slot's end, so its window ends at its last draft and starts with its own previous
    tokens (recomputed in place). Every verify step still runs as the decode step, every write inside the
    slot (no index error), and the greedy outputs and their log-probs equal the plain engine's."""
    from engine_test_utils import generate_in_engine
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import SamplingParams
    from slime.backends.embedded_engine.speculative.decoder import SpeculativeConfig, SpeculativeDecoder

    prompts = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(4)]
    params = [SamplingParams(max_new_tokens=32 - len(p), temperature=0.0, ignore_eos=True) for p in prompts]
    shifted = []
    windows = SpeculativeDecoder._windows

    def recording(self, runner, running, rows):
        out = windows(self, runner, running, rows)
        shifted.extend(o for o in (out[2] if out else []) if o)
        return out

    monkeypatch.setattr(SpeculativeDecoder, "_windows", recording)

    def run(spec: bool):
        runner = ModelRunner(tiny_model_dir, num_slots=4, slot_capacity=32)
        assert runner.kv_cache.shape.slot_capacity == 32
        engine = Engine(runner, speculative=SpeculativeDecoder(SpeculativeConfig("NGRAM", 5)) if spec else None, seed=1)
        engine.start()
        try:
            seqs = generate_in_engine(engine, prompts, params)
            return [s.output_ids for s in seqs], [s.output_logprobs for s in seqs], dict(vars(engine.scheduler.stats))
        finally:
            engine.stop()

    plain, plain_logprobs, _ = run(False)
    outputs, logprobs, stats = run(True)
    assert outputs == plain and [len(o) for o in outputs] == [32 - len(p) for p in prompts]
    for want, got in zip(plain_logprobs, logprobs):  # the last tokens' too: the recomputed keys are the right ones
        assert got == pytest.approx(want, abs=1e-5)
    assert stats["spec_verify_decode_steps"] == stats["spec_verify_forwards"] > 0
    assert shifted  # some rows' windows ended at their last draft


def test_moe_graphs_capture_the_experts_through_batched_mm_outside_bfloat16(tiny_glm4_moe_dir, monkeypatch):
    """torch's grouped GEMM has a CUDA kernel for bfloat16 only; in fp32 it falls back to a loop that
    copies the group offsets to the host, which a CUDA graph capture refuses (the fp32 engine's first MoE
    decode graph failed that way on the H200). The decode and verify graphs of a MoE model in fp32 are
    therefore recorded with the experts through ``batched_mm``, prefill keeps ``grouped_mm``, and a
    bfloat16 model keeps ``grouped_mm`` everywhere. Here the graph is the recorded forward replayed with
    the experts implementation it was recorded under (a graph keeps the kernels it captured): NGRAM greedy
    outputs equal the plain eager engine's."""
    from engine_test_utils import generate_in_engine
    from slime.backends.embedded_engine.cuda_graphs import DecodeGraphs, _buckets
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import SamplingParams
    from slime.backends.embedded_engine.speculative.decoder import SpeculativeConfig, SpeculativeDecoder

    recorded = []

    def record(self, forward):
        model, implementation = self.runner.model, self.runner.config._experts_implementation
        recorded.append(implementation)

        def replay():
            previous = self.runner.config._experts_implementation
            model.set_experts_implementation(implementation)
            try:
                forward()
            finally:
                model.set_experts_implementation(previous)
        return types.SimpleNamespace(replay=replay)

    monkeypatch.setattr(DecodeGraphs, "_record", record)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(4)]
    params = [SamplingParams(max_new_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(4)]

    def run(graphs: bool):
        runner = ModelRunner(tiny_glm4_moe_dir, num_slots=4)
        if graphs:
            runner.graphs.enabled, runner.graphs.batch_buckets = True, _buckets(4)  # as on CUDA
        engine = Engine(runner, speculative=SpeculativeDecoder(SpeculativeConfig("NGRAM", 4)), seed=1)
        engine.start()
        try:
            return [s.output_ids for s in generate_in_engine(engine, prompts, params)], runner
        finally:
            engine.stop()

    plain, _ = run(False)
    graphed, runner = run(True)
    assert runner.has_experts and runner.graphs.verify_captures > 0 and runner.graphs.captures > runner.graphs.verify_captures
    assert recorded and set(recorded) == {"batched_mm"}, recorded
    assert runner.config._experts_implementation == "grouped_mm"  # prefill and eager steps
    assert graphed == plain

    bf16 = ModelRunner(tiny_glm4_moe_dir, dtype="bfloat16", num_slots=2)
    with bf16.capturable_experts():
        assert bf16.config._experts_implementation == "grouped_mm"


def test_moe_models_are_recognised_without_the_newer_expert_parallel_attribute(tiny_glm4_moe_dir, tiny_deepseek_v3_dir,
                                                                                 tiny_model_dir):
    """The H200's transformers (5.17) marks expert modules with ``has_gate`` / ``has_bias`` /
    ``is_transposed`` but not ``_is_expert_parallel`` (added later): detecting experts by the latter left
    the fp32 MoE graphs on grouped_mm there and every capture failed. Strip it, as 5.17 has it: still
    recognised; a dense model is not."""
    from slime.backends.embedded_engine.model_runner import ModelRunner

    for path in (tiny_glm4_moe_dir, tiny_deepseek_v3_dir):
        runner = ModelRunner(path, num_slots=1)
        for module in runner.model.modules():
            if "_is_expert_parallel" in vars(module):
                del module._is_expert_parallel
        assert not any(hasattr(m, "_is_expert_parallel") for m in runner.model.modules())
        assert runner.has_experts, path
    assert not ModelRunner(tiny_model_dir, num_slots=1).has_experts
