"""Megatron torch_dist checkpoint -> HF directory (safetensors + config + tokenizer).

    source scripts/models/qwen3-4B.sh
    python tools/convert_torch_dist_to_hf.py ${MODEL_ARGS[@]} --input-dir /root/ckpt/iter_0000100 \
        --output-dir /root/Qwen3-4B-step100 --origin-hf-dir /root/Qwen3-4B

``--input-dir`` is an ``iter_*`` directory (or a checkpoint root: its latest iteration is used);
``--origin-hf-dir`` gives the config, tokenizer, HF names and dtypes. Vocabulary padding is removed.
"""

import os
import sys

from _megatron_tool import build, init_distributed, parse


def _tool_flags(parser) -> None:
    parser.add_argument("--input-dir", required=True, help="iter_* directory or checkpoint root")
    parser.add_argument("--output-dir", required=True, help="HF directory to write")
    parser.add_argument("--origin-hf-dir", default=None, help="HF directory of the original model (default --hf-checkpoint)")


def main(argv=None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv, _tool_flags)
    origin = args.origin_hf_dir or args.hf_checkpoint
    if not origin:
        raise SystemExit("convert_torch_dist_to_hf.py needs --origin-hf-dir (config, tokenizer and HF names)")
    init_distributed(args)
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from slime.backends.megatron_utils import checkpoint as ckpt
    from slime.backends.megatron_utils.model import iter_hf_weights

    model, layout = build(args, origin)
    choice = ckpt.resolve_checkpoint(args.input_dir) if ckpt.read_latest_iteration(args.input_dir) is not None \
        else ckpt.CheckpointChoice("megatron", args.input_dir, None, resume=False)
    choice.resume = False
    ckpt.load_checkpoint(choice, model)
    from slime.backends.megatron_utils.model import HFCheckpointReader

    origin_reader = HFCheckpointReader(origin)  # write in the original checkpoint's dtype (bit-exact round trip)
    dtypes = {name: origin_reader(name).dtype for name in origin_reader._where}
    state = {name: tensor.to(dtypes.get(name, torch.bfloat16)).cpu() for name, tensor in iter_hf_weights(model, layout)}
    if dist.get_rank() == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        save_file(state, os.path.join(args.output_dir, "model.safetensors"), metadata={"format": "pt"})
        AutoConfig.from_pretrained(origin).save_pretrained(args.output_dir)
        AutoTokenizer.from_pretrained(origin).save_pretrained(args.output_dir)
        print(f"converted {choice.path} -> {args.output_dir} ({len(state)} tensors)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
