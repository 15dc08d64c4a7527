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
* ``triton`` (CUDA): Triton kernels (``triton_kernels.py``). Up to :data:`FUSED_MAX_ROWS` tokens the fused
  kernel, which quantizes the activations per token and 128-channel group (``1 x 128`` blocks, the
  same formula) in registers inside the GEMM and multiplies e4m3 by e4m3; above, the two-kernel path:
  the activations quantized once by a separate kernel, then the GEMM on e4m3 A and its scales (the
  fused kernel re-quantizes each A tile in every column-tile program, which is what made it 0.37-0.54x
  of bf16 from 64 tokens up on the H200). The two-kernel GEMM loads its tiles by TMA where the rows are
  16-byte aligned (``fp8_triton.tma_usable``; all Qwen3 shapes), pointer loads elsewhere.
* ``cublas`` (Hopper, CUDA >= 12.9): cuBLASLt's block-scaled FP8 GEMM through ``torch._scaled_mm``
  (``cublas.py``), after the same separate activation quantizer; weight shapes it does not take
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

from slime.backends.embedded_engine.fp8.numerics import BLOCK, dequantize_weight
from slime.backends.embedded_engine.fp8.quantize import quantize_weight, quantize_weight_into

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8", "w8a8_fp8")  # block-wise here; per-channel in channel.py
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
