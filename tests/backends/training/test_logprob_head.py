"""The chunked log-prob/entropy head: exact against the plain float32 log-softmax (values and
gradients), with top-p renormalisation; the fused Triton kernels against the torch path."""

import importlib.util
import os

import pytest
import torch

from slime.backends.training.logprob_head import (
    HEAD_ENV,
    Nucleus,
    chunked_log_probs_and_entropy,
    head_path,
    resolve_chunk_rows,
)
from slime.algorithms import functional as algo


def _reference(hidden, weight, bias, targets, temperature, keep=None):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    entropy = algo.compute_entropy(logits)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return algo.compute_log_probs(logits, targets), entropy


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


# ---- the fused Triton path (triton_logprob.py) against the torch path --------------------------------------
# On the CPU these run only under Triton's interpreter: `bash scripts/test.sh` runs this file a second
# time with PYTHONPATH=.venv/triton-interpreter TRITON_INTERPRET=1 (triton is not a dependency; setup-env.sh
# keeps a copy off the import path). On CUDA the `gpu` tests run the compiled kernels.

def _triton_runs_on(device: str) -> bool:
    from slime.backends.training import triton_logprob

    return triton_logprob.available(device)


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


def _head_in_both_paths(monkeypatch, h, w, targets, coef, temperature, chunk_rows, entropy_grad, spy=None):
    """Values and (hidden, weight) gradients of the head forced through each path: {path: tensors}."""
    from slime.backends.training import triton_logprob

    if spy is not None:  # count kernel launches, so a silent fall-back to the torch path fails the test
        for name in ("log_probs_and_entropy", "grad_logits_"):
            real = getattr(triton_logprob, name)
            monkeypatch.setattr(triton_logprob, name, lambda *a, _real=real, _name=name, **k: (
                spy.append(_name), _real(*a, **k))[1])
    out = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv(HEAD_ENV, path)
        log_probs, entropy = chunked_log_probs_and_entropy(h, w, targets, temperature, chunk_rows, entropy_grad=entropy_grad)
        loss = (coef[0] * log_probs).sum() + ((coef[1] * entropy).sum() if entropy_grad else 0.0)
        loss.backward()
        out[path] = [log_probs.detach(), entropy.detach(), *_grads([h, w])]
    return out


def _assert_paths_agree(out, dtype):
    (lp_t, ent_t, gh_t, gw_t), (lp_k, ent_k, gh_k, gw_k) = out["torch"], out["triton"]
    if dtype == torch.float32:
        torch.testing.assert_close(lp_k, lp_t, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent_k, ent_t, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gh_k, gh_t, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gw_k, gw_t, atol=1e-5, rtol=1e-5)
        return
    # bf16: the same bf16 logits, float32 softmax math in both; grad_z is rounded to bf16 in both, so a
    # last-bit difference in float32 can flip one rounding: compare against the gradients' scale
    torch.testing.assert_close(lp_k, lp_t, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent_k, ent_t, atol=2e-5, rtol=1e-5)
    for got, expected in ((gh_k, gh_t), (gw_k, gw_t)):
        assert got.dtype == expected.dtype == torch.bfloat16
        scale = float(expected.float().abs().max())
        assert scale > 0 and float((got.float() - expected.float()).abs().max()) <= 1e-2 * scale


def _head_inputs(rows, hidden, vocab, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 2.0 / hidden**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[1] = vocab - 1  # the last column of the last, partial block
    coef = torch.randn(2, rows, generator=g)
    return h, w, targets.to(device), coef.to(device)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, True), (0.7, True), (0.7, False)])
def test_triton_interpreted_matches_torch_path(monkeypatch, dtype, temperature, entropy_grad):
    """7 rows in chunks of 3, V = 300 in blocks of 64 (neither divides): the kernels (interpreted on the
    CPU) give the torch path's log-probs, entropy and hidden/weight gradients."""
    spy = []
    h, w, targets, coef = _head_inputs(7, 16, 300, dtype, "cpu")
    out = _head_in_both_paths(monkeypatch, h, w, targets, coef, temperature, 3, entropy_grad, spy)
    assert spy.count("log_probs_and_entropy") == 3 and spy.count("grad_logits_") == 3
    _assert_paths_agree(out, dtype)


