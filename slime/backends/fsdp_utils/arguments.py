"""Flags only the FSDP2 backend reads; ``parse_args`` calls ``add_fsdp_arguments(parser)``."""

from __future__ import annotations

import argparse


def add_fsdp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("FSDP2 backend (--train-backend fsdp)")
    g.add_argument("--fsdp-mixed-precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="Compute dtype: auto = bf16 parameters with fp32 gradient reduction on GPU, fp32 on CPU.")
    g.add_argument("--fsdp-attn-implementation", choices=["auto", "sdpa", "eager", "flash_attention_2", "slime_varlen"],
                   default="auto",
                   help="Attention kernel for packed micro-batches: auto = flash_attention_2 (varlen) on GPU when "
                        "flash-attn is installed, else slime_varlen (PyTorch's varlen flash attention, GPU), else "
                        "sdpa with a block-diagonal causal mask (CPU).")
    g.add_argument("--fsdp-compile", action="store_true", default=False,
                   help="torch.compile each decoder layer (dynamic shapes): fuses norms, rotary embeddings and "
                        "activations, worth it on GPU for small models (Qwen3-0.6B on an H200: MFU 14%% -> 20%%); "
                        "the first steps pay the compile time.")
    g.add_argument("--freeze-vision-tower", action="store_true", default=False,
                   help="Vision-language models: keep the vision encoder and its merger fixed (no gradient); the "
                        "language model trains.")
    g.add_argument("--critic-hf-checkpoint", type=str, default=None,
                   help="PPO critic initial weights (HF dir); default --hf-checkpoint. The value head starts random.")
    g.add_argument("--critic-lr", type=float, default=None, help="PPO critic learning rate; default --lr.")
    return parser
