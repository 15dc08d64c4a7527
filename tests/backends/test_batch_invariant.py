"""Batch-invariant ops (``slime/backends/batch_invariant.py``): each op on its own, then the embedded
engine and the FSDP trainer's log-prob forward on the tiny Qwen3 and a tiny Llama, compared bit for bit
with requests joining and leaving mid-decode, chunked prefill, a weight update and micro-batches of
several splits, with and without autograd. The knob test shows that one changed reduction order (the
engine's GEMM left at ``F.linear``) breaks the equality, so the equality is not by construction.
"""

import shutil

import pytest
import torch

from slime.backends import batch_invariant as bi


def test_a_rows_linear_result_does_not_depend_on_the_rows_around_it():
    torch.manual_seed(0)
    weight, rows = torch.randn(384, 128), torch.randn(300, 128)
    alone = bi.linear(rows[:1], weight)
    for count in (2, 7, 31, 32, 33, 100, 300):
        assert torch.equal(bi.linear(rows[:count], weight)[0], alone[0]), count
    moved = rows[:64].clone()
    moved[45] = rows[0]
    assert torch.equal(bi.linear(moved, weight)[45], alone[0])
    # what the tiles are for: the default GEMM gives a row other bits in a 1-row call than in a batch
    plain = torch.nn.functional.linear
    assert not all(torch.equal(plain(rows[:n], weight)[0], plain(rows[:1], weight)[0]) for n in (2, 7, 33, 300))


def test_tree_sum_ignores_trailing_zero_padding():
    torch.manual_seed(0)
    x = torch.randn(5, 37)
    padded = torch.nn.functional.pad(x, (0, 2048 - 37))
    assert torch.equal(bi.tree_sum(x), bi.tree_sum(padded))
    assert torch.allclose(bi.tree_sum(x), x.sum(-1), atol=1e-5)


def test_attention_of_a_query_is_the_same_over_a_trainer_row_and_a_longer_cache():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 32), torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    rows = bi.attention(q, k, v, causal, 32 ** -0.5)  # [1, 9, 4, 32]: the trainer's row
    cache_k = torch.cat([k, torch.full((1, 2, 100, 32), float("nan"))], dim=2)  # unwritten slots hold anything
    cache_v = torch.cat([v, torch.full((1, 2, 100, 32), float("nan"))], dim=2)
    visible = torch.arange(109).view(1, -1) <= 6  # the decode step of position 6
    step = bi.attention(q[:, :, 6:7], cache_k, cache_v, visible[None, None], 32 ** -0.5)
    assert torch.equal(step[0, 0], rows[0, 6])
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(rows.transpose(1, 2), reference, atol=1e-5)


def test_training_mode_keeps_the_swapped_ops(tiny_model_dir):
    """transformers' ``train()`` resets instance ``forward``s of some layers (RMSNorm): the ops are class swaps."""
    from slime.backends.fsdp_utils.model import load_model

    model = load_model(tiny_model_dir, "actor", bi.register(), 0)
    counts = bi.install(model)
    assert counts["linear"] == 29 and counts["rmsnorm"] == 17 and counts["silu"] == 4, counts
    model.train()
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(3, 128)
    assert torch.equal(norm(x), bi.rms_norm(x, norm.weight, norm.variance_epsilon))


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen3's tokenizer with a Llama of the same sizes (random weights)."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    qwen = AutoConfig.from_pretrained(tiny_model_dir)
    out = tmp_path_factory.mktemp("tiny_llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        try:
            shutil.copy(f"{tiny_model_dir}/{name}", out / name)
        except FileNotFoundError:
            pass
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=qwen.vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=qwen.bos_token_id, eos_token_id=qwen.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return str(out)


def _generate(model_dir, prompts, lengths, perturb=None, order=None, seeded=True, runner=None):
    """Sample with the embedded engine on the batch-invariant ops: 3 requests, 3 more joining at later decode
    steps, rows leaving as their budgets end, prompts prefilled in chunks of 7 tokens. Returns each
    request's (tokens, log-probs) and the engine's runner."""
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner

    if runner is None:  # a finished engine's runner serves the next one: every slot is free again
        runner = ModelRunner(model_dir, device="cpu", num_slots=8, slot_capacity=128, true_on_policy=True)
    if perturb is not None:  # a weight update, as the trainer pushes one
        runner.load_named_tensors(perturb(runner.model).items())
    engine = Engine(runner, chunked_prefill_size=7, seed=0)

    order = list(range(len(prompts))) if order is None else order

    def add(i):
        params = SamplingParams(max_new_tokens=lengths[i], temperature=1.0, ignore_eos=True,
                                sampling_seed=i if seeded else None)
        return engine.add_request(GenerateRequest(rid=str(i), input_ids=prompts[i], params=params), lambda s, f: None)

    seqs = {i: add(i) for i in order[:3]}
    steps = 0
    while engine.scheduler.has_work() or len(seqs) < len(prompts):
        engine.step()
        steps += 1
        if steps in (2, 4, 5) and len(seqs) < len(prompts):
            seqs[order[len(seqs)]] = add(order[len(seqs)])
    assert [len(seqs[i].output_ids) for i in range(len(prompts))] == lengths
    return [(list(seqs[i].output_ids), list(seqs[i].output_logprobs)) for i in range(len(prompts))], runner


def _trainer(model_dir, state=None):
    from slime.backends.fsdp_utils.model import load_model

    model = load_model(model_dir, "actor", bi.register(), 0)
    bi.install(model)
    if state is not None:
        model.load_state_dict(state)
    return model


def _trainer_log_probs(model, prompts, outputs, split, grad=False):
    from slime.backends.fsdp_utils.model import forward_log_probs, pad_samples

    model.train(grad)
    tokens = [torch.tensor(prompts[i] + outputs[i][0]) for i in split]
    packed = pad_samples(tokens, [len(outputs[i][0]) for i in split], "cpu")
    with torch.set_grad_enabled(grad):
        log_probs, _ = forward_log_probs(model, packed, bi.ATTENTION_NAME, 1.0, 2048, exact=True)
    if grad:
        log_probs.sum().backward()  # the same forward feeds a backward
    return log_probs.detach()


def _prompts(model_dir, seed=1):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (n,), generator=generator).tolist() for n in (5, 12, 9, 20, 3, 15)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_engines_log_probs_are_the_trainers_bit_for_bit(arch, request):
    model_dir = request.getfixturevalue("tiny_model_dir" if arch == "qwen3" else "tiny_llama_dir")
    lengths = [6, 3, 10, 4, 8, 5]
    prompts = _prompts(model_dir)
    outputs, _ = _generate(model_dir, prompts, lengths)
    model = _trainer(model_dir)
    for split, grad in (([0, 1, 2, 3, 4, 5], False), ([3, 1, 4], True), ([5], False), ([0, 2], True)):
        engine = torch.tensor([lp for i in split for lp in outputs[i][1]])
        trainer = _trainer_log_probs(model, prompts, outputs, split, grad=grad)
        assert torch.equal(trainer, engine), (split, grad, (trainer - engine).abs().max().item())


