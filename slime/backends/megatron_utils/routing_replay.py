"""MoE routing replay on Megatron-Core's ``RouterReplay`` (``--use-routing-replay``, ``--use-rollout-routing-replay``).

A mixture-of-experts policy picks its experts per token with a top-k over router scores; a small
change of the weights can flip that choice, and the PPO ratio π_θ/π_old then compares two different
networks. Replay fixes the choice:

* **R2** (``--use-routing-replay``): the π_old forward-only pass *records* every MoE layer's top-k
  expert indices per token; the training forward of the same micro-batch *replays* them (the
  gating weights are still the current router's scores at those experts, so the router trains).
* **R3** (``--use-rollout-routing-replay``): the indices come from the engine that sampled the
  response (``Sample.rollout_routed_experts``, ``[len(tokens) − 1, num_layers, top-k]``, INTERFACES
  §1.1), and both the π_old pass and training replay them.

With ``moe_enable_routing_replay`` each Megatron router owns a ``RouterReplay``: RECORD keeps the
indices of the last forward, REPLAY_FORWARD uses the target set for this micro-batch, and
REPLAY_BACKWARD pops the targets in forward order when activations are recomputed in backward
(1F1B runs backwards in forward order, so the queue lines up). Token order is the router's: the
micro-batch's hidden states ``[s, b, h]`` flattened s-major (``position · b + sample``; packed thd has
b = 1), cut along s over TP ranks under sequence parallelism.
"""

from __future__ import annotations

import contextlib

import torch

from slime.backends.megatron_utils.forward import MicroBatchInputs
from slime.backends.megatron_utils.model import unwrap

__all__ = ["RoutingReplay", "rollout_targets"]


class RoutingReplay:
    """The routers of one model (this rank's pipeline stage) and the recorded choices of a rollout step."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._action = RouterReplayAction
        self.routers = [m.router_replay for m in unwrap(model).modules() if getattr(m, "router_replay", None) is not None]
        if not self.routers:
            raise ValueError("--use-routing-replay needs an MoE model built with moe_enable_routing_replay (no router found)")
        self.layers = [int(r.layer_number) - 1 for r in self.routers]  # global decoder layer of each router
        self.recorded: dict[tuple[int, ...], list[torch.Tensor]] = {}

    @contextlib.contextmanager
    def record(self, inputs: MicroBatchInputs):
        """Around one forward: keep each router's top-k indices for this micro-batch's samples."""
        for router in self.routers:
            router.clear_indices()
            router.set_router_replay_action(self._action.RECORD)
        try:
            yield
        finally:
            for router in self.routers:
                router.clear_router_replay_action()
        self.recorded[tuple(inputs.sample_indices)] = [r.get_recorded_indices().detach().clone() for r in self.routers]

    @contextlib.contextmanager
    def replay(self, targets: list[torch.Tensor]):
        """Around one forward: use ``targets`` (one ``[tokens, top-k]`` per router); afterwards the
        routers stay in REPLAY_BACKWARD, for a recompute in this micro-batch's backward."""
        for router, target in zip(self.routers, targets, strict=True):
            router.set_target_indices(target)
            router.set_router_replay_action(self._action.REPLAY_FORWARD)
        yield
        for router in self.routers:
            router.set_router_replay_action(self._action.REPLAY_BACKWARD)

    def recorded_targets(self, inputs: MicroBatchInputs) -> list[torch.Tensor]:
        key = tuple(inputs.sample_indices)
        if key not in self.recorded:
            raise RuntimeError("--use-routing-replay replays the routing recorded in the π_old forward pass, and none was "
                               f"recorded for the micro-batch of samples {list(key)[:8]} (with --use-rollout-logprobs there "
                               "is no such pass: use --use-rollout-routing-replay)")
        return self.recorded[key]

    def start_step(self) -> None:
        """Before an optimizer step's micro-batches: empty the routers' queues."""
        for router in self.routers:
            router.clear_indices()
            router.clear_router_replay_action()

    def finish(self) -> None:
        """After a rollout step: forget its recorded choices."""
        self.start_step()
        self.recorded.clear()


def rollout_targets(inputs: MicroBatchInputs, routed: list, layers: list[int], topk: int, device,
                    sp_rank: int = 0, sp_size: int = 1) -> list[torch.Tensor]:
    """Per router (global decoder layer in ``layers``), the ``[tokens, top-k]`` expert indices of
    this micro-batch in the router's token order, from each sample's engine routing ``routed[i]``
    (``[len(tokens_i) − 1, num_layers, top-k]``). Positions the engine did not route (each
    sample's last token, padding) get experts ``0..top-k−1``: their outputs are never read."""
    batch, length = int(inputs.input_ids.shape[0]), int(inputs.input_ids.shape[1])
    packed = inputs.packed_seq_params is not None
    out = []
    filler = torch.arange(topk, dtype=torch.long)
    for layer in layers:
        full = filler.expand(length, batch, topk).clone()  # [s, b, k]
        for i, (start, n) in enumerate(zip(inputs.starts, inputs.lengths)):
            experts = torch.as_tensor(routed[i], dtype=torch.long)
            if experts.ndim != 3 or experts.shape[0] != n - 1 or experts.shape[2] != topk or experts.shape[1] <= layer:
                raise ValueError(f"sample {inputs.sample_indices[i] if inputs.sample_indices else i}: rollout_routed_experts "
                                 f"of shape {tuple(experts.shape)}, expected [len(tokens) - 1 = {n - 1}, num_layers > {layer}, "
                                 f"top-k = {topk}]")
            if packed:
                full[start: start + n - 1, 0] = experts[:, layer]
            else:
                full[: n - 1, i] = experts[:, layer]
        if sp_size > 1:
            chunk = length // sp_size
            full = full[sp_rank * chunk: (sp_rank + 1) * chunk]
        out.append(full.reshape(-1, topk).to(device))
    return out