@needs_interpreter
def test_triton_interpreted_single_gradient_terms_and_edge_targets(monkeypatch):
    """A loss on log-probs alone, on entropy alone (no log-prob gradient), a plain ``.sum()`` (a
    stride-0 incoming gradient) and a bias with a gradient match the torch path; an out-of-vocabulary
    target gives NaN, not a read outside the row."""
    from slime.backends.training import triton_logprob

    h, w, targets, _ = _head_inputs(5, 8, 130, torch.float32, "cpu", seed=1)
    losses = {"log_probs": lambda lp, ent: (lp * torch.arange(5.0)).sum(),
              "entropy": lambda lp, ent: (ent * torch.arange(5.0)).sum(),
              "plain_sum": lambda lp, ent: lp.sum() + ent.sum()}
    for name, loss_fn in losses.items():
        grads = {}
        for path in ("torch", "triton"):
            monkeypatch.setenv(HEAD_ENV, path)
            loss_fn(*chunked_log_probs_and_entropy(h, w, targets, 0.9, 2)).backward()
            grads[path] = _grads([h, w])
        for got, expected in zip(grads["triton"], grads["torch"]):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)
    # a bias that needs a gradient: the forward kernel, then the torch backward (it sums the fp32 grad_z)
    bias = (torch.randn(130) * 0.1).requires_grad_()
    grads = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv(HEAD_ENV, path)
        log_probs, entropy = chunked_log_probs_and_entropy(h, w, targets, 0.9, 2, bias=bias)
        (log_probs.sum() - entropy.sum()).backward()
        grads[path] = (log_probs.detach(), *_grads([h, w, bias]))
    for got, expected in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    logits = torch.randn(3, 130)
    _, log_probs, entropy = triton_logprob.log_probs_and_entropy(logits, torch.tensor([0, 130, -1]), 1.0)
    assert torch.isfinite(log_probs[0]) and torch.isnan(log_probs[1:]).all() and torch.isfinite(entropy).all()


def test_head_path_choice_and_bad_setting(monkeypatch):
    """``SLIME_LOGPROB_HEAD``: unset → the Triton kernels on CUDA only; ``torch`` always the torch path;
    a nucleus always the torch path; ``triton`` where the kernels cannot run and a typo raise."""
    monkeypatch.delenv(HEAD_ENV, raising=False)
    assert head_path("cpu") == "torch"
    monkeypatch.setenv(HEAD_ENV, "torch")
    assert head_path("cpu") == "torch" and head_path("cuda") == "torch"
    monkeypatch.setenv(HEAD_ENV, "triton")
    nucleus = Nucleus(torch.zeros(0, dtype=torch.long), torch.zeros(2, dtype=torch.long), "cpu")
    assert head_path("cpu", nucleus) == "torch"
    if not _triton_runs_on("cpu"):
        with pytest.raises(RuntimeError, match=f"{HEAD_ENV}=triton"):
            head_path("cpu")
    monkeypatch.setenv(HEAD_ENV, "tritn")
    with pytest.raises(ValueError, match=f"{HEAD_ENV}='tritn'"):
        head_path("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, True), (0.7, True), (0.7, False)])
def test_gpu_triton_head_matches_torch_path(monkeypatch, vocab, dtype, temperature, entropy_grad):
    """Compiled kernels on CUDA: 2,500 rows in chunks of 1,024 (partial last chunk), V = 1,000 and the
    Qwen3 vocabulary (partial last block), fp32 (tight) and bf16 (the bf16 gradients' rounding)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    monkeypatch.delenv(HEAD_ENV, raising=False)
    assert head_path("cuda") == "triton"
    spy = []
    h, w, targets, coef = _head_inputs(2500, 256, vocab, dtype, "cuda")
    out = _head_in_both_paths(monkeypatch, h, w, targets, coef, temperature, 1024, entropy_grad, spy)
    assert spy.count("log_probs_and_entropy") == 3 and spy.count("grad_logits_") == 3
    _assert_paths_agree(out, dtype)
