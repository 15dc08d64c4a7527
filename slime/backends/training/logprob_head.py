"""Per-token log-prob and entropy straight from the final hidden states, in chunks of rows.

For K predicted positions with hidden states ``h`` [K, H] and LM-head weight ``W`` [V, H], with
``z = (h Wᵀ + b) / T`` computed in float32 one chunk of rows at a time:

    log π(t)  = z_t − logsumexp(z)                              (full vocabulary)
    log π(t)  = log p_t − log Σ_{v∈S} p_v                       (top-p: S = the engine's nucleus ∪ {t})
    H         = −Σ_v p_v log p_v,  p = softmax(z)               (always the full vocabulary)

The whole ``[K, V]`` float32 logits (and their gradient) never exist at once: the forward keeps
only ``logsumexp`` and ``H`` per row, and the backward recomputes each chunk's logits and applies

    ∂ log π(t)/∂z = onehot(t) − q        (q = p, or p restricted to S and renormalised)
    ∂H/∂z         = −p ⊙ (log p + H)

then ``∂/∂h = (∂/∂z / T) W`` and ``∂/∂W = (∂/∂z / T)ᵀ h``. The matmuls run in the weight's dtype
(bf16 under mixed precision, as ``nn.Linear`` would); softmax, log-probs and entropy in float32.

Two implementations of the per-chunk softmax work, chosen per call by ``SLIME_LOGPROB_HEAD``:

* ``torch`` — float32 tensor ops over the chunk (the CPU path, top-p, and the reference);
* ``triton`` — ``triton_logprob.py``: one fused kernel reads the chunk's logits once, in the weight's
  dtype, for forward, and once more in backward, where it overwrites them with ``∂/∂logits``; no
  float32 ``[rows, V]`` tensor exists. Full vocabulary only (a nucleus keeps the torch path); the
  bias gradient, when a bias needs one, also stays on the torch path;
* ``auto`` (unset) — ``triton`` for CUDA tensors when Triton imports, else ``torch``.

``SLIME_LOGPROB_HEAD=torch`` forces the torch path (e.g. to compare); ``=triton`` raises where the
kernels cannot run (on the CPU they run under ``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEFAULT_CHUNK_ROWS", "HEAD_ENV", "Nucleus", "chunked_log_probs_and_entropy", "head_path",
           "resolve_chunk_rows"]

DEFAULT_CHUNK_ROWS = 2048
HEAD_ENV = "SLIME_LOGPROB_HEAD"


def resolve_chunk_rows(value: int | None) -> int:
    """``--log-probs-chunk-size``: rows per chunk when > 0; −1 (the default) is this backend's
    default chunk (``DEFAULT_CHUNK_ROWS``), never the whole ``[K, V]`` at once."""
    if value is None or value == -1:
        return DEFAULT_CHUNK_ROWS
    if value <= 0:
        raise ValueError(f"--log-probs-chunk-size must be a positive number of rows or -1, got {value}")
    return int(value)


class Nucleus:
    """The kept top-p set of every row in CSR form: row k keeps ``ids[offsets[k]:offsets[k+1]]``
    (an empty span keeps the whole vocabulary). ``offsets`` stays on the host (it is sliced per
    chunk), ``ids`` lives on the compute device."""

    def __init__(self, ids: torch.Tensor, offsets: torch.Tensor, device):
        self.offsets = offsets.to("cpu", torch.long)
        self.ids = ids.to(device, torch.long)

    def mask(self, start: int, end: int, targets: torch.Tensor, vocab: int) -> torch.Tensor:
        """Bool ``[end − start, V]``: True where the token is kept (target always; empty row: all)."""
        rows = end - start
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        counts = self.offsets[start + 1 : end + 1] - self.offsets[start:end]
        keep = torch.zeros(rows, vocab, dtype=torch.bool, device=targets.device)
        row_of = torch.repeat_interleave(torch.arange(rows), counts).to(targets.device)
        keep[row_of, self.ids[lo:hi]] = True
        empty = (counts == 0).to(targets.device)
        keep[empty] = True
        keep[torch.arange(rows, device=targets.device), targets] = True
        return keep


def head_path(device: torch.device | str, nucleus: Nucleus | None = None) -> str:
    """``"triton"`` or ``"torch"``: the implementation a call on ``device`` tensors uses (``HEAD_ENV``)."""
    choice = os.environ.get(HEAD_ENV, "").strip().lower() or "auto"
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{HEAD_ENV}={os.environ[HEAD_ENV]!r}: expected auto, torch or triton")
    if choice == "torch" or nucleus is not None:
        return "torch"
    from slime.backends.training import triton_logprob

    device = torch.device(device)
    if choice == "triton":
        if not triton_logprob.available(device):
            raise RuntimeError(f"{HEAD_ENV}=triton, but the Triton kernels cannot run on {device} tensors "
                               "(they need CUDA, or TRITON_INTERPRET=1 on the CPU, and an importable triton); "
                               f"unset {HEAD_ENV} to choose automatically")
        return "triton"
    return "triton" if device.type == "cuda" and triton_logprob.available(device) else "torch"


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def _torch_chunk_forward(z, targets, keep):
    """float32 ops on one chunk's ``z`` [rows, V] (overwritten): (log π(t), H, lse, log kept mass or None)."""
    lse = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(lse.unsqueeze(-1))  # in place: z is not needed any more
    p = log_p.exp()
    target_log_p = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kept = None
    if keep is not None:
        kept = torch.log(torch.where(keep, p, 0.0).sum(-1))
        target_log_p = target_log_p - kept
    entropy = -p.mul_(log_p).sum(-1)  # in place: p is not needed any more
    return target_log_p, entropy, lse, kept


