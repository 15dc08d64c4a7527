"""Shared set-up of the checkpoint conversion tools: flags, process group, model-parallel state."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv: list[str], extra) -> "argparse.Namespace":  # noqa: F821
    """slime's parser (model-shape and parallel flags) plus the tool's own flags from ``extra``."""
    from slime.arguments import get_parser

    parser, _ = get_parser(parse_sglang=False)
    extra(parser)
    if "--rollout-batch-size" not in argv:
        argv = [*argv, "--rollout-batch-size", "1"]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from slime.utils.gguf_model import GGUFError, resolve_hf_checkpoint

    try:  # a GGUF checkpoint is read as its cached, dequantized HF directory
        args.hf_checkpoint = resolve_hf_checkpoint(args.hf_checkpoint, "--hf-checkpoint")
        if getattr(args, "origin_hf_dir", None):
            args.origin_hf_dir = resolve_hf_checkpoint(args.origin_hf_dir, "--origin-hf-dir")
    except GGUFError as e:
        parser.error(str(e))
    return args


def init_distributed(args) -> None:
    """One process (or torchrun's ranks): NCCL with GPUs, gloo without; TP/PP/EP from the flags."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a single process without torchrun: any free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 expert_tensor_parallel_size=args.expert_tensor_parallel_size or 1)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)


def build(args, hf_dir: str):
    """This rank's GPTModel for the HF config at ``hf_dir`` (preset flags checked against it)."""
    import torch
    from megatron.core import parallel_state as ps

    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import weight_mapping as wm
    from slime.backends.megatron_utils.model_config import fill_model_args, hf_validate_args, load_hf_config

    args.hf_checkpoint = hf_dir
    config = load_hf_config(hf_dir)
    fill_model_args(args, config)
    hf_validate_args(args, config)
    if args.padded_vocab_size is None:
        args.padded_vocab_size = wm.padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                      args.tensor_model_parallel_size)
    overrides = {} if torch.cuda.is_available() else {"use_cpu_initialization": True}
    model = mm.model_provider(args, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                              config=mm.transformer_config(args, **overrides))
    if torch.cuda.is_available():
        model.cuda()
    return model, mm.layout_for(args, config)
