"""Per-channel FP8 (``--quantization w8a8_fp8``): SGLang's W8A8 FP8 method, quantized online.

What SGLang does with ``--quantization w8a8_fp8`` on a bf16 checkpoint on Hopper (its
``layers/quantization/w8a8_fp8.py`` and ``fp8_utils.apply_fp8_linear``; also what its ``fp8`` method does
to a checkpoint without ``weight_block_size``): each weight ``W [N, K]`` becomes e4m3 values and one fp32
scale per output channel, ``s_n = amax(|W[n, :]|) / 448``, ``Q = e4m3(W / s)``; each activation row is
quantized the same way per token at every call (dynamic); the GEMM multiplies the e4m3 operands with fp32
accumulation and applies ``s_token · s_channel`` once, in its epilogue. The block-wise form (``block.py``)
instead rescales at every 128-wide K group, which the Triton GEMM pays for on sm_90 (its wgmma waits on
each group); here the scales stay out of the main loop.

Paths (``--fp8-gemm-backend``; SGLang's ``--fp8-gemm-runner-backend`` names where it has them):

* ``cutlass``: ``torch._scaled_mm`` with row-wise scales (``scale_a [M, 1]``, ``scale_b [1, N]``: PyTorch's
  CUTLASS row-wise kernel, sm_90 only), after an eager check against the reference at start; bf16 calls
  with ``K``, ``N`` multiples of 16 (others take the dequant path). The residual add after the down
  projection stays a separate kernel (the call has no epilogue add).
* ``triton``: ``fp8_triton``'s two-kernel GEMM in its per-channel mode (``PER_CHANNEL``: the K loop is a
  plain e4m3 dot accumulating in fp32, the two scales applied once after it; TMA loads on Hopper; split-K
  for decode shapes), any shape and output dtype, the residual add in its epilogue; needs FP8 tensor cores
  (sm_89+).
* ``cublas``: cuBLASLt's scalar-scale FP8 GEMM (``torch._scaled_mm`` with unit scales: the kernels cuBLAS tunes
  for plain FP8, which the row-wise and block-wise recipes do not reach) on the e4m3 operands, the product left
  unscaled (:func:`unscaled_mm`), for the GEMMs whose reader applies the two scales as it loads the product: the
  attention's q/k/v projection at decode sizes (the q/k norm + rotary kernel, which also stores the keys and
  values), its output projection (the residual add + RMSNorm kernel after it) and the MLP's down projection of
  every decoder layer but the last (the next layer's input RMSNorm, which adds the residual too:
  ``fused_ops.DOWN_SCALES_TO_NEXT_LAYER``), up to :data:`DEFERRED_MAX_ROWS` tokens
  (:meth:`ChannelFp8Linear.defers_scales`). Every other call (gate/up, at ~0.6x of bf16 on Triton already and read
  by the SiLU gate; the last layer's down; prefill; a reader that cannot take the scales) runs on
  :func:`fallback_backend`'s path (``triton``, else ``cutlass``). Needs Triton, FP8 tensor cores (sm_89+), K, N
  multiples of 16 and a bf16 or fp32 model (the unscaled product, in the model's dtype, overflows fp16).
* ``auto``: ``cublas`` where it runs, else ``triton``, else ``cutlass`` (:data:`AUTO_ORDER`), else ``dequant``.
* ``dequant`` (the CPU's): ``x`` times the dequantized weight in ``x``'s dtype (the weights' rounding only,
  like ``block.py``'s ``dequant``).

Both FP8 paths take their activations quantized by one Triton launch (:func:`quantize_tokens`) or already
by the kernel that produced them (``fused_ops``, ``quantize="token"``: the RMSNorms for q/k/v and gate/up,
the SiLU gate for down; :meth:`ChannelFp8Linear.takes_quantized`).

Weights live in the module as ``weight_fp8 [N, K]`` and ``weight_scale [N, 1]`` (SGLang's names). Any rows
of a fused projection are a part's own channels, so a weight update quantizes a part into its rows without
the 128-row alignment the blocks need. Routed experts (:class:`ChannelFp8Experts`) keep one scale per output channel
of each expert's gate, up and down matrix (``gate_fp8 [E, I, H]``, ``gate_scale [E, I, 1]``, ...).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from slime.backends.embedded_engine.fp8.block import Fp8Experts, QuantizedLinear
from slime.backends.embedded_engine.fp8.numerics import FP8_DTYPE, FP8_MAX, _scales_from_amax

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cutlass", "triton", "cublas", "dequant")
# The token quantizer holds a row of up to QUANTIZE_ONE_PASS columns whole (one read; 8 warps: 16 values a thread
# at 4096, o_proj's input on Qwen3-4B) and streams longer rows QUANTIZE_BLOCK columns at a time, twice (its peak,
# then the values), as fused_ops' per-token SiLU gate. H200, Qwen3-4B decode step at 128 rows (session 26): o_proj's
# quantize launches 108 -> 65 us a step.
QUANTIZE_ONE_PASS = 16384
QUANTIZE_BLOCK = 1024
# The ``cublas`` backend's deferred-scale GEMMs serve calls of up to this many tokens (decode and verify steps,
# short prefills); larger prefills take the fallback path, whose epilogue scales the product itself.
DEFERRED_MAX_ROWS = 512

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
    """A weight's (or a stack of experts' ``[E, N, K]``) :func:`quantize_rows`: on CUDA by :func:`quantize_tokens`'
    one launch (the same numbers), elsewhere by torch."""
    if not matrix.is_cuda:
        return quantize_rows(matrix)
    values, scales = quantize_tokens(matrix.reshape(-1, matrix.shape[-1]))
    return values.view(matrix.shape), scales.view(*matrix.shape[:-1], 1)


@torch.no_grad()
def quantize_rows_into(matrix: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`quantize_weight` written into existing storage (views: a fused projection's rows)."""
    q, s = quantize_weight(matrix.to(device=values.device))
    values.copy_(q)
    scales.copy_(s)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (values.float() * scales).to(dtype)


