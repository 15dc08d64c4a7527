"""Training FLOPs of a micro-batch from the HF config: the one estimate behind every ``*_tflops`` metric.

For a decoder of L layers, hidden size H, n_q query heads and n_kv key/value heads of size d, a
gated MLP of width F (SwiGLU: three H×F matrices; an MoE layer: the routed experts a token visits,
F = k · F_expert, plus the shared expert and the H×E router), per forward+backward (3 × forward):

    body    = L · (H·(n_q·d + 2·n_kv·d) + n_q·d·H + 3·H·F [+ H·E])    parameters a token meets
    FLOPs   = 6 · body · Σ_i s_i                                    (every position)
            + 6 · head · P                                          (P predicted positions; head = V·H,
                                                                     the critic's value head: H)
            + Σ_i 6 · L · n_q · d · s_i²                             (causal attention, QKᵀ and AV)

with s_i the total length of sample i. Norms, biases and rotary embeddings are left out (≪ 1%).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FlopShape", "training_flops"]


@dataclass(frozen=True)
class FlopShape:
    """The counts of the formula above, read once from an HF config."""

    body: float
    head: float
    layers: int
    attention_width: int  # n_q · d

    @classmethod
    def from_hf_config(cls, config: dict, role: str = "actor") -> "FlopShape":
        config = config.get("text_config") or config  # a vision-language model: its language model (the tower uncounted)
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        dense_layers = set(config.get("mlp_only_layers") or [])
        body = 0.0
        for layer in range(layers):
            if experts and layer not in dense_layers:
                width = int(config.get("moe_intermediate_size") or 0) * int(config.get("num_experts_per_tok") or 0)
                width += int(config.get("shared_expert_intermediate_size") or 0)
                mlp = 3 * hidden * width + hidden * experts
            else:
                mlp = 3 * hidden * int(config["intermediate_size"])
            body += attention + mlp
        head = float(hidden) if role == "critic" else float(config["vocab_size"]) * hidden
        return cls(body=body, head=head, layers=layers, attention_width=heads * head_dim)


def training_flops(shape: FlopShape, lengths: list[int], num_predicted: int) -> float:
    """Forward + backward FLOPs of samples of total lengths ``lengths`` with ``num_predicted``
    positions through the output head (see the module docstring)."""
    attention = sum(6.0 * shape.layers * shape.attention_width * s * s for s in lengths)
    return 6.0 * shape.body * sum(lengths) + 6.0 * shape.head * num_predicted + attention
