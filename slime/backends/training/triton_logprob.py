"""Fused Triton kernels for one chunk of the log-prob/entropy head (``logprob_head.py``), for CUDA.

The torch path turns each chunk's logits ``[R, V]`` into float32 and makes ~6 elementwise passes
over it in forward and as many in backward; at V = 151,936 those passes cost as much GPU time as
all the model's matmuls. Here each pass reads the logits once, in their own dtype (bf16 under
mixed precision, or fp32), with float32 arithmetic in registers; no ``[R, V]`` float32 tensor is
written. One program per row walks the vocabulary in blocks of ``BLOCK_V`` columns.

Forward, with ``z = logits / T``, keeps the online triple (running max ``m``, ``s = Σ e^{z−m}``,
``w = Σ e^{z−m}·(z−m)``, rescaled when ``m`` grows: ``s ← α s``, ``w ← α (w + (m_old − m) s)``,
``α = e^{m_old − m}``) and returns per row, in float32::

    lse      = m + log s
    log π(t) = z_t − lse
    H        = lse − Σ softmax(z)·z = log s − w / s

Backward reads the (recomputed) logits again and overwrites them, in place and in their dtype, with

    ∂L/∂logits = (g_lp·(onehot(t) − p) − g_ent·p·(log p + H)) / T,   p = exp(z − lse)

where a missing ``g_lp`` / ``g_ent`` drops its term. A target outside ``[0, V)`` gives a NaN
log-prob (the torch path raises instead); no memory outside the row is read.

Launch on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, which
must be set before this module is imported; slow, for tests on tiny shapes).
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch path is used
    triton = None

__all__ = ["available", "grad_logits", "grad_logits_", "interpreting", "log_probs_and_entropy"]

# 4096 columns a step with 8 warps = 16 fp32 values per thread and vector; 37 steps at V = 151,936
GPU_BLOCK_V, GPU_NUM_WARPS = 4096, 8
INTERPRETER_BLOCK_V = 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: Triton imports and the tensors are on
    CUDA, or they are on the CPU under Triton's interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


if triton is not None:

    @triton.jit
    def _forward_kernel(logits_ptr, targets_ptr, lse_ptr, log_probs_ptr, entropy_ptr, stride_row, temperature,
                        VOCAB: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK_V)
        # per-lane sums against one running max: a single cross-lane reduction (the max) per block
        m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
        s = tl.zeros([BLOCK_V], tl.float32)
        w = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, VOCAB, BLOCK_V):
            idx = start + cols
            inside = idx < VOCAB
            z = tl.load(row_ptr + idx, mask=inside, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_old = tl.where(m > float("-inf"), m, m_new)  # before the first block there is nothing to rescale
            alpha = tl.exp(m_old - m_new)
            e = tl.exp(z - m_new)  # 0 outside the vocabulary
            w = alpha * (w + (m_old - m_new) * s) + e * tl.where(inside, z - m_new, 0.0)
            s = alpha * s + e
            m = m_new
        s_total = tl.sum(s, axis=0)
        log_s = tl.log(s_total)
        lse = m + log_s
        target = tl.load(targets_ptr + row)
        valid = (target >= 0) & (target < VOCAB)
        z_t = tl.load(row_ptr + tl.where(valid, target, 0)).to(tl.float32) / temperature
        tl.store(lse_ptr + row, lse)
        tl.store(log_probs_ptr + row, tl.where(valid, z_t - lse, float("nan")))
        tl.store(entropy_ptr + row, log_s - tl.sum(w, axis=0) / s_total)

    @triton.jit
    def _backward_kernel(logits_ptr, grad_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_log_probs_ptr,
                         grad_entropy_ptr, stride_row, stride_grad, temperature, VOCAB: tl.constexpr,
                         HAS_LOG_PROB_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_ptr + row * stride_grad
        cols = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        target = tl.load(targets_ptr + row)
        g_lp = tl.load(grad_log_probs_ptr + row) if HAS_LOG_PROB_GRAD else 0.0
        g_ent = tl.load(grad_entropy_ptr + row) if HAS_ENTROPY_GRAD else 0.0
        entropy = tl.load(entropy_ptr + row) if HAS_ENTROPY_GRAD else 0.0
        for start in range(0, VOCAB, BLOCK_V):
            idx = start + cols
            inside = idx < VOCAB
            z = tl.load(row_ptr + idx, mask=inside, other=0.0).to(tl.float32) / temperature
            log_p = z - lse
            p = tl.exp(log_p)
            grad = tl.zeros([BLOCK_V], tl.float32)
            if HAS_ENTROPY_GRAD:
                grad = (log_p + entropy) * p * (-g_ent)
            if HAS_LOG_PROB_GRAD:
                q = p * (-g_lp)
                grad += tl.where(idx == target, q + g_lp, q)
            tl.store(grad_row_ptr + idx, (grad / temperature).to(grad_ptr.dtype.element_ty), mask=inside)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if not available(logits.device):
        raise RuntimeError(f"the Triton log-prob kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU) and "
                           f"an importable triton; got {logits.device} tensors, triton "
                           f"{'missing' if triton is None else triton.__version__}")
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [R, V] tensor with contiguous rows, got {logits.dtype} "
                         f"{tuple(logits.shape)} with strides {logits.stride()}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must be [R] = [{logits.shape[0]}], got {tuple(targets.shape)}")


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch_config(vocab: int, block_v: int | None, num_warps: int | None) -> tuple[int, int]:
    if block_v is None:
        block_v = INTERPRETER_BLOCK_V if interpreting() else GPU_BLOCK_V
    block_v = min(block_v, triton.next_power_of_2(vocab))
    if num_warps is None:
        num_warps = max(1, min(GPU_NUM_WARPS, block_v // 512))
    return block_v, num_warps


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          block_v: int | None = None, num_warps: int | None = None):
    """``(lse, log π(target), H)``, each float32 ``[R]``, of ``z = logits / temperature``."""
    _check(logits, targets)
    rows, vocab = logits.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    if rows:
        block_v, num_warps = _launch_config(vocab, block_v, num_warps)
        with _on(logits.device):
            _forward_kernel[(rows,)](logits, targets.contiguous(), out[0], out[1], out[2], logits.stride(0),
                                     float(temperature), VOCAB=vocab, BLOCK_V=block_v, num_warps=num_warps)
    return out[0], out[1], out[2]


def grad_logits_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float,
                 block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Overwrite ``logits`` (the same values the forward saw) with ∂L/∂logits, in their dtype, and
    return it. ``lse`` and ``entropy`` are the forward's outputs; a ``None`` gradient drops its term."""
    return grad_logits(logits, targets, lse, entropy, grad_log_probs, grad_entropy, temperature, block_v, num_warps,
                       out=logits)