def _torch_chunk_grad(z, targets, lse, entropy, g_lp, g_ent, keep, kept_log_mass, temperature):
    """float32 ∂L/∂logits of one chunk from its ``z`` [rows, V] (overwritten); ``None`` drops a term."""
    log_p = z.sub_(lse.unsqueeze(-1))
    p = log_p.exp()
    grad_z = None
    if g_ent is not None:  # first: it needs p and log p as they are
        grad_z = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-g_ent.float().unsqueeze(-1))
    if g_lp is not None:
        g = g_lp.float()
        q = p
        if keep is not None:
            q = p.masked_fill_(~keep, 0.0).mul_(torch.exp(-kept_log_mass).unsqueeze(-1))
        q.mul_(-g.unsqueeze(-1))
        q[torch.arange(len(targets), device=q.device), targets] += g
        grad_z = q if grad_z is None else grad_z.add_(q)
    return grad_z.div_(temperature) if temperature != 1.0 else grad_z


class _ChunkedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, nucleus, entropy_grad):
        num_rows, vocab = hidden.shape[0], weight.shape[0]
        use_triton = head_path(hidden.device, nucleus) == "triton"
        if use_triton:
            from slime.backends.training import triton_logprob
        log_probs = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        kept_log_mass = torch.zeros(num_rows, dtype=torch.float32, device=hidden.device) if nucleus is not None else None
        for start in range(0, num_rows, chunk_rows):
            end = min(start + chunk_rows, num_rows)
            if use_triton:  # the logits in the weight's dtype, read once by the fused kernel
                logits = torch.nn.functional.linear(hidden[start:end], weight, bias)
                lse, log_probs[start:end], entropy[start:end] = triton_logprob.log_probs_and_entropy(
                    logits, targets[start:end], temperature)
                del logits  # before the next chunk's
            else:
                keep = nucleus.mask(start, end, targets[start:end], vocab) if nucleus is not None else None
                log_probs[start:end], entropy[start:end], lse, kept = _torch_chunk_forward(
                    _chunk_logits(hidden[start:end], weight, bias, temperature), targets[start:end], keep)
                if kept is not None:
                    kept_log_mass[start:end] = kept
            lse_all[start:end] = lse
            del lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, entropy, kept_log_mass)
        ctx.temperature, ctx.chunk_rows, ctx.nucleus, ctx.use_triton = temperature, chunk_rows, nucleus, use_triton
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, lse_all, entropy, kept_log_mass = ctx.saved_tensors
        temperature, chunk_rows, nucleus = ctx.temperature, ctx.chunk_rows, ctx.nucleus
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        num_rows, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # accumulate the weight gradient in fp32 over chunks; one matmul when there is one chunk
        grad_weight = None
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_bias and bias is not None else None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        use_triton = ctx.use_triton and grad_bias is None  # the bias gradient sums the float32 grad_z
        if use_triton:
            from slime.backends.training import triton_logprob
        for start in range(0, num_rows, chunk_rows):
            end = min(start + chunk_rows, num_rows)
            g_lp = None if grad_log_probs is None else grad_log_probs[start:end]
            g_ent = None if grad_entropy is None else grad_entropy[start:end]
            if use_triton:  # recomputed logits, overwritten in place with their gradient
                logits = torch.nn.functional.linear(hidden[start:end], weight, bias)
                grad_logits = triton_logprob.grad_logits_(logits, targets[start:end], lse_all[start:end],
                                                          entropy[start:end], g_lp, g_ent, temperature).to(weight.dtype)
                del logits  # the same storage as grad_logits (same dtype), freed with it below
            else:
                keep = None
                if nucleus is not None and g_lp is not None:
                    keep = nucleus.mask(start, end, targets[start:end], vocab)
                grad_z = _torch_chunk_grad(_chunk_logits(hidden[start:end], weight, bias, temperature), targets[start:end],
                                           lse_all[start:end], entropy[start:end], g_lp, g_ent, keep,
                                           None if kept_log_mass is None else kept_log_mass[start:end], temperature)
                if grad_bias is not None:
                    grad_bias.add_(grad_z.sum(0))
                grad_logits = grad_z.to(weight.dtype)
                del grad_z, keep  # free the chunk's fp32 [rows, V] before the weight-gradient matmul
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                piece = grad_logits.t() @ hidden[start:end]
                if grad_weight is None:
                    grad_weight = piece if num_rows <= chunk_rows else piece.float()
                else:
                    grad_weight.add_(piece)
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    bias: torch.Tensor | None = None,
    nucleus: Nucleus | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(target), entropy), both float32 ``[K]``, from ``hidden`` [K, H] and the LM head.

    ``nucleus`` renormalises the log-probs over each row's kept top-p set (entropy stays over the
    full vocabulary). With ``entropy_grad=False`` the entropy is returned without a gradient (its
    backward work is skipped). Exact against ``log_softmax(hidden @ Wᵀ / T)`` up to float32 rounding.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [K, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [K] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    return _ChunkedLogProbEntropy.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk_rows),
                                        nucleus, bool(entropy_grad))
