"""``--enable-return-routed-experts``: every MoE layer's chosen experts per cached token (routing replay, R3).

A forward hook on each router (``slime.utils.moe_routing``) scatters its top-k indices into a device
buffer laid out like the KV cache, ``[slots, slot capacity, num_hidden_layers, top_k]``: the
token fed at absolute position p of slot s lands at ``[s, p]``. The runner says where each
forward's tokens go (:meth:`RoutedExperts.writing`): the prefill's real-token index and (slot,
position) pairs, or the decode step's rows and positions — device tensors, so nothing waits for
the host and a decode CUDA graph captured with the flag on records the scatter too. Slot moves and
shared prefills copy the rows with the KV cache; a request reads its rows ``[start, seqlen − 1)``
once, when it finishes (one device-to-host copy). Dense layers keep zeros, as in SGLang.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from slime.utils.moe_routing import hf_routers, routed_layout

__all__ = ["RoutedExperts"]


class RoutedExperts:
    def __init__(self, model: torch.nn.Module, num_slots: int, slot_capacity: int, device: torch.device):
        routers = hf_routers(model)
        if not routers:
            raise ValueError(f"--enable-return-routed-experts needs an MoE model; {type(model).__name__} has no router")
        self.num_layers, self.topk = routed_layout(model.config)
        num_experts = max(int(getattr(r, "num_experts", 0) or r.weight.shape[0]) for _, r in routers)
        # int16 halves the buffer (SGLang keeps int32 on the host; every released MoE has < 32768 experts)
        self.dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.device = device
        self.buffer = self._new(num_slots, slot_capacity)
        self._target: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in routers]

    def _new(self, num_slots: int, slot_capacity: int) -> torch.Tensor:
        return torch.zeros((num_slots, slot_capacity, self.num_layers, self.topk), dtype=self.dtype, device=self.device)

    def _hook(self, layer: int):
        def record(module, args, output):
            if self._target is None:
                return
            slots, positions, token_index = self._target
            indices = output[2]
            if token_index is not None:
                indices = indices.index_select(0, token_index)
            self.buffer[slots, positions, layer] = indices.to(self.dtype)
        return record

    @contextlib.contextmanager
    def writing(self, slots: torch.Tensor, positions: torch.Tensor, token_index: torch.Tensor | None = None):
        """Around one forward: router row ``token_index[j]`` (every row when None) is the token at
        ``positions[j]`` of slot ``slots[j]``."""
        self._target = (slots, positions, token_index)
        try:
            yield
        finally:
            self._target = None

    def resize(self, num_slots: int, slot_capacity: int) -> None:
        """The KV cache was reshaped (empty: nothing is running)."""
        self.buffer = self._new(num_slots, slot_capacity)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.buffer[dst, :length] = self.buffer[src, :length]

    def copy_slots(self, srcs: list[int], dsts: list[int], length: int) -> None:
        index = torch.tensor(srcs, dtype=torch.long, device=self.device)
        self.buffer[torch.tensor(dsts, dtype=torch.long, device=self.device), :length] = self.buffer[index, :length]

    def read(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of ``slot``: int32 ``[stop − start, num_layers, top_k]`` on the host."""
        return self.buffer[slot, start:max(start, stop)].to(torch.int32).cpu().numpy()

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
