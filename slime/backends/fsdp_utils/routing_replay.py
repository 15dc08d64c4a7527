"""MoE routing replay for the FSDP backend's Hugging Face models (``--use-routing-replay``, R2, and
``--use-rollout-routing-replay``, R3; the Megatron backend's is ``megatron_utils/routing_replay.py``).

A forward hook on every router (DeepSeek-V3, GLM-4.5, the Qwen3 MoE families: ``slime.utils.moe_routing``)
either *records* its top-k expert ids, or *replays* given ones: the router's top-k is replaced by
the given experts and their weights are recomputed from the router's own logits for those experts
(as Megatron-Core's ``RouterReplay`` does), so the router still receives gradients. A replayed
forward's gradients are those of the network with the given routing.

Per sample the routing is ``[len(tokens) − 1, num_hidden_layers, top_k]`` (SGLang's
``routed_experts``: dense layers 0, no row for the last token) — the engine's for R3, the π_old
pass's record for R2. Router rows are the micro-batch's flattened tokens (a packed row, or
right-padded rows); positions without routing (each sample's last token, padding) get experts
``0..k−1``, whose outputs nothing reads.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from slime.utils.moe_routing import hf_routers, replayed_weights, routed_layout

__all__ = ["HFRoutingReplay"]


class HFRoutingReplay:
    def __init__(self, model: torch.nn.Module):
        self.routers = hf_routers(model)
        if not self.routers:
            raise ValueError(f"--use-routing-replay / --use-rollout-routing-replay need an MoE model; "
                             f"model_type {model.config.model_type!r} has no MoE router (DeepSeek-V3, GLM-4.5, "
                             "Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE and Qwen3-VL-MoE have)")
        self.num_layers, self.topk = routed_layout(model.config)
        self._mode: str | None = None
        self._targets: dict[int, torch.Tensor] = {}
        self._recorded: dict[int, torch.Tensor] = {}
        self.recorded: dict[int, np.ndarray] = {}  # R2: sample position in the step's batch -> its routing
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self.routers]

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._mode == "record":
                self._recorded[layer] = output[2].detach()
            elif self._mode == "replay":
                logits, _, chosen = output
                target = self._targets[layer]
                if target.shape != chosen.shape:
                    raise RuntimeError(f"routing replay: layer {layer}'s router saw {chosen.shape[0]} tokens, the "
                                       f"replayed routing has {target.shape[0]}")
                return logits, replayed_weights(module, logits, target), target
        return hook

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _rows(packed) -> list[int]:
        """First router row of each sample of a micro-batch (``PackedBatch``)."""
        if packed.padded:
            width = int(packed.input_ids.shape[1])
            return [i * width for i in range(len(packed.lengths))]
        return [int(x) for x in np.cumsum([0] + list(packed.lengths[:-1]))]

    def _check(self, experts, n: int, name: str) -> torch.Tensor:
        experts = torch.as_tensor(np.asarray(experts), dtype=torch.long)
        if tuple(experts.shape) != (n - 1, self.num_layers, self.topk):
            raise ValueError(f"{name}: rollout_routed_experts of shape {tuple(experts.shape)}, expected "
                             f"[len(tokens) - 1 = {n - 1}, num_hidden_layers = {self.num_layers}, top-k = {self.topk}]")
        return experts

    # ------------------------------------------------------------------ passes
    @contextlib.contextmanager
    def replay(self, packed, experts: list, names: list[str]):
        """Around one micro-batch's forward (and its backward, where activations are recomputed):
        the routers use ``experts[i]`` for sample i of ``packed``."""
        rows = int(packed.input_ids.numel())
        device = packed.input_ids.device
        full = torch.arange(self.topk, dtype=torch.long).expand(rows, self.num_layers, self.topk).clone()
        for start, n, sample, name in zip(self._rows(packed), packed.lengths, experts, names):
            full[start: start + n - 1] = self._check(sample, n, name)
        full = full.to(device)
        self._targets = {layer: full[:, layer].contiguous() for layer, _ in self.routers}
        self._mode = "replay"
        try:
            yield
        finally:
            self._mode = None

    @contextlib.contextmanager
    def record(self, packed, positions: list[int]):
        """Around one forward-only micro-batch: keep each sample's routing under its batch position."""
        self._recorded = {}
        self._mode = "record"
        try:
            yield
        finally:
            self._mode = None
        if not self._recorded:
            return
        full = np.zeros((int(packed.input_ids.numel()), self.num_layers, self.topk), dtype=np.int32)
        for layer, chosen in self._recorded.items():
            full[:, layer] = chosen.to(torch.int32).cpu().numpy()
        self._recorded = {}
        for start, n, position in zip(self._rows(packed), packed.lengths, positions):
            self.recorded[position] = full[start: start + n - 1].copy()

    def finish(self) -> None:
        self.recorded.clear()
        self._targets = {}
