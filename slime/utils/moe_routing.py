"""The MoE routers of transformers' models, as the engine records them and the FSDP trainer replays them.

transformers' MoE families route with a ``gate`` module whose forward returns ``(router_logits,
top-k weights, top-k indices)`` over the flattened tokens ``[rows · length, ...]``:

* DeepSeek-V3 (``DeepseekV3TopkRouter``) and GLM-4.5 (``Glm4MoeTopkRouter``): sigmoid scores, the
  expert bias added for the *choice* only, group-limited top-k; weights = the scores (without bias)
  of the chosen experts, normalised over them when ``norm_topk_prob``, times ``routed_scaling_factor``;
* Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE and Qwen3-VL-MoE (``Qwen3MoeTopKRouter``, ``Qwen3NextTopKRouter``,
  ``Qwen3_5MoeTopKRouter``, ``Qwen3VLMoeTextTopKRouter``): softmax probabilities, plain top-k; weights = the chosen
  probabilities, normalised when ``norm_topk_prob``, in the logits' dtype.

:func:`replayed_weights` recomputes a router's weights for given experts from its own scores — what
Megatron-Core's ``RouterReplay`` does (the replayed indices replace the top-k, the probabilities
come from the current router), so the router still receives gradients.
"""

from __future__ import annotations

import re

import torch

__all__ = ["ROUTER_KINDS", "hf_routers", "replayed_weights", "routed_layout"]

#: router class -> how its weights follow from its logits
ROUTER_KINDS = {"DeepseekV3TopkRouter": "sigmoid", "Glm4MoeTopkRouter": "sigmoid", "Qwen3MoeTopKRouter": "softmax",
                "Qwen3NextTopKRouter": "softmax", "Qwen3_5MoeTopKRouter": "softmax",
                "Qwen3VLMoeTextTopKRouter": "softmax"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def hf_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router)`` of every MoE layer of ``model``'s decoder, in layer order
    (dense layers have none). Raises ValueError for a model whose MoE router is of another class."""
    routers, unknown = [], []
    for name, module in model.named_modules():
        kind = type(module).__name__
        match = _LAYER.search(name)
        if kind in ROUTER_KINDS and match:
            routers.append((int(match.group(1)), module))
        elif match and name.endswith(".gate") and "Router" in kind:
            unknown.append(kind)
    if unknown:
        raise ValueError(f"MoE routing capture/replay knows the routers {sorted(ROUTER_KINDS)}; this model's are "
                         f"{sorted(set(unknown))}")
    return sorted(routers, key=lambda item: item[0])


def routed_layout(config) -> tuple[int, int]:
    """``(num_layers, top_k)`` of the routing arrays (SGLang's ``routed_experts``): every decoder
    layer has a row, the dense ones all zeros."""
    text = getattr(config, "text_config", config)
    return int(text.num_hidden_layers), int(text.num_experts_per_tok)


def replayed_weights(router: torch.nn.Module, router_logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The top-k weights ``router`` gives the experts ``indices`` ``[tokens, k]``, from its logits."""
    kind = ROUTER_KINDS[type(router).__name__]
    if kind == "sigmoid":
        weights = router_logits.sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(router_logits, dtype=torch.float, dim=-1).gather(1, indices)
    if getattr(router, "norm_topk_prob", True):  # Qwen3.5-MoE's and Qwen3-VL-MoE's always renormalise (no attribute)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)
