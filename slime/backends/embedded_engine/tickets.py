"""Arrival tickets of the Triton kernels whose last program finishes a reduction (split-K GEMMs, split
attention): one int32 per output tile, bumped by each program, reset to 0 by the last one. So a
buffer, zeroed once per device, serves every launch that follows — captured CUDA graphs included —
as long as launches on the device run one after the other (the engine's one stream)."""

from __future__ import annotations

import torch


class Tickets:
    """Per-device zeroed int32 tickets of one kind of kernel (``what`` names it in errors)."""

    def __init__(self, what: str, minimum: int = 4096):
        self.what = what
        self.minimum = minimum
        self.by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, need: int) -> torch.Tensor:
        tickets = self.by_device.get(device)
        if tickets is None or tickets.numel() < need:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.what}: {need} tickets are first needed while a CUDA graph is captured; "
                                   "run one such launch on this device eagerly before capturing")
            tickets = torch.zeros(max(need, self.minimum), dtype=torch.int32, device=device)
            self.by_device[device] = tickets
        return tickets