if triton is not None:
    from slime.backends.embedded_engine.fp8.triton_kernels import _round_to_e4m3_grid

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
                                BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        """Program ``m``: row ``m`` of ``x`` -> its e4m3 values and scale (:func:`_quantize_token`): the row held
        whole (``ONE_PASS``: ``BLOCK >= K``), else read twice ``BLOCK`` columns at a time (its peak, then the
        values)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        if ONE_PASS:
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
            q, scale = _quantize_token(x, tl.max(tl.abs(x), axis=0), fp8_max, EMULATE_E4M3_CAST)
            tl.store(q_ptr + row * stride_qm + cols, q, mask=cols < K)
            tl.store(s_ptr + row, scale)
            return
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
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not fp8_triton.available(x.device):
        return quantize_rows(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    values = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        whole = triton.next_power_of_2(cols)
        one_pass = whole <= QUANTIZE_ONE_PASS
        _quantize_tokens_kernel[(rows,)](x, values, scales, rows, cols, x.stride(0), values.stride(0), FP8_MAX,
                                         BLOCK=whole if one_pass else QUANTIZE_BLOCK, ONE_PASS=one_pass,
                                         EMULATE_E4M3_CAST=fp8_triton._interpreting(),
                                         num_warps=max(4, min(16, whole // 512)) if one_pass else 4)
    return values, scales


def triton_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype,
                  quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                  accumulate_into: torch.Tensor | None = None, tiles=None) -> torch.Tensor:
    """``x [M, K]`` (quantized here per token, unless its producer did: ``quantized``) ``@ (values · scales)ᵀ``
    on ``fp8_triton``'s GEMM in its per-channel mode, ``[M, N]`` in ``out_dtype``; ``accumulate_into``: an
    ``[M, N]`` tensor the product is added to in its epilogue (in fp32, rounded once) and returned. Tiles as
    the block-wise two-kernel GEMM plans them (``tiles`` overrides: tests, ``bench/fp8_gemm.py``)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    rows, cols = x.shape
    if values.shape[1] != cols:
        raise ValueError(f"fp8 GEMM: activations have {cols} channels, the weight {values.shape[1]}")
    out = fp8_triton.output_for(rows, values.shape[0], out_dtype, x.device, accumulate_into)
    if rows == 0:
        return out
    x8, x_scales = quantized if quantized is not None else quantize_tokens(x)
    if x_scales.shape != (rows, 1) or x_scales.stride(0) != 1 or scales.stride(0) != 1:
        raise ValueError("fp8 GEMM per channel: one contiguous scale a token and a weight row, got "
                         f"{tuple(x_scales.shape)} / {tuple(scales.shape)} with strides {x_scales.stride()} / "
                         f"{scales.stride()}")
    tma = fp8_triton.tma_usable(x8, values)
    if tiles is None:
        tiles = (plan_tiles(rows, values.shape[0], cols, x.device) if tma
                 else fp8_triton.plan_tiles(rows, values.shape[0], cols, x.device, a_quantized=True))
    fp8_triton.launch_gemm(x8, x_scales, 0, values, scales, out, tiles, a_quantized=True, tma=tma,
                           accumulate=accumulate_into is not None, per_channel=True)
    return out


