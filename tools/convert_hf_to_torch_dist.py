"""HF checkpoint -> Megatron torch_dist checkpoint (for --load / --ref-load).

    source scripts/models/qwen3-4B.sh
    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint /root/Qwen3-4B \
        --save /root/Qwen3-4B_torch_dist
    # large models: torchrun --nproc-per-node 8 tools/convert_hf_to_torch_dist.py ... \
    #     --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4

Writes ``<save>/iter_0000000/`` and ``latest_checkpointed_iteration.txt`` (0). The torch_dist
format is resharding-safe: training may use other TP/PP/EP sizes than the conversion did.
Without preset flags the shape is read from the checkpoint's config.json.
"""

import sys

from _megatron_tool import build, init_distributed, parse


def main(argv=None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv, lambda p: None)
    if not args.hf_checkpoint or not args.save:
        raise SystemExit("convert_hf_to_torch_dist.py needs --hf-checkpoint (HF directory) and --save (output directory)")
    init_distributed(args)
    import torch.distributed as dist

    from slime.backends.megatron_utils.checkpoint import save_checkpoint
    from slime.backends.megatron_utils.model import load_hf_weights

    model, layout = build(args, args.hf_checkpoint)
    count = load_hf_weights(model, args.hf_checkpoint, layout)
    directory = save_checkpoint(args.save, 0, model)
    if dist.get_rank() == 0:
        print(f"converted {args.hf_checkpoint} -> {directory} ({count} tensors on rank 0)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
