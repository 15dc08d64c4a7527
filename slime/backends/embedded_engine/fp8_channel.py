"""Per-channel FP8 (``--quantization w8a8_fp8``): SGLang's W8A8 FP8 method, quantized online.

What SGLang does with ``--quantization w8a8_fp8`` on a bf16 checkpoint on Hopper (its
``layers/quantization/w8a8_fp8.py`` and ``fp8_utils.apply_fp8_linear``; also what its ``fp8`` method does
to a checkpoint without ``weight_block_size``): each weight ``W [N, K]`` becomes e4m3 values and one fp32
scale per output channel, ``s_n = amax(|W[n, :]|) / 448``, ``Q = e4m3(W / s)``; each activation row is
quantized the same way per token at every call (dynamic); the GEMM multiplies the e4m3 operands with fp32
accumulation and applies ``s_token · s_channel`` once, in its epilogue. The block-wise form (``fp8.py``)
instead rescales at every 128-wide K group, which the Triton GEMM pays for on sm_90 (its wgmma waits on
each group); here the scales stay out of the main loop.

Paths (``--fp8-gemm-backend``): ``auto`` is ``scaled_mm`` where it runs — ``torch._scaled_mm`` with
row-wise scales (``scale_a [M, 1]``, ``scale_b [1, N]``, PyTorch's CUTLASS row-wise kernel on sm_90), the
activations quantized by one Triton launch (:func:`quantize_tokens`) or already by the RMSNorm that produced them
(``fused_ops``, ``quantize="token"``: q/k/v and gate/up; :meth:`ChannelFp8Linear.takes_quantized`), after an eager
check against the reference at start; ``dequant`` (and ``auto`` elsewhere: the CPU) multiplies ``x`` by the
dequantized weight in ``x``'s dtype (the weights' rounding only, like ``fp8.py``'s ``dequant``).

Weights live in the module as ``weight_fp8 [N, K]`` and ``weight_scale [N, 1]`` (SGLang's names). Any rows
of a fused projection are a part's own channels, so a weight update quantizes a part into its rows without
the 128-row alignment the blocks need. Routed experts are not implemented (``--quantization fp8`` does them).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from slime.backends.embedded_engine.fp8 import FP8_DTYPE, FP8_MAX, QuantizedLinear, _scales_from_amax

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "dequant")
QUANTIZE_BLOCK = 1024  # columns a quantizer program reads at a time (two passes over the row)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch quantizer and the dequant path
    triton = None


@torch.no_grad()
def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix [R, C]`` -> (e4m3 ``[R, C]``, fp32 scales ``[R, 1]``): one scale per row, ``amax / 448``
    (1 for a zero row). The reference of :func:`quantize_tokens` and the weights' quantizer."""
    x = matrix.float()
    scales = _scales_from_amax(x.abs().amax(dim=-1, keepdim=True))
    return (x / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


@torch.no_grad()
def quantize_weight(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's :func:`quantize_rows`: on CUDA by :func:`quantize_tokens`' one launch (the same numbers),
    elsewhere by torch."""
    return quantize_tokens(matrix) if matrix.is_cuda else quantize_rows(matrix)


@torch.no_grad()
def quantize_rows_into(matrix: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`quantize_weight` written into existing storage (views: a fused projection's rows)."""
    q, s = quantize_weight(matrix.to(device=values.device))
    values.copy_(q)
    scales.copy_(s)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (values.float() * scales).to(dtype)


if triton is not None:
    from slime.backends.embedded_engine.fp8_triton import _round_to_e4m3_grid

    @triton.jit
    def _quantize_token(x, peak, fp8_max, EMULATE_E4M3_CAST: tl.constexpr):
        """fp32 ``x`` (any shape) of one token whose ``|x|`` peaks at ``peak`` -> (e4m3 values, the token's
        scale): the numbers of :func:`quantize_rows` (``div_rn`` for the scale, an fma-corrected reciprocal
        product for the values, as ``fp8_triton._quantize_rows``; ``|x| <= peak`` keeps ``|q| <= 448`` up to an
        ulp, which rounds to 448)."""
        scale = tl.where(peak > 0, tl.div_rn(peak, fp8_max), 1.0)
        inverse = tl.div_rn(1.0, scale)
        q = x * inverse
        q = tl.fma(tl.fma(-q, scale, x), inverse, q)
        if EMULATE_E4M3_CAST:
            q = _round_to_e4m3_grid(q)
        return q.to(tl.float8e4nv), scale

    @triton.jit
    def _quantize_store_token(y, row, n_cols, q_ptr, s_ptr, fp8_max, BLOCK: tl.constexpr,
                              EMULATE_E4M3_CAST: tl.constexpr):
        """A whole row ``y [BLOCK]`` (fp32; columns past ``n_cols`` zero) -> its e4m3 values at ``q_ptr + row ·
        n_cols`` and its scale at ``s_ptr + row``: for a producing kernel that holds the row (an RMSNorm) to hand
        a ``--quantization w8a8_fp8`` GEMM its activations."""
        q, scale = _quantize_token(y, tl.max(tl.abs(y), axis=0), fp8_max, EMULATE_E4M3_CAST)
        cols = tl.arange(0, BLOCK)
        tl.store(q_ptr + row * n_cols + cols, q, mask=cols < n_cols)
        tl.store(s_ptr + row, scale)

    @triton.jit(do_not_specialize=["M"])
    def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, fp8_max,
                                BLOCK: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        """Program ``m``: row ``m`` of ``x`` -> its e4m3 values and scale (:func:`_quantize_token`), reading the
        row twice (its peak, then the values)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        peak = tl.max(amax, axis=0)
        for start in range(0, K, BLOCK):
            in_k = start + cols < K
            x = tl.load(x_ptr + row * stride_xm + start + cols, mask=in_k, other=0.0).to(tl.float32)
            q, _ = _quantize_token(x, peak, fp8_max, EMULATE_E4M3_CAST)
            tl.store(q_ptr + row * stride_qm + start + cols, q, mask=in_k)
        tl.store(s_ptr + row, tl.where(peak > 0, tl.div_rn(peak, fp8_max), 1.0))  # _quantize_token's scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 ``[M, 1]``) per token in one Triton launch where Triton runs
    (CUDA, or the interpreter), :func:`quantize_rows` elsewhere. No host syncs: capturable."""
    from slime.backends.embedded_engine import fp8_triton

    if not fp8_triton.available(x.device):
        return quantize_rows(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    values = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_tokens_kernel[(rows,)](x, values, scales, rows, cols, x.stride(0), values.stride(0), FP8_MAX,
                                         BLOCK=QUANTIZE_BLOCK, EMULATE_E4M3_CAST=fp8_triton._interpreting(),
                                         num_warps=4)
    return values, scales


def scaled_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype,
              quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x [M, K]`` (quantized here per token, unless its producer did: ``quantized``) ``@ (values · scales)ᵀ``
    on ``torch._scaled_mm``'s row-wise path."""
    x8, x_scales = quantized if quantized is not None else quantize_tokens(x)
    return torch._scaled_mm(x8, values.t(), scale_a=x_scales, scale_b=scales.t(), out_dtype=out_dtype)


def reference_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``quantize_rows(x) @ dequant(W)ᵀ``: what :func:`scaled_mm` computes, written plainly."""
    x8, x_scales = quantize_rows(x)
    return dequantize(x8, x_scales) @ dequantize(values, scales).t()


@functools.lru_cache(maxsize=None)
def _scaled_mm_problem(index: int) -> str | None:
    """Why the row-wise ``_scaled_mm`` cannot serve on CUDA device ``index`` (None: it can). Checked once,
    eagerly: sm_90, and a GEMM of odd shape against :func:`reference_matmul`."""
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return f"PyTorch's row-wise FP8 GEMM runs on sm_90 (H100/H200); this GPU is sm_{major}{minor}"
    device = torch.device("cuda", index)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(37, 384, generator=gen, device=device).to(torch.bfloat16)
    values, scales = quantize_rows(torch.randn(272, 384, generator=gen, device=device) / 20)
    try:
        out = scaled_mm(x, values, scales, torch.bfloat16).float()
    except (RuntimeError, ValueError) as error:
        return f"torch._scaled_mm refused row-wise scales: {str(error).splitlines()[0]}"
    expected = reference_matmul(x, values, scales)
    error = float((out - expected).abs().max() / expected.abs().max())
    if error > 2e-2:
        return f"torch._scaled_mm's row-wise result is off the reference by {error:.3g} (relative)"
    return None


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> ``scaled_mm`` where :func:`_scaled_mm_problem` finds none (said in the log otherwise),
    else ``dequant``."""
    if requested not in BACKENDS:
        raise ValueError(f"--fp8-gemm-backend {requested!r} with --quantization w8a8_fp8: choose one of "
                         f"{list(BACKENDS)} (the others are block-wise --quantization fp8 kernels)")
    if requested == "dequant" or device.type != "cuda":
        return "dequant"
    problem = _scaled_mm_problem(device.index if device.index is not None else torch.cuda.current_device())
    if problem is not None:
        logger.warning("--quantization w8a8_fp8: the dequant path (a bf16 GEMM over dequantized weights), since %s",
                       problem)
        return "dequant"
    logger.info("--quantization w8a8_fp8: torch._scaled_mm's row-wise FP8 GEMM for bf16 inputs whose weight has "
                "rows and columns in multiples of 16; a GEMM over the dequantized weight otherwise")
    return "scaled_mm"


def rowwise_runs(x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm``'s row-wise path takes this call: bf16 out, some tokens, and ``K``, ``N``
    multiples of 16 (its checks; other calls take the dequant path)."""
    out_features, in_features = values.shape
    return (x.dtype == torch.bfloat16 and x.numel() > 0 and out_features % 16 == 0 and in_features % 16 == 0)


def channel_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                   backend: str, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x [..., K] @ Wᵀ (+ bias)`` in ``x``'s dtype, ``W`` per-channel FP8 (the dequant path where the
    row-wise GEMM does not take the call: :func:`rowwise_runs`). ``quantized``: ``x``'s per-token e4m3
    activations made by its producer (``[M, K]``, ``[M, 1]``), used on the row-wise path."""
    if backend == "dequant" or not rowwise_runs(x, values):
        return nn.functional.linear(x, dequantize(values, scales, x.dtype), bias)
    rows = x.reshape(-1, x.shape[-1])
    out = scaled_mm(rows, values, scales, x.dtype, quantized).view(*x.shape[:-1], values.shape[0])
    return out if bias is None else out + bias


class ChannelFp8Linear(QuantizedLinear):
    """A ``nn.Linear`` whose weight lives as e4m3 ``weight_fp8 [N, K]`` + fp32 ``weight_scale [N, 1]``; bias in
    the model dtype. A fused projection's parts may have any row counts."""

    #: how a producer quantizes this layer's input for it (``fused_ops``: per token, the whole row)
    activation_scaling = "token"
    #: how the weight-update path (``fp8.Fp8Weights``) writes and reads this layer's storage
    quantize_into = staticmethod(quantize_rows_into)
    dequantize = staticmethod(dequantize)

    def __init__(self, linear: nn.Linear, backend: str):
        super().__init__(linear, backend, *quantize_weight(linear.weight), scales_name="weight_scale")

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows ``[start, end)`` (a fused projection's part: any rows) and their scales."""
        return self.weight_fp8[start:end], self.weight_scale[start:end]

    def takes_quantized(self, rows: int, device: torch.device) -> bool:
        """Whether a GEMM of ``rows`` tokens would use offered per-token e4m3 activations (the row-wise path)."""
        return (self.backend == "scaled_mm" and self.dtype == torch.bfloat16 and rows > 0
                and self.out_features % 16 == 0 and self.in_features % 16 == 0)

    def forward(self, x: torch.Tensor, accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
        offered, self._offered = self._offered, None
        quantized = offered[1] if offered is not None and offered[0] is x else None
        out = channel_linear(x, self.weight_fp8, self.weight_scale, self.bias, self.backend, quantized)
        return out if accumulate_into is None else accumulate_into.add_(out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per channel, {self.backend}"
