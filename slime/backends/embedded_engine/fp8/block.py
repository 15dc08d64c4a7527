"""FP8 rollout (``--quantization fp8``): block-wise FP8 weights for the decoder's linear layers.

The policy is served in FP8 and re-quantized at every weight update, the way DeepSeek-V3's FP8
checkpoints store it: a weight ``W [N, K]`` is cut into 128 x 128 blocks (the last row and column of
blocks may be smaller), and block ``(i, j)`` is stored as e4m3 values with one fp32 scale::

    s_ij = amax(|W_block|) / 448          (448 = the largest e4m3 value; an all-zero block gets s = 1)
    Q_block = e4m3(W_block / s_ij)        (round to nearest; |W / s| <= 448, so nothing saturates)
    W_block ~= Q_block * s_ij             (the dequantized weight)

so the round-trip error of an element is at most half an e4m3 spacing of ``|W / s|`` times ``s``:
``|W| * 2^-4`` for normal e4m3 values, ``2^-10 * s`` in the subnormal range.

What is quantized: every ``nn.Linear`` inside the decoder layers (attention q/k/v/o, fused into one
``qkv_proj`` and ``gate_up_proj`` where each part is whole 128-row blocks, and their MLA
LoRA projections, MLP gate/up/down, shared experts) and the routed experts of transformers' fused
``experts`` modules. Embeddings, ``lm_head``, norms, MoE routers (``mlp.gate``) and, under the
absorbed MLA decode, ``kv_b_proj`` (read as a matrix by that path) stay in the model dtype. The KV
cache is untouched.

GEMM backends (``--fp8-gemm-backend``), each a row of :data:`GEMM_DISPATCH` (token-count ranges -> path):

* ``weight_only`` (CUDA): W8A16, ``fp8_triton.weight_only_matmul``: the activations stay in the model
  dtype, each e4m3 weight tile is dequantized in registers (``dequantize_weight``'s numbers) and
  multiplied on the bf16 tensor cores, so the output is the ``dequant`` path's with one byte read a
  weight. About bf16's speed up to 16 tokens, 0.4-0.7x from 64 up on the H200 (the dequantization
  and its register layout cost more than the bytes it saves); its point is the smaller train/rollout
  log-prob gap (no activation rounding).
* ``triton`` (CUDA): Triton kernels (``fp8_triton.py``). Up to :data:`FUSED_MAX_ROWS` tokens the fused
  kernel, which quantizes the activations per token and 128-channel group (``1 x 128`` blocks, the
  same formula) in registers inside the GEMM and multiplies e4m3 by e4m3; above, the two-kernel path:
  the activations quantized once by a separate kernel, then the GEMM on e4m3 A and its scales (the
  fused kernel re-quantizes each A tile in every column-tile program, which is what made it 0.37-0.54x
  of bf16 from 64 tokens up on the H200). The two-kernel GEMM loads its tiles by TMA where the rows are
  16-byte aligned (``fp8_triton.tma_usable``; all Qwen3 shapes), pointer loads elsewhere.
* ``cublas`` (Hopper, CUDA >= 12.9): cuBLASLt's block-scaled FP8 GEMM through ``torch._scaled_mm``
  (``fp8_cublas.py``), after the same separate activation quantizer; weight shapes it does not take
  fall back to the two-kernel Triton path (a log line once per shape).
* ``auto`` (the default): on CUDA, the fused kernel up to :data:`FUSED_MAX_ROWS` tokens, the
  two-kernel path up to :data:`TWO_KERNEL_MAX_ROWS` and cuBLASLt above where it runs (else the
  two-kernel path); ``dequant`` elsewhere.
* ``dequant`` (the default on CPU, a reference everywhere): dequantizes the weight to the model dtype
  and runs an ordinary matmul on unquantized activations.

Weight updates arrive under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
checkpoint-named experts ``...experts.3.gate_proj.weight`` or fused ``...experts.gate_up_proj``);
:class:`Fp8Weights` maps each such name to its quantized storage, quantizes the incoming tensor in
place (CUDA graphs keep pointing at the same buffers) and answers reads with the dequantized weight.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

logger = logging.getLogger(__name__)

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
QUANTIZATIONS = ("fp8", "w8a8_fp8")  # block-wise here; per-channel in fp8_channel.py
GEMM_BACKENDS = ("auto", "weight_only", "triton", "cublas", "dequant")
GEMM_PATHS = ("weight_only", "fused", "two_kernel", "cublas", "dequant")  # what a GEMM call runs; see GEMM_DISPATCH

# Which path a GEMM of M tokens takes, per backend: (largest M of the range, path), ranges in order,
# None = no upper bound. Source: bench/results/fp8_gemm-nvidia-h200-20261204-tma-s20.json (one decoder
# layer's linears of Qwen3-0.6B / 1.7B / 4B as the engine runs them, q/k/v and gate/up fused; the
# layer's time in bf16 over each path's), after the two-kernel GEMM moved to TMA loads: M = 16 fused
# W8A8 0.84 / 0.94 / 1.10, two-kernel 0.73 / 0.99 / 1.21; M = 64 two-kernel 0.55 / 0.79 / 1.13, cuBLASLt
# 0.62 / 0.74 / 0.85; M = 128 two-kernel 0.57 / 0.87 / 1.01, cuBLASLt 0.61 / 0.79 / 0.84; M = 256
# two-kernel 0.72 / 0.92 / 1.01, cuBLASLt 0.68 / 0.81 / 0.97; M = 512 cuBLASLt 0.75 / 1.08 / 1.18,
# two-kernel 0.79 / 1.06 / 1.06; weight-only 0.89 / 0.90 / 1.02 at 16, <= 0.85 from 32 up. ``auto`` keeps
# the W8A8 recipe (SGLang's block FP8) at every size, chosen for the larger models (FP8 does not pay on
# 0.6B at any size); the weight-only path (W8A16: the numbers of ``dequant``) is a backend of its own,
# for its smaller train/rollout gap, not its speed (docs/embedded_engine.md).
FUSED_MAX_ROWS = 16
TWO_KERNEL_MAX_ROWS = 256
GEMM_DISPATCH = {
    "auto": ((FUSED_MAX_ROWS, "fused"), (TWO_KERNEL_MAX_ROWS, "two_kernel"), (None, "cublas")),
    "weight_only": ((None, "weight_only"),),
    "triton": ((FUSED_MAX_ROWS, "fused"), (None, "two_kernel")),
    "cublas": ((None, "cublas"),),
    "dequant": ((None, "dequant"),),
}


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # divided by a tensor, not the Python number: PyTorch's CUDA kernels multiply by the reciprocal
    # of a scalar divisor (off by an ulp), and the Triton quantizer divides with correct rounding
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def _triton_quantizes(weight: torch.Tensor) -> bool:
    """Whether :func:`quantize_weight` runs ``fp8_triton``'s one-pass kernel on ``weight``: on CUDA with
    Triton (the CPU keeps the torch version, the reference the kernel is tested against)."""
    if not weight.is_cuda or weight.dim() > 3:
        return False
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    return fp8_triton.available(weight.device)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` -> (e4m3 values ``[..., N, K]``, fp32 scales ``[..., ceil(N/128), ceil(K/128)]``).
    Leading dimensions (experts) are quantized independently. On CUDA one Triton launch
    (``fp8_triton.quantize_weight_into``, the same numbers), elsewhere :func:`_quantize_weight_torch`."""
    if _triton_quantizes(weight):
        *lead, rows, cols = weight.shape
        values = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scales = torch.empty((*lead, _blocks(rows), _blocks(cols)), dtype=torch.float32, device=weight.device)
        quantize_weight_into(weight, values, scales)
        return values, scales
    return _quantize_weight_torch(weight)


