"""The chunked log-prob/entropy head: exact against the plain float32 log-softmax (values and
gradients), with top-p renormalisation, and inside an FSDP2-sharded model with tied embeddings."""

import pytest
import torch

from slime.backends.fsdp_utils.logprob_head import Nucleus, chunked_log_probs_and_entropy, resolve_chunk_rows
from slime.utils import ppo_utils


def _reference(hidden, weight, bias, targets, temperature, keep=None):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    entropy = ppo_utils.compute_entropy(logits)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return ppo_utils.compute_log_probs(logits, targets), entropy


def _inputs(seed=0, rows=29, hidden=12, vocab=97, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.7).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=g)
    coef = torch.randn(2, rows, generator=g)
    return h, w, b, targets, coef


def _grads(tensors):
    out = [None if t is None else t.grad.clone() for t in tensors]
    for t in tensors:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("chunk_rows", [1, 4, 29, 1000])
@pytest.mark.parametrize("temperature,bias,entropy_grad", [(1.0, False, True), (0.7, True, True), (1.3, False, False)])
def test_values_and_gradients_equal_the_full_log_softmax(chunk_rows, temperature, bias, entropy_grad):
    h, w, b, targets, coef = _inputs(bias=bias)
    log_probs, entropy = chunked_log_probs_and_entropy(h, w, targets, temperature, chunk_rows, bias=b, entropy_grad=entropy_grad)
    loss = (coef[0] * log_probs).sum() + ((coef[1] * entropy).sum() if entropy_grad else 0.0)
    loss.backward()
    got = _grads([h, w, b])
    ref_lp, ref_h = _reference(h, w, b, targets, temperature)
    ((coef[0] * ref_lp).sum() + ((coef[1] * ref_h).sum() if entropy_grad else 0.0)).backward()
    expected = _grads([h, w, b])
    torch.testing.assert_close(log_probs, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_h, atol=1e-5, rtol=0)
    assert entropy.requires_grad == entropy_grad
    for a, e in zip(got, expected):
        if e is not None:
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_top_p_renormalises_log_probs_over_the_nucleus_only():
    h, w, _, targets, coef = _inputs(seed=3, rows=9, vocab=41)
    g = torch.Generator().manual_seed(5)
    spans = [torch.randperm(41, generator=g)[: int(k)] for k in torch.randint(1, 6, (9,), generator=g)]
    spans[2] = torch.zeros(0, dtype=torch.long)  # an empty span (tool token): the whole vocabulary
    offsets = torch.tensor([0] + [len(s) for s in spans]).cumsum(0)
    nucleus = Nucleus(torch.cat(spans), offsets, "cpu")
    keep = torch.zeros(9, 41, dtype=torch.bool)
    for row, span in enumerate(spans):
        keep[row, span] = True
        keep[row, targets[row]] = True  # the sampled token is always kept
    keep[2] = True
    for chunk_rows in (2, 9):
        log_probs, entropy = chunked_log_probs_and_entropy(h, w, targets, 0.8, chunk_rows, nucleus=nucleus)
        ((coef[0] * log_probs).sum() + (coef[1] * entropy).sum()).backward()
        got = _grads([h, w])
        ref_lp, ref_h = _reference(h, w, None, targets, 0.8, keep)
        ((coef[0] * ref_lp).sum() + (coef[1] * ref_h).sum()).backward()
        expected = _grads([h, w])
        torch.testing.assert_close(log_probs, ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, ref_h, atol=1e-5, rtol=0)  # entropy: full vocabulary
        for a, e in zip(got, expected):
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    full, _ = chunked_log_probs_and_entropy(h, w, targets, 0.8, 4)
    assert bool((log_probs >= full - 1e-6).all()) and bool((log_probs > full + 1e-3).any())
    assert torch.allclose(log_probs[2], full[2])