def test_exact_after_a_weight_update(tiny_model_dir):
    def perturb(model):
        generator = torch.Generator().manual_seed(5)
        return {name: p.detach() + 0.01 * torch.randn(p.shape, generator=generator)
                for name, p in model.named_parameters()}

    prompts, lengths = _prompts(tiny_model_dir), [6, 3, 10, 4, 8, 5]
    outputs, runner = _generate(tiny_model_dir, prompts, lengths, perturb=perturb)
    state = {name: t.detach().clone() for name, t in runner.model.state_dict().items()}
    trainer = _trainer_log_probs(_trainer(tiny_model_dir, state), prompts, outputs, list(range(6)))
    assert torch.equal(trainer, torch.tensor([lp for out in outputs for lp in out[1]]))


def test_the_default_gemm_on_the_engine_side_breaks_the_equality(tiny_model_dir, monkeypatch):
    prompts, lengths = _prompts(tiny_model_dir), [6, 3, 10, 4, 8, 5]
    monkeypatch.setattr(bi, "TILE_ROWS", None)  # the engine's linear layers as F.linear (1-row steps: a GEMV)
    outputs, _ = _generate(tiny_model_dir, prompts, lengths)
    monkeypatch.setattr(bi, "TILE_ROWS", 32)
    trainer = _trainer_log_probs(_trainer(tiny_model_dir), prompts, outputs, list(range(6)))
    engine = torch.tensor([lp for out in outputs for lp in out[1]])
    gap = (trainer - engine).abs().max().item()
    assert 0 < gap < 1e-4, gap  # a rounding-level difference, but not zero


def test_a_seeded_request_samples_the_same_whatever_batch_and_arrival_order(tiny_model_dir):
    """``--deterministic-mode``'s engine half: per-request seeds on batch-invariant ops make each request's
    tokens and log-probs independent of which requests it decoded with; without the seeds the engine's
    one generator serves the rows in batch order and the draws follow the arrival order."""
    prompts, lengths = _prompts(tiny_model_dir), [6, 3, 10, 4, 8, 5]
    first, runner = _generate(tiny_model_dir, prompts, lengths)
    shuffled, _ = _generate(tiny_model_dir, prompts, lengths, order=[4, 1, 5, 0, 3, 2], runner=runner)
    assert shuffled == first
    unseeded, _ = _generate(tiny_model_dir, prompts, lengths, seeded=False, runner=runner)
    unseeded_shuffled, _ = _generate(tiny_model_dir, prompts, lengths, order=[4, 1, 5, 0, 3, 2], seeded=False,
                                     runner=runner)
    assert [out[0] for out in unseeded] != [out[0] for out in unseeded_shuffled]
