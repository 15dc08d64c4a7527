"""The CPU path's version of :mod:`fused_ops`: the small per-layer operations of Llama/Qwen-style
models with fewer tensor ops, bit for bit what Hugging Face's modules compute in fp32.

On two CPU cores a decode step of the tiny Qwen3 (64 rows) ran ~40 tensor ops a layer besides its
four GEMMs, each a few microseconds of dispatch, allocation and (with two threads) an OpenMP
fork/join: RMSNorm as seven (cast, square, mean, add, rsqrt, multiply, scale), the rotary
embedding as five per tensor (multiply, slice, negate, concatenate, add) for the queries and again
for the keys, Qwen3's per-head q/k RMSNorm twice more. :func:`install` swaps in, for the module
classes it knows (the Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE families, fp32 weights):

* RMSNorm as ``torch.nn.functional.rms_norm`` (one op; the same ``x * rsqrt(mean(x²) + eps) * w``);
* where q/k/v are one projection (``fused_projections.py``): the queries and keys normalized
  together (one ``rms_norm`` over all their heads, then each part times its own weight, in place)
  and rotated together (``x·cos`` once, then ``x1·cos1 - x2·sin1`` and ``x2·cos2 + x1·sin2`` in
  place: HF's ``x·cos + rotate_half(x)·sin`` without the negation and the concatenation, the same
  roundings);
* the decoder layer: both residual adds in place on the fresh attention / MLP outputs, and the
  SiLU gate as ``silu(gate).mul_(up)`` read from the fused ``[gate | up]`` output.

Each result equals HF's exactly in fp32 (``tests/backends/embedded_engine/kernels/test_cpu_ops.py``); where a
shorter form would round differently (the residual inside the down projection's GEMM, as the CUDA
path does) it is not used. Other dtypes and other modules keep their own forwards.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from slime.backends.embedded_engine.kernels.fused_ops import DECODER_LAYER_CLASSES, MLP_CLASSES, RMSNORM_CLASSES

logger = logging.getLogger(__name__)

ENABLED = True  # bench A/B switch: install() leaves the model as it is when False


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm module forward in fp32: ``weight * (x * rsqrt(mean(x²) + eps))``, as one op."""
    if hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32:
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


def qk_norm_rope(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused q/k/v projection's output ``qkv [B, S, (Hq + 2·Hkv)·D]`` -> ``(query [B, Hq, S, D],
    key [B, Hkv, S, D])`` (HF's layout: transposes of ``[B, S, H, D]``): each head RMSNorm-ed with
    ``q_weight`` / ``k_weight`` when given (Qwen3's q_norm / k_norm), then rotated by ``cos/sin
    [B or 1, S, D]``; queries and keys in the same ops. Equal to HF's modules and
    ``apply_rotary_pos_emb`` in fp32."""
    batch, seq, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    half = dim // 2
    qk = qkv[..., : (q_heads + kv_heads) * dim].view(batch, seq, q_heads + kv_heads, dim)
    if q_weight is not None:
        qk = F.rms_norm(qk, (dim,), None, eps)  # a new [B, S, Hq + Hkv, D]: the weights go in in place
        qk[:, :, :q_heads].mul_(q_weight)
        qk[:, :, q_heads:].mul_(k_weight)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    out = qk * cos
    out[..., :half].sub_(qk[..., half:] * sin[..., :half])  # x1·cos1 + (-x2)·sin1
    out[..., half:].add_(qk[..., :half] * sin[..., half:])  # x2·cos2 + x1·sin2
    return out[:, :, :q_heads].transpose(1, 2), out[:, :, q_heads:].transpose(1, 2)


def _attention_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None):
    """Bound on a fused-projection attention module by :func:`install` (``fused_projections``' forward
    calls it): its q/k RMSNorm (if any) and rotary embedding by :func:`qk_norm_rope`, or None where
    that does not apply (the caller then runs HF's modules)."""
    dim, sizes = self.head_dim, self.qkv_proj.sizes
    if qkv.dim() != 3 or qkv.dtype != torch.float32 or cos.dim() != 3 or cos.shape[-1] != dim or dim % 2 \
            or cos.dtype != torch.float32 or cos.shape[0] not in (1, qkv.shape[0]) or sizes[0] % dim \
            or sizes[1] != sizes[2] or sizes[1] % dim:
        return None
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    weights = (None, None)
    eps = 0.0
    if q_norm is not None:
        if k_norm is None or type(q_norm).__name__ not in RMSNORM_CLASSES or q_norm.weight.dtype != torch.float32 \
                or k_norm.weight.dtype != torch.float32 or q_norm.variance_epsilon != k_norm.variance_epsilon \
                or q_norm.weight.shape[-1] != dim:
            return None
        weights, eps = (q_norm.weight, k_norm.weight), q_norm.variance_epsilon
    return qk_norm_rope(qkv, sizes[0] // dim, sizes[1] // dim, cos, sin, *weights, eps=eps)


def _packed_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The MLP over the fused ``[gate | up]`` projection: ``down(silu(gate) * up)``, the product in place."""
    gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
    return self.down_proj(F.silu(gate).mul_(up))


def _decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """HF's decoder layer of these families (pre-norm attention, then pre-norm MLP, each added to the
    residual), the adds in place on the attention's and the MLP's own outputs (``a + r == r + a``)."""
    attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    hidden_states = attended.add_(hidden_states)
    return self.mlp(self.post_attention_layernorm(hidden_states)).add_(hidden_states)


def _fresh_output(module: torch.nn.Module) -> bool:
    """Whether ``module``'s output is a new tensor nobody else holds (an ``add_`` into it is safe): a
    plain or fused linear projection at the end, as the families' attention and MLP have."""
    last = getattr(module, "o_proj", None) or getattr(module, "down_proj", None)
    return isinstance(last, torch.nn.Linear)


def install(model: torch.nn.Module) -> dict:
    """Swap the CPU forms into ``model`` (fp32 on the CPU only); return how many of each were installed."""
    counts = {"rmsnorm": 0, "qk_norm_rope": 0, "mlp": 0, "decoder_layer": 0}
    first = next(model.parameters())
    if not ENABLED or first.device.type != "cpu" or first.dtype != torch.float32:
        return counts
    for module in model.modules():
        name = type(module).__name__
        if name in RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_norm_forward, module)
            counts["rmsnorm"] += 1
        elif hasattr(module, "qkv_proj") and hasattr(module.qkv_proj, "sizes") and hasattr(module, "head_dim"):
            module.fused_norm_rope = types.MethodType(_attention_norm_rope, module)  # fused_projections' forward
            counts["qk_norm_rope"] += 1
        elif name in MLP_CLASSES and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") \
                and getattr(getattr(module, "config", None), "hidden_act", None) in ("silu", "swish"):
            module.forward = types.MethodType(_packed_mlp_forward, module)
            counts["mlp"] += 1
        elif name in DECODER_LAYER_CLASSES and all(hasattr(module, a) for a in
                                                   ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")) \
                and _fresh_output(module.self_attn) and _fresh_output(module.mlp):
            module.forward = types.MethodType(_decoder_layer_forward, module)
            counts["decoder_layer"] += 1
    logger.info("CPU ops installed: %s", counts)
    return counts