def test_chunk_size_flag_and_bad_shapes():
    assert resolve_chunk_rows(-1) == 2048 and resolve_chunk_rows(7) == 7
    with pytest.raises(ValueError, match="--log-probs-chunk-size"):
        resolve_chunk_rows(0)
    h, w, _, targets, _ = _inputs()
    with pytest.raises(ValueError, match="targets must be"):
        chunked_log_probs_and_entropy(h, w, targets[:3])


@pytest.mark.usefixtures("single_rank")
def test_fsdp_sharded_tied_head_matches_plain_hf_model(tiny_model_dir):
    """Through the FSDP2 trainer (sharded, tied embeddings, chunks of 3 rows): log-probs, entropy and
    every parameter's gradient equal a plain HF model with the full-vocabulary log-softmax."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp_utils.model import forward_log_probs
    from slime.backends.fsdp_utils.worker import FSDPTrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import full_grads, make_args, make_samples, rank_data

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--log-probs-chunk-size", "3", rbs=3)
    worker = FSDPTrainWorker(args)
    worker.init()
    assert worker.chunk_rows == 3
    assert type(worker.model.lm_head.weight).__name__ == "DTensor" and worker.model.config.tie_word_embeddings
    data = rank_data(args, make_samples(6))
    packed = worker._pack(data, list(range(6)))
    log_probs, entropy = forward_log_probs(worker.model, packed, worker.attn_implementation, 0.7, 3, entropy_grad=True)
    coef = torch.linspace(-1.0, 1.0, log_probs.numel())
    worker.optimizer.zero_grad(set_to_none=True)
    ((coef * log_probs).sum() + (coef.flip(0) * entropy).sum()).backward()
    grads = full_grads(worker.model)
    worker.optimizer.zero_grad(set_to_none=True)

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref_lp, ref_h = [], []
    for tokens, r in zip(data["tokens"], data["response_lengths"]):
        logits = reference(tokens[None]).logits[0]
        rows = logits[len(tokens) - int(r) - 1 : len(tokens) - 1]
        ref_lp.append(ppo_utils.compute_log_probs(rows, tokens[-int(r):], 0.7))
        ref_h.append(ppo_utils.compute_entropy(rows, 0.7))
    ref_lp, ref_h = torch.cat(ref_lp), torch.cat(ref_h)
    ((coef * ref_lp).sum() + (coef.flip(0) * ref_h).sum()).backward()
    torch.testing.assert_close(log_probs.detach(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.detach(), ref_h.detach(), atol=1e-5, rtol=0)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)
    assert "forward" not in vars(worker.model.lm_head)  # the plain head is back after the call


@pytest.mark.gpu
def test_gpu_bf16_head_matches_full_logits_in_a_fraction_of_the_memory():
    """Qwen3-0.6B head shape in bf16 on CUDA: same values and gradients as the full-logits path
    (bf16 matmul tolerance) with far less peak memory than the fp32 [K, V] it avoids."""
    rows, hidden_size, vocab = 4096, 1024, 151936
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden_size, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden_size, generator=g) * 0.5).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g).cuda()
    coef = torch.randn(rows, generator=g).cuda()
    results = []
    for chunked in (False, True):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if chunked:
            log_probs, entropy = chunked_log_probs_and_entropy(h, w, targets, 0.8, 1024)
        else:
            log_probs, entropy = _reference(h, w, None, targets, 0.8)
        ((coef * log_probs).sum() + (coef * entropy).sum()).backward()
        torch.cuda.synchronize()
        results.append((log_probs.detach(), entropy.detach(), h.grad.float(), w.grad.float(),
                        torch.cuda.max_memory_allocated() - base))
    full, chunk = results
    torch.testing.assert_close(chunk[0], full[0], atol=5e-2, rtol=0)
    torch.testing.assert_close(chunk[1], full[1], atol=5e-2, rtol=0)
    for a, b in ((chunk[2], full[2]), (chunk[3], full[3])):
        assert float((a - b).abs().max()) <= 2e-2 * float(b.abs().max())
    assert chunk[4] < full[4] / 4, (chunk[4], full[4])
