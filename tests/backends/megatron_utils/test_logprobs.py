"""The Megatron backend's log-probs/entropy from response logits (``megatron_utils.logprobs``): the
fused Triton path equals ``algo.compute_log_probs`` / ``compute_entropy`` in values and
gradients, on logits whose rows are a column slice of wider rows (the vocabulary padding cut off).

The Triton tests run on the CPU only under Triton's interpreter: ``bash scripts/test.sh`` runs this
file a second time with ``PYTHONPATH=.venv/triton-interpreter TRITON_INTERPRET=1`` (triton is not a
dependency of the project; setup-env.sh keeps a copy off the import path); on CUDA the ``gpu`` tests
run the compiled kernels.
"""

import importlib.util
import os

import pytest
import torch

from slime.backends.training.logprob_head import HEAD_ENV
from slime.backends.megatron_utils.logprobs import log_probs_and_entropy
from slime.algorithms import functional as algo

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


def _logits(rows, vocab, padded, dtype, device, seed=0):
    """``[rows, padded]`` logits (a leaf) and its first ``vocab`` columns (a strided view), plus
    targets (one in the last column) and loss coefficients."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, padded, generator=g) * 3.0).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[1] = vocab - 1
    coef = torch.randn(2, rows, generator=g)
    return full, targets.to(device), coef.to(device)


def _run(full, vocab, targets, coef, temperature, entropy_grad, loss="both"):
    """(log-probs, entropy, ∂loss/∂full) through ``log_probs_and_entropy`` on ``full[:, :vocab]``."""
    logits = full[:, :vocab]
    log_probs, entropy = log_probs_and_entropy(logits, targets, temperature, entropy_grad=entropy_grad)
    terms = {"both": (coef[0] * log_probs).sum() + ((coef[1] * entropy).sum() if entropy_grad else 0.0),
             "log_probs": (coef[0] * log_probs).sum(), "entropy": (coef[1] * entropy).sum(),
             "plain_sum": log_probs.sum() + entropy.sum()}
    terms[loss].backward()
    grad, full.grad = full.grad, None
    assert entropy.requires_grad == entropy_grad
    return log_probs.detach(), entropy.detach(), grad


def _reference(full, vocab, targets, coef, temperature, entropy_grad, loss="both"):
    logits = full[:, :vocab].float()
    log_probs = algo.compute_log_probs(logits, targets, temperature)
    entropy = algo.compute_entropy(logits if entropy_grad else logits.detach(), temperature)
    terms = {"both": (coef[0] * log_probs).sum() + ((coef[1] * entropy).sum() if entropy_grad else 0.0),
             "log_probs": (coef[0] * log_probs).sum(), "entropy": (coef[1] * entropy).sum(),
             "plain_sum": log_probs.sum() + entropy.sum()}
    terms[loss].backward()
    grad, full.grad = full.grad, None
    return log_probs.detach(), entropy.detach(), grad


def _spy(monkeypatch):
    """Count the kernel launches, so that a silent fall-back to the torch path fails the test."""
    from slime.backends.training import triton_logprob

    calls = []
    for name in ("log_probs_and_entropy", "grad_logits"):
        real = getattr(triton_logprob, name)
        monkeypatch.setattr(triton_logprob, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    return calls


def _assert_close(got, expected, dtype):
    (lp, ent, grad), (lp_ref, ent_ref, grad_ref) = got, expected
    torch.testing.assert_close(lp, lp_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=2e-5, rtol=1e-5)
    assert grad.dtype == grad_ref.dtype == dtype
    if dtype == torch.float32:  # two summation orders over 151,936 columns: on the H200 one element in
        # 311M came 7.6e-5 relative off (1.2e-6 absolute); a wrong term would be off by far more
        torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=2e-4)
    else:  # the same fp32 math rounded to bf16 once in both: a last-bit float32 difference can flip one rounding
        scale = float(grad_ref.float().abs().max())
        assert scale > 0 and float((grad.float() - grad_ref.float()).abs().max()) <= 1e-2 * scale


def test_torch_path_on_cpu_is_the_reference(monkeypatch):
    """Without the kernels (CPU, or SLIME_LOGPROB_HEAD=torch) the values and gradients are exactly
    ppo_utils' on the float32 logits; the padding columns get no gradient."""
    monkeypatch.setenv(HEAD_ENV, "torch")
    full, targets, coef = _logits(6, 50, 64, torch.float32, "cpu")
    for entropy_grad in (True, False):
        got = _run(full, 50, targets, coef, 0.8, entropy_grad)
        expected = _reference(full, 50, targets, coef, 0.8, entropy_grad)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        assert float(got[2][:, 50:].abs().max()) == 0.0
    log_probs, entropy = log_probs_and_entropy(full[:, :50], targets, with_entropy=False)
    assert entropy is None and log_probs.shape == (6,)
    with pytest.raises(ValueError, match="targets"):
        log_probs_and_entropy(full, targets[:3])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, True), (0.7, True), (0.7, False)])