def plan_tiles(rows: int, out_features: int, in_features: int, device: torch.device):
    """The per-channel Triton GEMM's launch where it loads by TMA: for now the block-wise two-kernel GEMM's
    (``fp8_triton.plan_tma_tiles``, fitted to H200 sweeps of that kernel), not yet swept for this one
    (``bench/fp8_gemm.py --rowwise --sweep channel`` over :func:`candidate_tiles`)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    return fp8_triton.plan_tma_tiles(rows, out_features, in_features, device)


def candidate_tiles(rows: int, in_features: int) -> list:
    """The launches ``bench/fp8_gemm.py --sweep channel`` times: the block-wise GEMM's TMA candidates; 32-column
    tiles (unsplit or split two ways, 4-6 stages of 12 KiB at 64 rows), which give the narrow output projections
    (o and down: 2560 columns on 4B, 80 programs of 64 x 64 for 132 SMs at 128 tokens) twice the programs without a
    split-K reduction; and, above 64 tokens, 128-row tiles on two warp groups (8 warps), which read each weight tile
    once for up to 128 tokens — without a scale to apply at every K step the per-channel loop may afford them
    (compiled for sm_90 without spills: 58-157 registers a thread, one or two programs an SM)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    candidates = fp8_triton.tma_candidates(rows, in_features)
    k_steps = -(-in_features // fp8_triton.BLOCK)
    candidates += [fp8_triton.Tiles(16 if rows <= 16 else 64, 32, split, num_warps=4, num_stages=stages)
                   for split in (1, 2) if split == 1 or k_steps >= 2 * split for stages in (4, 5, 6)]
    if rows > 64:
        candidates += [fp8_triton.Tiles(128, block_n, split, num_warps=8, num_stages=stages)
                       for block_n in (64, 128) for split in (1, 2, 4, 8) if split == 1 or k_steps >= 2 * split
                       for stages in (3, 4, 5)]
    return candidates


def scaled_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype,
              quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x [M, K]`` (quantized here per token, unless its producer did: ``quantized``) ``@ (values · scales)ᵀ``
    on ``torch._scaled_mm``'s row-wise path."""
    x8, x_scales = quantized if quantized is not None else quantize_tokens(x)
    return torch._scaled_mm(x8, values.t(), scale_a=x_scales, scale_b=scales.t(), out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    """The scalar 1 :func:`unscaled_mm` hands cuBLASLt as both scales, one per device, made eagerly (the engine's
    check of the backend at start makes it): a fill captured in a CUDA graph would run only when that graph does."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fp8 cublas: the unit scale must exist before a CUDA graph is captured "
                           "(fp8_channel.resolve_backend('cublas', device) makes it)")
    return torch.ones((), dtype=torch.float32, device=device)


def unscaled_mm(x8: torch.Tensor, values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``x8 [M, K] @ values [N, K]ᵀ`` with no scales (``[M, N]``: the fp32 sum of products of the e4m3 numbers,
    rounded once to ``out_dtype``), on cuBLASLt's scalar-scale FP8 GEMM; the token and channel scales are the
    reader's to apply (:func:`apply_scales`, or a ``fused_ops`` kernel)."""
    one = _unit_scale(x8.device)
    return torch._scaled_mm(x8, values.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)


def apply_scales(raw: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An :func:`unscaled_mm` product ``[..., N]`` (tokens in row order) times its token scales ``[M, 1]`` and channel
    scales ``[N, 1]``, in fp32, rounded once to ``raw``'s dtype: what the ``fused_ops`` kernels compute as they load
    it (the same operations in the same order)."""
    token_scales, channel_scales = scales
    rows = raw.reshape(-1, raw.shape[-1])
    return (rows.float() * token_scales * channel_scales.view(1, -1)).to(raw.dtype).view(raw.shape)


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
    if not error <= 2e-2:  # NaN too
        return f"torch._scaled_mm's row-wise result is off the reference by {error:.3g} (relative)"
    return None


def _triton_problem(device: torch.device) -> str | None:
    """Why the per-channel Triton GEMM cannot run on ``device`` (None: it can): Triton and FP8 tensor cores
    (sm_89+), or the CPU under Triton's interpreter."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not fp8_triton.available(device):
        return "it needs CUDA and the triton package (or TRITON_INTERPRET=1 on the CPU, for tests)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device.index if device.index is not None
                                                        else torch.cuda.current_device())
        if (major, minor) < (8, 9):
            return f"e4m3 tensor-core dots need sm_89 or newer; this GPU is sm_{major}{minor}"
    return None


# ``auto``'s preference among the FP8 paths, the first that runs here taken. cublas first: the H100 A/B of session 28
# (Qwen3-4B, bench/results/*-nvidia-h100-20261205-*-s27.json, at 9db6952; no H200 was lent): cuBLASLt's unscaled GEMMs
# at 128 tokens took 9.7 / 8.5 us for q/k/v and o against the Triton GEMM's 11.4 / 12.0 (bf16 14.8 / 11.3), a decode
# step of 128 rows 4.57 ms against 4.75 (bf16 5.50), engine_decode 128 x (16 + 256) 216.6 steps/s against 206.4 (bf16
# 179.6). The H200 agrees (session 30, aef5920, bench/results/engine_decode-nvidia-h200-20261205-*-s29.json, with the
# down projection's hand-off): engine_decode 262.0 steps/s on cublas against triton's 242.1 (bf16 225.9); the H100 with
# the hand-off 223.4 against bf16's 181.6 (f78b2b9, *-s30.json). triton before cutlass: the H200 A/B of session 25
# (bench/results/*-20261205-*-s25.json): per layer at 16 / 64 / 128 tokens the Triton GEMMs took 52 / 52 / 58 us against
# torch._scaled_mm's row-wise 79 / 77 / 76 (bf16: 70 / 71 / 74); a decode step of 128 rows 4.19 ms against 4.78 (bf16
# 4.36). cutlass stays for where Triton is missing.
AUTO_ORDER = ("cublas", "triton", "cutlass")


@functools.lru_cache(maxsize=None)
def _unscaled_mm_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the scalar-scale FP8 GEMM (cuBLASLt's on CUDA) cannot serve a ``dtype`` model on ``device`` (None: it
    can). Checked once, eagerly: FP8 tensor cores (sm_89+), and a GEMM writing ``dtype`` against the dequantized
    reference (it also makes the device's unit scale before any graph is captured)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device.index)
        if (major, minor) < (8, 9):
            return f"cuBLASLt's FP8 GEMM needs sm_89 or newer; this GPU is sm_{major}{minor}"
    gen = torch.Generator(device=device).manual_seed(0)
    x8, x_scales = quantize_rows(torch.randn(48, 384, generator=gen, device=device))
    values, scales = quantize_rows(torch.randn(272, 384, generator=gen, device=device) / 20)
    try:
        out = apply_scales(unscaled_mm(x8, values, dtype), (x_scales, scales)).float()
    except (RuntimeError, ValueError) as error:
        return f"torch._scaled_mm refused e4m3 operands with unit scales writing {dtype}: {str(error).splitlines()[0]}"
    expected = dequantize(x8, x_scales) @ dequantize(values, scales).t()
    error = float((out - expected).abs().max() / expected.abs().max())
    if not error <= 2e-2:  # NaN too
        return f"torch._scaled_mm's scalar-scale result is off the reference by {error:.3g} (relative)"
    return None


_E4M3_PRODUCT_MAX = 448.0 * 448.0  # the largest product of two e4m3 values; sums of K of them are larger still


def _cublas_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the ``cublas`` backend cannot serve a ``dtype`` model on ``device`` (None: it can): cuBLASLt's GEMM
    (:func:`_unscaled_mm_problem`), and Triton, whose kernels apply the scales it leaves out and run its other GEMMs
    (without them every call would take the fallback: ``cutlass`` by another name)."""
    if device.type != "cuda":
        return "cuBLASLt's FP8 GEMM is used on CUDA only"
    if torch.finfo(dtype).max < _E4M3_PRODUCT_MAX:
        return (f"its unscaled product is written in the model's dtype, and one product of two e4m3 values (up to "
                f"448 x 448) already overflows {dtype}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    problem = _unscaled_mm_problem(torch.device("cuda", index), dtype)
    if problem is None and (triton_problem := _triton_problem(device)) is not None:
        problem = f"the kernels that apply its scales are Triton's, and {triton_problem}"
    return problem


def fallback_backend(device: torch.device) -> str:
    """The path the ``cublas`` backend's other GEMMs take on ``device``: ``triton`` where it runs, else ``cutlass``
    (whose calls of shapes it does not take use the dequantized weight)."""
    return "triton" if _triton_problem(device) is None else "cutlass"


def _cutlass_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch._scaled_mm``'s row-wise path cannot serve a ``dtype`` model on ``device`` (None: it can)."""
    if device.type != "cuda":
        return "torch._scaled_mm's row-wise FP8 GEMM is used on CUDA only"
    if dtype != torch.bfloat16:
        return f"torch._scaled_mm's row-wise FP8 GEMM writes bf16 and this model runs in {dtype}"
    return _scaled_mm_problem(device.index if device.index is not None else torch.cuda.current_device())


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The path an engine on ``device`` serving a ``dtype`` model runs: ``cutlass`` / ``triton`` / ``cublas`` as asked
    (refused where they cannot run, with the reason), ``auto`` -> the first of :data:`AUTO_ORDER` that runs, else
    ``dequant`` (the reasons in the log; the CPU's path)."""
    if requested not in BACKENDS:
        raise ValueError(f"--fp8-gemm-backend {requested!r} with --quantization w8a8_fp8: choose one of "
                         f"{list(BACKENDS)} (the others are block-wise --quantization fp8 kernels)")
    if requested == "dequant":
        return "dequant"
    problems = {"cutlass": lambda: _cutlass_problem(device, dtype), "triton": lambda: _triton_problem(device),
                "cublas": lambda: _cublas_problem(device, dtype)}
    if requested != "auto":
        problem = problems[requested]()
        if problem is not None:
            runs = [path for path in AUTO_ORDER if path != requested and problems[path]() is None]
            other = f"{runs[0]} or dequant" if runs else "dequant"  # the fastest that runs here
            raise ValueError(f"--fp8-gemm-backend {requested} with --quantization w8a8_fp8 cannot run here: "
                             f"{problem}; use --fp8-gemm-backend {other}")
        return requested
    if device.type != "cuda":  # the CPU's path (the Triton GEMM runs there only under the interpreter, for tests)
        return "dequant"
    reasons = []
    for path in AUTO_ORDER:
        problem = problems[path]()
        if problem is None:
            if reasons:
                logger.info("--quantization w8a8_fp8: the %s GEMM, since %s", path, "; ".join(reasons))
            elif path == "cublas":
                logger.info("--quantization w8a8_fp8: cuBLASLt's FP8 GEMM for the attention's projections and the "
                            "MLP's down projection at decode sizes (their scales applied by the kernels that read "
                            "them), the per-channel Triton FP8 GEMM for the others")
            elif path == "cutlass":
                logger.info("--quantization w8a8_fp8: torch._scaled_mm's row-wise FP8 GEMM (cutlass) for bf16 "
                            "inputs whose weight has rows and columns in multiples of 16; over the dequantized weight "
                            "otherwise")
            else:
                logger.info("--quantization w8a8_fp8: the per-channel Triton FP8 GEMM")
            return path
        reasons.append(f"{path}: {problem}")
    logger.warning("--quantization w8a8_fp8: the dequant path (a GEMM over dequantized weights), since %s",
                   "; ".join(reasons))
    return "dequant"


def rowwise_runs(x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm``'s row-wise path takes this call: bf16 out, some tokens, and ``K``, ``N``
    multiples of 16 (its checks; other calls take the dequant path)."""
    out_features, in_features = values.shape
    return (x.dtype == torch.bfloat16 and x.numel() > 0 and out_features % 16 == 0 and in_features % 16 == 0)


def channel_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                   backend: str, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                   accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ Wᵀ (+ bias)`` in ``x``'s dtype, ``W`` per-channel FP8 on ``backend``'s path (``cutlass``:
    the dequant path for calls the row-wise GEMM does not take, :func:`rowwise_runs`). ``quantized``: ``x``'s
    per-token e4m3 activations made by its producer (``[M, K]``, ``[M, 1]``), used on the FP8 paths.
    ``accumulate_into``: a tensor of the output's shape and dtype the product is added to in place (the
    residual add: in the Triton GEMM's epilogue, else a separate add), returned."""
    if backend == "cublas":  # a call whose reader does not apply the scales (ChannelFp8Linear.defers_scales)
        backend = fallback_backend(x.device)
    if backend == "dequant" or (backend == "cutlass" and not rowwise_runs(x, values)):
        out = nn.functional.linear(x, dequantize(values, scales, x.dtype), bias)
        return out if accumulate_into is None else accumulate_into.add_(out)
    rows = x.reshape(-1, x.shape[-1])
    if backend == "triton" and bias is None and accumulate_into is not None:
        triton_matmul(rows, values, scales, x.dtype, quantized, accumulate_into.view(-1, values.shape[0]))
        return accumulate_into
    if backend == "triton":
        out = triton_matmul(rows, values, scales, x.dtype, quantized)
    else:
        out = scaled_mm(rows, values, scales, x.dtype, quantized)
    out = out.view(*x.shape[:-1], values.shape[0])
    out = out if bias is None else out + bias
    return out if accumulate_into is None else accumulate_into.add_(out)


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
        #: the next call's product is to be left unscaled for its reader (defer_scales_once), and that product with
        #: its scales once made (take_scales)
        self._defer = False
        self._deferred: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows ``[start, end)`` (a fused projection's part: any rows) and their scales."""
        return self.weight_fp8[start:end], self.weight_scale[start:end]

    def takes_quantized(self, rows: int, device: torch.device) -> bool:
        """Whether a GEMM of ``rows`` tokens would use offered per-token e4m3 activations (an FP8 path)."""
        backend = self.backend
        if backend == "cublas":
            if self.defers_scales(rows, device):
                return True
            backend = fallback_backend(device)
        if backend == "triton":
            return rows > 0
        return (backend == "cutlass" and self.dtype == torch.bfloat16 and rows > 0
                and self.out_features % 16 == 0 and self.in_features % 16 == 0)

    def defers_scales(self, rows: int, device: torch.device) -> bool:
        """Whether a call of ``rows`` tokens can leave its product unscaled for a reader that applies the scales
        (:meth:`forward_unscaled`; the ``cublas`` backend, up to :data:`DEFERRED_MAX_ROWS` tokens, no bias, K and N
        multiples of 16)."""
        return (self.backend == "cublas" and 0 < rows <= DEFERRED_MAX_ROWS and self.bias is None
                and self.out_features % 16 == 0 and self.in_features % 16 == 0)

    def forward_unscaled(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [..., K]`` -> (its e4m3 product with the weight, unscaled, ``[..., N]`` in ``x``'s dtype
        (:func:`unscaled_mm`); (the token scales ``[M, 1]``, the channel scales ``[N, 1]``)), for a reader that applies them
        (:func:`apply_scales` says how). Uses activations offered by their producer."""
        x8, x_scales = self.take_offered(x) or quantize_tokens(x.reshape(-1, x.shape[-1]))
        raw = unscaled_mm(x8, self.weight_fp8, x.dtype)
        return raw.view(*x.shape[:-1], self.out_features), (x_scales, self.weight_scale)

    def defer_scales_once(self) -> None:
        """The next call's reader applies the scales (``fused_ops``' residual add + RMSNorm after the attention;
        the down projection's product goes to the next layer by ``forward_unscaled`` directly):
        that call returns :meth:`forward_unscaled`'s product and keeps the scales for :meth:`take_scales`."""
        self._defer = True

    def take_scales(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The scales of ``out``, the unscaled product of the call :meth:`defer_scales_once` announced; None when that
        call did not defer (``out`` is scaled). Refused when that product was not handed on as it is (``out`` is
        another tensor: whatever made it from the unscaled product is wrong)."""
        deferred, self._deferred, self._defer = self._deferred, None, False
        if deferred is None:
            return None
        if deferred[0] is not out:
            raise RuntimeError("fp8 cublas: the output projection's unscaled product did not reach the residual add "
                               "as it left the GEMM (the attention forward changed it); its scales cannot be applied")
        return deferred[1]

    def forward(self, x: torch.Tensor, accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
        defer, self._defer = self._defer, False
        if defer and accumulate_into is None and self.defers_scales(x.numel() // x.shape[-1], x.device):
            self._deferred = self.forward_unscaled(x)
            return self._deferred[0]
        return channel_linear(x, self.weight_fp8, self.weight_scale, self.bias, self.backend, self.take_offered(x),
                              accumulate_into)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per channel, {self.backend}"


class ChannelFp8Experts(Fp8Experts):
    """transformers' fused routed experts with each expert's gate, up and down matrices quantized per output
    channel (``{gate,up,down}_fp8 [E, N, K]``, ``{gate,up,down}_scale [E, N, 1]``), each expert's GEMMs through
    :func:`channel_linear` on the engine's path; routing, the dense CUDA-graph form and the update path are
    ``fp8.Fp8Experts``'."""

    quantize_into = staticmethod(quantize_rows_into)
    dequantize = staticmethod(dequantize)
    quantize = staticmethod(quantize_weight)
    scales_suffix = "scale"
    linear = staticmethod(channel_linear)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, intermediate={self.intermediate}, fp8 per channel, {self.backend}"
