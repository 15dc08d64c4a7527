"""AdamW and the learning-rate schedule (Megatron flag names) for the FSDP2 trainer."""

from __future__ import annotations

import math

import torch

__all__ = ["build_optimizer", "LRScheduler"]


def build_optimizer(model: torch.nn.Module, args, lr: float) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norm weights (1-D) get no weight decay."""
    if args.optimizer != "adam":
        raise ValueError(f"--optimizer {args.optimizer} is not supported by --train-backend fsdp yet (use adam)")
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    # CUDA: the fused kernel (one launch per parameter group instead of ~10 per parameter, which for
    # FSDP2's DTensors cost more host time than a 0.6B model's whole forward-backward); CPU: the
    # per-parameter loop, the reference the CPU tests compare against
    cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        groups, lr=lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        **({"fused": True} if cuda else {"foreach": False}),
    )


class LRScheduler:
    """lr at optimizer step k (0-based): warmup ``lr_warmup_init → lr`` linearly over
    ``--lr-warmup-iters`` (or ``--lr-warmup-fraction`` × decay iters) with lr·(k+1)/W, then
    ``--lr-decay-style`` constant / linear / cosine from lr to ``--min-lr`` at ``--lr-decay-iters``
    (default: the run's total optimizer steps)."""

    STYLES = ("constant", "linear", "cosine")

    def __init__(self, optimizer, args, max_lr: float, total_steps: int):
        style = args.lr_decay_style
        if style not in self.STYLES:
            raise ValueError(f"--lr-decay-style {style} is not supported by --train-backend fsdp yet; use one of {self.STYLES}")
        self.optimizer, self.style, self.max_lr = optimizer, style, max_lr
        self.min_lr = args.min_lr or 0.0
        self.decay_steps = args.lr_decay_iters or max(total_steps, 1)
        warmup = args.lr_warmup_iters or 0
        fraction = args.lr_warmup_fraction
        if fraction is not None:
            warmup = int(fraction * self.decay_steps)
        self.warmup_steps = warmup
        self.warmup_init = args.lr_warmup_init or 0.0
        self.step_count = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.warmup_init + (self.max_lr - self.warmup_init) * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        progress = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        if self.style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * factor

    def _apply(self) -> None:
        lr = self.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()