def grad_logits(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float,
                block_v: int | None = None, num_warps: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """∂L/∂logits ``[R, V]`` in the logits' dtype, written to ``out`` (a new contiguous tensor when
    None; ``logits`` itself to overwrite them). ``logits`` may be a column slice of wider rows (only
    their row stride is read); ``lse`` and ``entropy`` are the forward's outputs; a ``None``
    gradient drops its term."""
    _check(logits, targets)
    if grad_log_probs is None and grad_entropy is None:
        raise ValueError("grad_logits needs at least one of grad_log_probs and grad_entropy")
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    elif out.shape != logits.shape or out.dtype != logits.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a {logits.dtype} {tuple(logits.shape)} tensor with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}")
    rows, vocab = logits.shape
    if rows:
        block_v, num_warps = _launch_config(vocab, block_v, num_warps)
        as_rows = lambda t: lse if t is None else t.to(torch.float32).contiguous()  # lse: an unread stand-in
        with _on(logits.device):
            _backward_kernel[(rows,)](logits, out, targets.contiguous(), lse.contiguous(), entropy.contiguous(),
                                      as_rows(grad_log_probs), as_rows(grad_entropy), logits.stride(0),
                                      out.stride(0), float(temperature), VOCAB=vocab,
                                      HAS_LOG_PROB_GRAD=grad_log_probs is not None,
                                      HAS_ENTROPY_GRAD=grad_entropy is not None, BLOCK_V=block_v, num_warps=num_warps)
    return out
