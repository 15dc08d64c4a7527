"""The shared log-prob head inside the FSDP2 model: sharded, tied embeddings, chunked rows."""

import pytest
import torch

from slime.algorithms import functional as algo


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fsdp_sharded_tied_head_matches_plain_hf_model(tiny_model_dir, layout):
    """Through the FSDP2 trainer (sharded, tied embeddings, chunks of 3 rows), in both micro-batch
    layouts (right-padded rows with causal attention, the trainer's sdpa default; one packed row with
    a block-diagonal mask): log-probs, entropy and every parameter's gradient equal a plain HF model
    with the full-vocabulary log-softmax, sample by sample."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.model import forward_log_probs, pack_samples, pad_samples
    from slime.backends.training.worker import TrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import full_grads, make_args, make_samples, rank_data

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--log-probs-chunk-size", "3", rbs=3)
    worker = TrainWorker(args)
    worker.init()
    assert worker.backend.chunk_rows == 3
    assert type(worker.backend.model.lm_head.weight).__name__ == "DTensor" and worker.backend.model.config.tie_word_embeddings
    data = rank_data(args, make_samples(6))
    build = pad_samples if layout == "padded" else pack_samples
    packed = build(list(data.tokens), [int(r) for r in data.response_lengths], worker.backend.device)
    assert packed.padded is (layout == "padded") and worker.backend.attn_implementation == "sdpa"
    if layout == "padded":  # lengths differ: rows of one width, padding after each sample's tokens
        assert packed.input_ids.shape == (6, max(len(t) for t in data.tokens))
    log_probs, entropy = forward_log_probs(worker.backend.model, packed, worker.backend.attn_implementation, 0.7, 3, entropy_grad=True)
    coef = torch.linspace(-1.0, 1.0, log_probs.numel())
    worker.backend.optimizer.zero_grad(set_to_none=True)
    ((coef * log_probs).sum() + (coef.flip(0) * entropy).sum()).backward()
    grads = full_grads(worker.backend.model)
    worker.backend.optimizer.zero_grad(set_to_none=True)

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref_lp, ref_h = [], []
    for tokens, r in zip(data.tokens, data.response_lengths):
        logits = reference(tokens[None]).logits[0]
        rows = logits[len(tokens) - int(r) - 1 : len(tokens) - 1]
        ref_lp.append(algo.compute_log_probs(rows, tokens[-int(r):], 0.7))
        ref_h.append(algo.compute_entropy(rows, 0.7))
    ref_lp, ref_h = torch.cat(ref_lp), torch.cat(ref_h)
    ((coef * ref_lp).sum() + (coef.flip(0) * ref_h).sum()).backward()
    torch.testing.assert_close(log_probs.detach(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.detach(), ref_h.detach(), atol=1e-5, rtol=0)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    assert "forward" not in vars(worker.backend.model.lm_head)  # the plain head is back after the call


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_fsdp_moe_families_match_plain_hf_model(arch, request):
    """DeepSeek-V3 (MLA, sigmoid router with expert bias and group-limited top-k, shared expert, dense
    first layer) and GLM-4.5 through the FSDP2 trainer on one packed row (block-diagonal mask; each
    sample's own positions, so YaRN/partial rotary see the same angles): response log-probs and every
    parameter's gradient (routers and experts included) equal transformers' model run per sample."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.model import forward_log_probs, pack_samples
    from slime.backends.training.worker import TrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import full_grads, make_args, make_samples, rank_data

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    args = make_args(model_dir, "--num-steps-per-rollout", "1", rbs=3)
    worker = TrainWorker(args)
    worker.init()
    assert worker.backend.model.config.model_type == arch
    data = rank_data(args, make_samples(6))
    packed = pack_samples(list(data.tokens), [int(r) for r in data.response_lengths], worker.backend.device)
    log_probs, _ = forward_log_probs(worker.backend.model, packed, worker.backend.attn_implementation, 1.0,
                                   worker.backend.chunk_rows)
    coef = torch.linspace(-1.0, 1.0, log_probs.numel())
    worker.backend.optimizer.zero_grad(set_to_none=True)
    (coef * log_probs).sum().backward()
    grads = full_grads(worker.backend.model)

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_lp = []
    for tokens, r in zip(data.tokens, data.response_lengths):
        rows = reference(tokens[None]).logits[0][len(tokens) - int(r) - 1 : len(tokens) - 1]
        ref_lp.append(algo.compute_log_probs(rows, tokens[-int(r):], 1.0))
    ref_lp = torch.cat(ref_lp)
    (coef * ref_lp).sum().backward()
    torch.testing.assert_close(log_probs.detach(), ref_lp.detach(), atol=1e-5, rtol=0)
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert any("experts.gate_up_proj" in n for n in expected) and any("mlp.gate.weight" in n for n in expected)
    assert {n for n, g in grads.items() if g is not None} == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_fsdp_hybrid_packed_samples_match_unpacked(arch, request):
    """Qwen3.5 (gated-DeltaNet linear attention, gated attention, zero-centred norms), its MoE variant and Qwen3-Next
    (grouped q/k/v/z projections) through the FSDP2 trainer on one packed row: log-probs and every parameter's
    gradient (conv1d, A_log, dt_bias, in_proj_* included) equal transformers' model run per sample, so no
    linear-attention state crosses into the next sample. transformers' own layer on the same packed row does carry
    it across (the case this guards)."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.model import forward_log_probs, model_inputs, pack_samples
    from slime.backends.training.worker import TrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import full_grads, make_args, make_samples, rank_data

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    args = make_args(model_dir, "--num-steps-per-rollout", "1", "--fsdp-attn-implementation", "eager", rbs=3)
    worker = TrainWorker(args)
    worker.init()
    assert worker.backend.model.linear_attention_layers == 3
    data = rank_data(args, make_samples(6))
    packed = pack_samples(list(data.tokens), [int(r) for r in data.response_lengths], worker.backend.device)
    log_probs, _ = forward_log_probs(worker.backend.model, packed, worker.backend.attn_implementation, 1.0,
                                     worker.backend.chunk_rows)
    coef = torch.linspace(-1.0, 1.0, log_probs.numel())
    worker.backend.optimizer.zero_grad(set_to_none=True)
    (coef * log_probs).sum().backward()
    grads = full_grads(worker.backend.model)

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_lp = []
    for tokens, r in zip(data.tokens, data.response_lengths):
        rows = reference(tokens[None]).logits[0][len(tokens) - int(r) - 1 : len(tokens) - 1]
        ref_lp.append(algo.compute_log_probs(rows, tokens[-int(r):], 1.0))
    ref_lp = torch.cat(ref_lp)
    (coef * ref_lp).sum().backward()
    torch.testing.assert_close(log_probs.detach(), ref_lp.detach(), atol=1e-5, rtol=0)
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert any("linear_attn.A_log" in n for n in expected) and any("linear_attn.conv1d" in n for n in expected)
    assert {n for n, g in grads.items() if g is not None} == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    with torch.no_grad():  # the plain model on the packed row: the block mask alone leaves the state leaking
        logits = reference(**model_inputs(packed, "eager")).logits[0][packed.predict_positions]
    leaked = algo.compute_log_probs(logits, packed.targets, 1.0)
    assert (leaked - ref_lp).abs().max() > 1e-3
