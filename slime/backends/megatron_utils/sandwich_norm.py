"""GLM-4's decoder layer in Megatron-Core: RMSNorm on the attention output and on the MLP output before their
residual adds (``post_self_attn_layernorm`` / ``post_mlp_layernorm``), which Megatron-Core's ``TransformerLayer``
does not build (it has the input and pre-MLP norms only).

:class:`SandwichNormTransformerLayer` is that layer with the two norms; each is applied inside the layer's
bias-dropout-add (``norm(output) + residual``), so the attention, the MLP, recomputation and the schedules stay
Megatron-Core's. The norms are the spec's own class (the local spec's torch norm, or Transformer Engine's norm
where the spec fuses the others into the linear layers); their weights map to HF's names of the same meaning.
"""

from __future__ import annotations

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer


def _norm_class(submodules):
    if submodules.input_layernorm is not IdentityOp:
        return submodules.input_layernorm
    from megatron.core.extensions.transformer_engine import TENorm  # the TE spec fuses its norms into the linears

    return TENorm


def _normed(bda, norm):
    """``bda`` (bias-dropout-add) on the normed output: ``norm(output) + residual`` (no output bias)."""
    def apply(output_with_bias, residual, prob):
        output, bias = output_with_bias
        if bias is not None:
            raise ValueError("post-attention / post-MLP norms with an output bias: pass --disable-bias-linear")
        return bda((norm(output), None), residual, prob)
    return apply


class SandwichNormTransformerLayer(TransformerLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        norm = _norm_class(submodules)
        self.post_self_attn_layernorm = norm(config=self.config, hidden_size=self.config.hidden_size,
                                             eps=self.config.layernorm_epsilon)
        self.post_mlp_layernorm = norm(config=self.config, hidden_size=self.config.hidden_size,
                                       eps=self.config.layernorm_epsilon)
        attn_bda, mlp_bda = self.self_attn_bda, self.mlp_bda
        self.self_attn_bda = lambda training, fused: _normed(attn_bda(training, fused), self.post_self_attn_layernorm)
        self.mlp_bda = lambda training, fused: _normed(mlp_bda(training, fused), self.post_mlp_layernorm)


def with_sandwich_norms(spec):
    """``spec`` (one layer's ModuleSpec, or a block spec's layer specs) with :class:`SandwichNormTransformerLayer`."""
    if hasattr(spec, "layer_specs"):
        spec.layer_specs = [with_sandwich_norms(layer) for layer in spec.layer_specs]
        return spec
    return ModuleSpec(module=SandwichNormTransformerLayer, params=spec.params, submodules=spec.submodules)