@torch.no_grad()
def quantize_weight_into(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`quantize_weight` into existing storage (a weight update: captured CUDA graphs keep
    reading the same buffers); on CUDA without an intermediate copy."""
    if _triton_quantizes(weight) and values.stride(-1) == 1 and scales.stride(-1) == 1:
        from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

        fp8_triton.quantize_weight_into(weight, values, scales)
        return
    new_values, new_scales = _quantize_weight_torch(weight)
    values.copy_(new_values)
    scales.copy_(new_scales)


def _quantize_weight_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight` in torch ops (the reference; the CPU's path)."""
    *lead, rows, cols = weight.shape
    w = weight.float().reshape(-1, rows, cols)
    nb, kb = _blocks(rows), _blocks(cols)
    padded = torch.zeros((w.shape[0], nb * BLOCK, kb * BLOCK), dtype=torch.float32, device=w.device)
    padded[:, :rows, :cols] = w  # zero padding does not change a ragged block's amax
    tiles = padded.view(-1, nb, BLOCK, kb, BLOCK)
    scales = _scales_from_amax(tiles.abs().amax(dim=(2, 4)))
    values = (tiles / scales[:, :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    values = values.view(-1, nb * BLOCK, kb * BLOCK)[:, :rows, :cols]
    return values.reshape(*lead, rows, cols).contiguous(), scales.reshape(*lead, nb, kb)


def dequantize_weight(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_weight`: ``values * scale`` of each element's block, in ``dtype``."""
    *lead, rows, cols = values.shape
    nb, kb = scales.shape[-2:]
    if rows == nb * BLOCK and cols == kb * BLOCK:  # whole blocks: broadcast the scales, no expanded copy
        tiles = values.float().view(*lead, nb, BLOCK, kb, BLOCK) * scales[..., :, None, :, None]
        return tiles.view(*lead, rows, cols).to(dtype)
    expanded = scales.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]
    return (values.float() * expanded).to(dtype)


@torch.no_grad()
def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, ceil(K/128)]``): one scale per token and
    128-channel group (the reference of the Triton activation quantizer and of the fused GEMM's own)."""
    rows, cols = x.shape
    kb = _blocks(cols)
    padded = torch.zeros((rows, kb * BLOCK), dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    groups = padded.view(rows, kb, BLOCK)
    scales = _scales_from_amax(groups.abs().amax(dim=-1))
    values = (groups / scales[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, -1)[:, :cols]
    return values.contiguous(), scales


def reference_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                     quantize_inputs: bool) -> torch.Tensor:
    """fp32 ``x [M, K] @ dequant(W)ᵀ`` (``x`` rounded through :func:`quantize_activation` first when
    ``quantize_inputs``): what the Triton GEMM computes, written plainly."""
    if quantize_inputs:
        q, s = quantize_activation(x)
        x = q.float() * s.repeat_interleave(BLOCK, dim=-1)[:, : x.shape[1]]
    return x.float() @ dequantize_weight(values, scales, torch.float32).T


def resolve_backend(requested: str, device: torch.device) -> str:
    """The backend an engine on ``device`` runs: ``auto`` stays ``auto`` on CUDA with Triton (its
    :data:`GEMM_DISPATCH` row) and is ``dequant`` elsewhere; ``weight_only`` / ``triton`` / ``cublas``
    are refused where they cannot run."""
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if requested not in GEMM_BACKENDS:
        raise ValueError(f"--fp8-gemm-backend {requested!r} is not supported; choose one of {list(GEMM_BACKENDS)}")
    if requested == "auto":
        if not (fp8_triton.available(device) and device.type == "cuda"):
            return "dequant"
        reason = fp8_cublas.unavailable_reason(device)  # eagerly, before any CUDA graph: checks cuBLASLt once
        if reason is not None:
            logger.info("--fp8-gemm-backend auto: above %d tokens the two-kernel Triton GEMM, not cuBLASLt: %s",
                        TWO_KERNEL_MAX_ROWS, reason)
        return "auto"
    if requested in ("triton", "weight_only") and not fp8_triton.available(device):
        raise ValueError(f"--fp8-gemm-backend {requested} needs --device cuda and the triton package (or, for tests on the "
                         "CPU, TRITON_INTERPRET=1); use --fp8-gemm-backend dequant")
    if requested == "cublas":
        reason = fp8_cublas.unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"--fp8-gemm-backend cublas (cuBLASLt's 1x128/128x128 block-scaled FP8 GEMM) cannot run "
                             f"here: {reason}; use --fp8-gemm-backend triton")
    return requested


def dispatch_path(backend: str, rows: int) -> str:
    """The :data:`GEMM_DISPATCH` path of ``backend`` for ``rows`` tokens (before shape fallbacks)."""
    for max_rows, path in GEMM_DISPATCH[backend]:
        if max_rows is None or rows <= max_rows:
            return path
    raise AssertionError(f"GEMM_DISPATCH[{backend!r}] has no open-ended last range")


_logged_fallbacks: set[tuple[int, int, str]] = set()


def gemm_path(backend: str, rows: int, out_features: int, in_features: int, device: torch.device) -> str:
    """The path a ``[rows, in_features] x [out_features, in_features]ᵀ`` GEMM takes under ``backend``:
    :func:`dispatch_path`, with ``cublas`` replaced by ``two_kernel`` where cuBLASLt does not run on
    ``device`` or does not take the shape (logged once per shape)."""
    path = dispatch_path(backend, rows)
    if path != "cublas":
        return path
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    if fp8_cublas.available(device) and fp8_cublas.shape_supported(out_features, in_features):
        return path
    key = (out_features, in_features, str(device))
    if key not in _logged_fallbacks:
        _logged_fallbacks.add(key)
        why = ("cuBLASLt's block-scaled FP8 GEMM takes N % 16 == 0 and K % 512 == 0" if fp8_cublas.available(device)
               else f"cuBLASLt's block-scaled FP8 GEMM is not used: {fp8_cublas.unavailable_reason(device)}")
        logger.info("fp8 GEMM [%d x %d] weight: %s; this shape uses the two-kernel Triton GEMM",
                    out_features, in_features, why)
    return "two_kernel"


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               backend: str, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
               accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ Wᵀ (+ bias)`` with ``W`` block-quantized, in ``x``'s dtype, on the path
    :func:`gemm_path` picks for ``backend`` and this many tokens. ``quantized``: ``x``'s e4m3
    activations already made by its producer (used where the path is the two-kernel GEMM, whose
    quantize launch it replaces; ignored elsewhere). ``accumulate_into``: a tensor of the output's
    shape and dtype the product is added to in place (the residual add; inside the two-kernel GEMM's
    epilogue where that is the path, else a separate add), returned."""
    if backend == "dequant":
        out = nn.functional.linear(x, dequantize_weight(values, scales, x.dtype), bias)
        return out if accumulate_into is None else accumulate_into.add_(out)
    rows = x.reshape(-1, x.shape[-1])
    path = gemm_path(backend, rows.shape[0], values.shape[0], values.shape[1], x.device)
    if path == "two_kernel" and bias is None and (quantized is not None or accumulate_into is not None):
        from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

        target = None if accumulate_into is None else accumulate_into.view(-1, values.shape[0])
        out = fp8_triton.w8a8_block_matmul(rows, values, scales, out_dtype=x.dtype, quantize_first=True,
                                           quantized=quantized, accumulate_into=target)
        return accumulate_into if accumulate_into is not None else out.view(*x.shape[:-1], values.shape[0])
    if accumulate_into is not None:
        return accumulate_into.add_(fp8_linear(x, values, scales, bias, backend))
    if path == "weight_only":
        from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

        out = fp8_triton.weight_only_matmul(rows, values, scales)
    elif path == "cublas":
        from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

        out = fp8_cublas.block_matmul(rows, values, scales, out_dtype=x.dtype)
    else:
        from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

        out = fp8_triton.w8a8_block_matmul(rows, values, scales, out_dtype=x.dtype,
                                           quantize_first=path == "two_kernel")
    out = out.view(*x.shape[:-1], values.shape[0])
    return out if bias is None else out + bias


class QuantizedLinear(nn.Module):
    """What an FP8 ``nn.Linear`` keeps of the one it replaces: its sizes, dtype, bias, GEMM backend and, for a
    fused projection (``fused_projections.FusedLinear``), its parts' rows; e4m3 ``weight_fp8 [N, K]`` and the
    scales (``scales_name``: per block here, per channel in ``fp8_channel.ChannelFp8Linear``) as buffers."""

    def __init__(self, linear: nn.Linear, backend: str, values: torch.Tensor, scales: torch.Tensor,
                 scales_name: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.backend = backend
        self.register_buffer("weight_fp8", values)
        self.register_buffer(scales_name, scales)
        self.scales_name = scales_name
        self.bias = linear.bias
        self.parts = dict(getattr(linear, "parts", {}))
        self.sizes = list(getattr(linear, "sizes", []))
        #: (input, its e4m3 values and scales) handed over by the kernel that produced the input (offer)
        self._offered: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def offer(self, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The producer of this layer's next input ``x`` (an RMSNorm or SiLU gate of ``fused_ops``) has
        quantized it already (as :attr:`activation_scaling` says): the next call with this very tensor uses
        those values instead of quantizing again (any other call drops them)."""
        self._offered = (x, quantized)

    def take_offered(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The activations :meth:`offer` handed over for this very ``x`` (None otherwise); the offer is used up
        either way."""
        offered, self._offered = self._offered, None
        return offered[1] if offered is not None and offered[0] is x else None

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A fused projection's output cut into its parts (``FusedLinear.split``)."""
        return out.split(self.sizes, dim=-1)

    @property
    def scales(self) -> torch.Tensor:
        return getattr(self, self.scales_name)


class Fp8Linear(QuantizedLinear):
    """A ``nn.Linear`` whose weight lives as e4m3 ``weight_fp8 [N, K]`` + fp32 ``weight_scale_inv
    [ceil(N/128), ceil(K/128)]`` (DeepSeek-V3's name for the per-block scale); bias in the model dtype. A fused
    projection's parts are whole 128-row blocks each."""

    #: how a producer quantizes this layer's input for it (``fused_ops``: per token and 128-channel group)
    activation_scaling = "group"
    #: how the weight-update path (:class:`Fp8Weights`) writes and reads this layer's storage
    quantize_into = staticmethod(quantize_weight_into)
    dequantize = staticmethod(dequantize_weight)

    def __init__(self, linear: nn.Linear, backend: str):
        super().__init__(linear, backend, *quantize_weight(linear.weight), scales_name="weight_scale_inv")

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows ``[start, end)`` (a fused projection's part: whole 128-row blocks) and their scales."""
        return self.weight_fp8[start:end], self.weight_scale_inv[start // BLOCK:end // BLOCK]

    def takes_quantized(self, rows: int, device: torch.device) -> bool:
        """Whether a GEMM of ``rows`` tokens would use offered e4m3 activations (the two-kernel path,
        whole 128-channel groups, no bias)."""
        return (self.bias is None and self.in_features % BLOCK == 0
                and gemm_path(self.backend, rows, self.out_features, self.in_features, device) == "two_kernel")

    def forward(self, x: torch.Tensor, accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scale_inv, self.bias, self.backend,
                          quantized=self.take_offered(x),
                          accumulate_into=accumulate_into)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128 blocks, {self.backend}"


class Fp8Experts(nn.Module):
    """transformers' fused routed experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, a
    ``forward(hidden_states, top_k_index, top_k_weights)``) with each expert's gate, up and down
    matrices block-quantized separately (so a checkpoint-named update of one touches only its own blocks)."""

    #: how the weight-update path (:class:`Fp8Weights`) writes and reads the storage, how it is made at load,
    #: the scales' buffer suffix and the GEMM (``fp8_channel.ChannelFp8Experts``: per channel)
    quantize_into = staticmethod(quantize_weight_into)
    dequantize = staticmethod(dequantize_weight)
    quantize = staticmethod(quantize_weight)
    scales_suffix = "scale_inv"
    linear = staticmethod(fp8_linear)

    def __init__(self, experts: nn.Module, backend: str):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.intermediate = experts.gate_up_proj.shape[1] // 2
        self.dtype = experts.gate_up_proj.dtype
        self.act_fn = experts.act_fn
        self.backend = backend
        gate_up = experts.gate_up_proj.detach()
        for kind, weight in (("gate", gate_up[:, :self.intermediate]), ("up", gate_up[:, self.intermediate:]),
                             ("down", experts.down_proj.detach())):
            values, scales = self.quantize(weight)
            self.register_buffer(f"{kind}_fp8", values)
            self.register_buffer(f"{kind}_{self.scales_suffix}", scales)

    def matrix(self, kind: str, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values, scales = getattr(self, f"{kind}_fp8"), getattr(self, f"{kind}_{self.scales_suffix}")
        return (values, scales) if expert is None else (values[expert], scales[expert])

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate = self.linear(rows, *self.matrix("gate", expert), None, self.backend)
        up = self.linear(rows, *self.matrix("up", expert), None, self.backend)
        return self.linear(self.act_fn(gate) * up, *self.matrix("down", expert), None, self.backend)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.dense_forward(hidden_states, top_k_index, top_k_weights)
        return self.routed_forward(hidden_states, top_k_index, top_k_weights)

    def dense_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Every expert on every token, weighted by its routing weight (0 where not picked): no host
        sync, so a decode step captures in a CUDA graph. A decode batch reads every hit expert's
        weights anyway; prefill takes :meth:`routed_forward`, which computes picked rows only."""
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == expert)).sum(dim=-1, keepdim=True)
            out += (self._expert(expert, hidden_states) * weight).to(out.dtype)
        return out

    def routed_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """transformers' eager loop: each hit expert on the rows routed to it."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # one class more than there are experts: some routers mark an unused pick with index E
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            if expert == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert])
            down = self._expert(expert, hidden_states[token_idx])
            out.index_add_(0, token_idx, (down * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$")


class Fp8Weights:
    """The quantized weights of a model by Hugging Face name: which names they answer, loading a
    full-precision tensor into them (quantized in place) and reading them back dequantized."""

    def __init__(self, linears: dict[str, Fp8Linear], experts: dict[str, Fp8Experts]):
        self.linears = linears  # "model.layers.0.self_attn.o_proj" (or a fused "...qkv_proj") -> module
        self.experts = experts  # "model.layers.1.mlp.experts" -> module
        #: the Hugging Face linears inside a fused projection: "...self_attn.k_proj" -> (its module, its rows)
        self.parts: dict[str, tuple[Fp8Linear, tuple[int, int]]] = {}
        for fused_name, module in linears.items():
            parent = fused_name.rpartition(".")[0]
            for part, rows in module.parts.items():
                self.parts[f"{parent}.{part}"] = (module, rows)

    def __len__(self) -> int:
        return len(self.linears) + len(self.experts)

    def _target(self, name: str) -> tuple[object, list[tuple[str, slice | None]], int | None] | None:
        """(module, [(matrix kind, rows of the incoming tensor)], expert) that ``name`` fills, or None;
        for a part of a fused projection the kind is ``("weight", start, end)``, its rows of the storage."""
        if name.endswith(".weight") and name[: -len(".weight")] in self.linears:
            return self.linears[name[: -len(".weight")]], [("weight", None)], None
        if name.endswith(".weight") and name[: -len(".weight")] in self.parts:
            module, (start, end) = self.parts[name[: -len(".weight")]]
            return module, [(("weight", start, end), None)], None
        match = _EXPERT_NAME.match(name)
        if match is None or match.group(1) not in self.experts:
            return None
        module = self.experts[match.group(1)]
        half = module.intermediate
        if match.group(4) == "gate_up_proj":
            return module, [("gate", slice(0, half)), ("up", slice(half, 2 * half))], None
        if match.group(4) == "down_proj":
            return module, [("down", None)], None
        expert = int(match.group(2))
        if expert >= module.num_experts:
            return None
        return module, [(match.group(3)[: -len("_proj")], None)], expert

    def owns(self, name: str) -> bool:
        return self._target(name) is not None

    @staticmethod
    def _storage(module, kind: str | tuple[str, int, int], expert: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "weight":
            return module.weight_fp8, module.scales
        if isinstance(kind, tuple):  # rows [start, end) of a fused projection: views of its storage
            return module.rows(kind[1], kind[2])
        return module.matrix(kind, expert)

    def shape(self, name: str) -> tuple[int, ...]:
        module, parts, expert = self._target(name)
        shapes = [tuple(self._storage(module, kind, expert)[0].shape) for kind, _ in parts]
        if len(shapes) == 1:
            return shapes[0]
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])  # gate_up: [E, 2I, H]

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Quantize ``tensor`` (any float dtype, the HF shape of ``name``) into its storage."""
        module, parts, expert = self._target(name)
        expected = self.shape(name)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r}: expected shape {expected}, got {tuple(tensor.shape)}")
        for kind, rows in parts:
            values, scales = self._storage(module, kind, expert)
            part = tensor if rows is None else tensor[:, rows]
            module.quantize_into(part.to(device=values.device), values, scales)

    def dequantized(self, name: str) -> torch.Tensor:
        module, parts, expert = self._target(name)
        matrices = [module.dequantize(*self._storage(module, kind, expert), module.dtype) for kind, _ in parts]
        return matrices[0] if len(matrices) == 1 else torch.cat(matrices, dim=1)


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' ``[gate; up]``-concatenated, untransposed, bias-free expert layout (other layouts
    stay in the model dtype)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not getattr(module, "is_concatenated", True) or getattr(module, "is_transposed", False):
        return False
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and hasattr(module, "act_fn") and not getattr(module, "has_bias", False))


WARM_UP_MAX_ROWS = 4096  # token counts whose Triton launches fp8.warm_up compiles before serving


@torch.no_grad()
def warm_up(weights: Fp8Weights, max_rows: int = WARM_UP_MAX_ROWS) -> tuple[int, float]:
    """Compile, before the engine serves, every Triton GEMM launch the FP8 linears and routed experts of
    ``weights`` can take for 1..``max_rows`` tokens: one GEMM on zeros per distinct :func:`fp8_triton.launch_key`
    (tiles and TMA; the token count is not specialized on), so no decode step or prefill stalls on a
    first-use compile (~1 s each) — the engine captures CUDA graphs lazily per batch bucket, and a
    bucket whose tiles were new used to compile inside the rollout. Also allocates the split-K
    counters. Where the Triton kernels run (CUDA; the CPU only under Triton's interpreter, where the
    engine does not call it).
    Returns (launches compiled or loaded from Triton's cache, seconds)."""
    import time

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton
    from slime.backends.embedded_engine.fp8.channel import ChannelFp8Experts, fallback_backend

    start = time.perf_counter()
    seen: set[tuple] = set()
    shapes = {}  # one matrix per (shape, dtype, backend, device): the launches depend on nothing else
    matrices = [(module.weight_fp8, module.weight_scale_inv, module.dtype, module.backend)
                for module in weights.linears.values() if isinstance(module, Fp8Linear)]
    per_channel = [module for module in weights.linears.values()
                   if not isinstance(module, Fp8Linear) and module.backend != "dequant"]
    if per_channel:  # one call compiles the token quantizer for every token count (and starts the row-wise GEMM)
        module = per_channel[0]
        module(torch.zeros((1, module.in_features), dtype=module.dtype, device=module.weight_fp8.device))
        seen.add(("w8a8_fp8",))
    # the per-channel Triton GEMM: the two-kernel launches, in the kernel's PER_CHANNEL mode
    def channel_path(backend: str, device: torch.device) -> str:  # cublas: its other calls' path
        return fallback_backend(device) if backend == "cublas" else backend

    matrices += [(module.weight_fp8, module.weight_scale, module.dtype, "channel_triton")
                 for module in per_channel if channel_path(module.backend, module.weight_fp8.device) == "triton"]
    for module in weights.experts.values():  # every expert's matrices share a shape
        if isinstance(module, ChannelFp8Experts):  # per channel: only the Triton GEMM has launches to compile
            triton_gemm = channel_path(module.backend, module.matrix("gate", 0)[0].device) == "triton"
            backend = "channel_triton" if triton_gemm else "dequant"
        else:
            backend = module.backend
        matrices += [(*module.matrix(kind, 0), module.dtype, backend) for kind in ("gate", "up", "down")]
    for values, scales, dtype, backend in matrices:
        shapes.setdefault((*values.shape, dtype, backend, str(values.device)), (values, scales, dtype, backend))
    for values, scales, dtype, backend in shapes.values():
        if backend == "dequant" or not fp8_triton.available(values.device):
            continue
        out_features, in_features = values.shape
        tma = fp8_triton.tma_usable_for(values)
        for rows in range(1, max_rows + 1):
            if backend == "channel_triton":
                key = ("channel", out_features, in_features, dtype,
                       *fp8_triton.launch_key("two_kernel", rows, out_features, in_features, values.device, tma))
                if key not in seen:
                    seen.add(key)
                    _warm_up_channel_gemm(values, scales, dtype, rows)
                continue
            path = gemm_path(backend, rows, out_features, in_features, values.device)
            if path == "cublas":
                key = (path, out_features, in_features, dtype)  # no Triton tiles: the quantizer and cuBLASLt
            else:
                launch = fp8_triton.launch_key(path, rows, out_features, in_features, values.device, tma)
                key = (out_features, in_features, dtype, *launch)
            if key in seen:
                continue
            seen.add(key)
            zeros = torch.zeros((rows, in_features), dtype=dtype, device=values.device)
            fp8_linear(zeros, values, scales, None, backend)
            if path == "two_kernel":  # and its epilogue-add variant (fused_ops: the MLP's residual in the down GEMM)
                fp8_linear(zeros, values, scales, None, backend,
                           accumulate_into=torch.zeros((rows, out_features), dtype=dtype, device=values.device))
    if seen and torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if seen:
        logger.info("fp8: warmed up %d GEMM launches (shapes x tiles) for 1-%d tokens in %.1f s", len(seen),
                    max_rows, seconds)
    return len(seen), seconds


def _warm_up_channel_gemm(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows: int) -> None:
    """One per-channel Triton GEMM of ``rows`` tokens on zeros, and its epilogue-add variant (``fused_ops``: the
    MLP's residual in the down GEMM)."""
    from slime.backends.embedded_engine.fp8.channel import channel_linear

    zeros = torch.zeros((rows, values.shape[1]), dtype=dtype, device=values.device)
    channel_linear(zeros, values, scales, None, "triton")
    channel_linear(zeros, values, scales, None, "triton",
                   accumulate_into=torch.zeros((rows, values.shape[0]), dtype=dtype, device=values.device))


@torch.no_grad()
def quantize_model(model: nn.Module, backend: str, keep: tuple[str, ...] = (), per_channel: bool = False) -> Fp8Weights:
    """Replace the decoder's linear layers and fused experts of ``model`` with FP8 ones, in place: 128 x 128
    blocks (``--quantization fp8``), or one scale per output channel (``per_channel``: ``--quantization
    w8a8_fp8``, ``fp8_channel.py``; ``backend`` is then one of its backends). ``keep``: module-name suffixes
    left in the model dtype (besides routers, embeddings and the head)."""
    from slime.backends.embedded_engine.fp8.channel import ChannelFp8Experts, ChannelFp8Linear

    linears, experts = {}, {}
    for name, module in list(model.named_modules()):
        if ".layers." not in f".{name}." or (keep and name.endswith(keep)):
            continue
        parent_name, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear):
            if leaf == "gate":  # the MoE router: its logits pick the experts, kept exact
                continue
            replacement = linears[name] = (ChannelFp8Linear if per_channel else Fp8Linear)(module, backend)
        elif _is_fused_experts(module):
            replacement = experts[name] = (ChannelFp8Experts if per_channel else Fp8Experts)(module, backend)
        else:
            continue
        setattr(model.get_submodule(parent_name), leaf, replacement)
    method = "w8a8_fp8" if per_channel else "fp8"
    if not linears:
        raise ValueError(f"--quantization {method}: {type(model).__name__} has no nn.Linear inside its decoder "
                         "layers to quantize")
    logger.info("%s: %d linear layers and %d expert groups quantized (%s, %s GEMM)", method, len(linears),
                len(experts), "one scale per output channel" if per_channel else "128x128 blocks", backend)
    return Fp8Weights(linears, experts)