@pytest.mark.parametrize("padded", [300, 320], ids=["unpadded", "padded"])
def test_triton_interpreted_matches_ppo_utils(monkeypatch, dtype, temperature, entropy_grad, padded):
    """7 rows, V = 300 in blocks of 64 (partial last block), rows of 300 or of 320 columns (a slice
    of wider rows, as after the vocabulary-padding cut): log-probs, entropy and ∂/∂logits equal
    ppo_utils' on the float32 logits; the padding columns get no gradient."""
    calls = _spy(monkeypatch)
    full, targets, coef = _logits(7, 300, padded, dtype, "cpu")
    monkeypatch.setenv(HEAD_ENV, "triton")
    got = _run(full, 300, targets, coef, temperature, entropy_grad)
    assert calls == ["log_probs_and_entropy", "grad_logits"]
    monkeypatch.setenv(HEAD_ENV, "torch")
    _assert_close(got, _reference(full, 300, targets, coef, temperature, entropy_grad), dtype)
    if padded > 300:
        assert float(got[2][:, 300:].float().abs().max()) == 0.0


@needs_interpreter
@pytest.mark.parametrize("loss", ["log_probs", "entropy", "plain_sum"])
def test_triton_interpreted_single_gradient_terms(monkeypatch, loss):
    """A loss on log-probs alone, on entropy alone (no log-prob gradient), a plain ``.sum()`` (a
    stride-0 incoming gradient)."""
    full, targets, coef = _logits(5, 130, 136, torch.float32, "cpu", seed=1)
    monkeypatch.setenv(HEAD_ENV, "triton")
    got = _run(full, 130, targets, coef, 0.9, True, loss)
    monkeypatch.setenv(HEAD_ENV, "torch")
    _assert_close(got, _reference(full, 130, targets, coef, 0.9, True, loss), torch.float32)


@needs_interpreter
def test_triton_interpreted_forward_only(monkeypatch):
    """Under no_grad (the π_old / reference passes) the kernels run forward only; without entropy it is None."""
    calls = _spy(monkeypatch)
    full, targets, _ = _logits(4, 100, 128, torch.bfloat16, "cpu", seed=2)
    monkeypatch.setenv(HEAD_ENV, "triton")
    with torch.no_grad():
        log_probs, entropy = log_probs_and_entropy(full[:, :100], targets, 1.0, entropy_grad=False)
        only, none = log_probs_and_entropy(full[:, :100], targets, 1.0, with_entropy=False)
    assert calls == ["log_probs_and_entropy"] * 2 and none is None and torch.equal(only, log_probs)
    logits = full.detach()[:, :100].float()
    torch.testing.assert_close(log_probs, algo.compute_log_probs(logits, targets), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, algo.compute_entropy(logits), atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [151936, 152064], ids=["tp1", "tp2-padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_matches_ppo_utils_at_qwen3_vocabulary(monkeypatch, dtype, padded):
    """Compiled kernels on CUDA at the Qwen3 vocabulary (151,936; padded to 152,064 at TP=2), 2,048
    rows, T = 0.7: the same values and gradients as ppo_utils on the float32 logits."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        pytest.skip("needs CUDA and triton")
    monkeypatch.delenv(HEAD_ENV, raising=False)
    calls = _spy(monkeypatch)
    full, targets, coef = _logits(2048, 151936, padded, dtype, "cuda")
    got = _run(full, 151936, targets, coef, 0.7, True)
    assert calls == ["log_probs_and_entropy", "grad_logits"]
    monkeypatch.setenv(HEAD_ENV, "torch")
    _assert_close(got, _reference(full, 151936, targets, coef, 0.7, True), dtype)
