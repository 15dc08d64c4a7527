"""Per-token log-probs and entropy from the Megatron backend's response logits ``[K, V]``.

The last pipeline stage hands the loss the output layer's logits at the K response rows (bf16 under
autocast, TP-gathered to the full vocabulary). With ``z = logits / T`` in float32:

    log π(t) = z_t − logsumexp(z)          H = −Σ_v softmax(z)_v · log softmax(z)_v

and in backward ``∂ log π(t)/∂z = onehot(t) − p``, ``∂H/∂z = −p ⊙ (log p + H)``.

Two implementations, chosen per call by ``SLIME_LOGPROB_HEAD`` as in the FSDP backend
(:func:`slime.backends.training.logprob_head.head_path`):

* ``torch`` — :func:`slime.algorithms.functional.compute_log_probs` / ``compute_entropy`` on the logits
  turned into float32 (the reference; the CPU path);
* ``triton`` — the fused kernels of :mod:`slime.backends.training.triton_logprob`: the forward
  reads the logits once, in their dtype, for lse, log π and H together; the backward reads them once
  more and writes ∂L/∂logits in their dtype; no float32 ``[K, V]`` tensor exists. Rows may be a
  column slice of wider rows (the vocabulary padding cut off): only their row stride is read;
* ``auto`` (unset) — ``triton`` for CUDA tensors when Triton imports, else ``torch``.
"""

from __future__ import annotations

import torch

from slime.algorithms import functional as algo

__all__ = ["log_probs_and_entropy"]


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                          with_entropy: bool = True, entropy_grad: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log π(target), entropy or None), float32 ``[K]`` each, from ``logits`` ``[K, V]`` (any
    floating dtype, rows with a unit column stride) and ``targets`` ``[K]``. The entropy carries a
    gradient only with ``entropy_grad`` (else its backward work is skipped)."""
    from slime.backends.training.logprob_head import head_path

    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits [K, V] and targets [K] expected, got {tuple(logits.shape)} and {tuple(targets.shape)}")
    if head_path(logits.device) == "triton":
        if logits.stride(1) != 1:
            logits = logits.contiguous()  # the kernels walk a row's columns with unit stride
        log_probs, entropy = _FusedLogProbEntropy.apply(logits, targets.long(), float(temperature), bool(entropy_grad))
        return log_probs, (entropy if with_entropy else None)
    log_probs = algo.compute_log_probs(logits, targets, temperature)
    if not with_entropy:
        return log_probs, None
    if entropy_grad:
        return log_probs, algo.compute_entropy(logits, temperature)
    with torch.no_grad():
        return log_probs, algo.compute_entropy(logits.detach(), temperature)


class _FusedLogProbEntropy(torch.autograd.Function):
    """The Triton kernels on given logits: forward saves them (no copy), backward writes
    ∂L/∂logits into a new tensor of their dtype and shape."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy_grad):
        from slime.backends.training import triton_logprob

        lse, log_probs, entropy = triton_logprob.log_probs_and_entropy(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        from slime.backends.training import triton_logprob

        logits, targets, lse, entropy = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None
        grad = triton_logprob.grad_logits(logits, targets, lse, entropy, grad_log_probs, grad_entropy, ctx.temperature)
        return grad, None, None, None
