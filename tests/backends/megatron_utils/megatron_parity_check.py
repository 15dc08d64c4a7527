"""GPU check run under torchrun by test_megatron_gpu.py: Megatron vs HF log-probs, HF->Megatron->HF.

    torchrun --nproc-per-node N tests/backends/megatron_utils/megatron_parity_check.py \
        --hf-dir DIR --tp 1 --pp 1 --ep 1 --out result.json

Builds the GPTModel of the HF checkpoint at DIR (shape flags filled from its config.json), loads
the safetensors into the sharded model, then
* exports HF-named weights (TP/EP gathered, pipeline stages broadcast) and compares them bit for
  bit with the safetensors (``roundtrip_mismatches``);
* with PP = 1: computes the response-token log-probs of a few random samples with Megatron and with
  the HF model (both fp32 weights, bf16 autocast) and records the differences.
Rank 0 writes the JSON result.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()

    sys.path.insert(0, os.getcwd())
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import weight_mapping as wm
    from slime.backends.megatron_utils.model_config import fill_model_args, hf_validate_args, load_hf_config
    from slime.utils import ppo_utils
    from slime.utils.arguments import get_parser

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(cli.tp, cli.pp, expert_model_parallel_size=cli.ep, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)

    parser_, _ = get_parser(parse_sglang=False)
    args = parser_.parse_args(["--rollout-batch-size", "1", "--num-rollout", "1", "--tensor-model-parallel-size", str(cli.tp),
                               "--pipeline-model-parallel-size", str(cli.pp), "--expert-model-parallel-size", str(cli.ep),
                               "--expert-tensor-parallel-size", "1", "--hf-checkpoint", cli.hf_dir])
    hf_config = load_hf_config(cli.hf_dir)
    fill_model_args(args, hf_config)
    hf_validate_args(args, hf_config)
    args.padded_vocab_size = wm.padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, cli.tp)
    model = mm.model_provider(args, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.cuda()
    layout = mm.layout_for(args, hf_config)
    mm.load_hf_weights(model, cli.hf_dir, layout)

    result = {"tp": cli.tp, "pp": cli.pp, "ep": cli.ep, "model_type": hf_config["model_type"],
              "transformer_engine": mm.have_transformer_engine()}
    reader = mm.HFCheckpointReader(cli.hf_dir)
    mismatches, exported = [], set()
    for name, tensor in mm.iter_hf_weights(model, layout):
        exported.add(name)
        if not torch.equal(tensor.cpu(), reader(name).to(tensor.dtype)) or tensor.dtype != reader(name).dtype:
            mismatches.append(name)
    expected = set(reader._where) - ({"lm_head.weight"} if hf_config.get("tie_word_embeddings") else set())
    result["roundtrip_mismatches"] = mismatches
    result["roundtrip_missing"] = sorted(expected - exported)
    result["roundtrip_extra"] = sorted(exported - expected)

    if cli.pp == 1:
        from transformers import AutoModelForCausalLM

        generator = torch.Generator().manual_seed(0)
        lengths, responses = [37, 64, 11, 90], [20, 30, 5, 41]
        tokens = [torch.randint(0, hf_config["vocab_size"], (n,), generator=generator) for n in lengths]
        targets = mm.response_targets(tokens, responses).cuda()
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = mm.forward_logits(model, tokens, responses, torch.device("cuda"), packed=False)
            megatron_lp = ppo_utils.compute_log_probs(logits.float(), targets, 1.0)
            if mm.have_transformer_engine():
                packed = mm.forward_logits(model, tokens, responses, torch.device("cuda"), packed=True)
                result["packed_vs_padded_max_abs"] = float((ppo_utils.compute_log_probs(packed.float(), targets, 1.0) - megatron_lp).abs().max())
        with torch.no_grad():  # fp32 end to end: the layouts must agree to float rounding
            logits32 = mm.forward_logits(model, tokens, responses, torch.device("cuda"), packed=False)
            megatron_lp32 = ppo_utils.compute_log_probs(logits32.float(), targets, 1.0)
        hf = AutoModelForCausalLM.from_pretrained(cli.hf_dir, dtype=torch.float32).cuda().eval()

        def hf_log_probs(autocast: bool) -> torch.Tensor:
            pieces = []
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                for t, r in zip(tokens, responses):
                    out = hf(t[None].cuda()).logits[0].float()
                    pieces.append(ppo_utils.compute_log_probs(out[len(t) - r - 1: len(t) - 1], t[len(t) - r:].cuda(), 1.0))
            return torch.cat(pieces)

        hf_lp, hf_lp32 = hf_log_probs(True), hf_log_probs(False)
        diff, diff32 = (megatron_lp - hf_lp).abs(), (megatron_lp32 - hf_lp32).abs()
        result.update(logprob_max_abs=float(diff.max()), logprob_mean_abs=float(diff.mean()),
                      logprob_fp32_max_abs=float(diff32.max()), logprob_fp32_mean_abs=float(diff32.mean()),
                      hf_bf16_vs_fp32_mean_abs=float((hf_lp - hf_lp32).abs().mean()),
                      logprob_mean=float(hf_lp32.mean()), logprob_std=float(hf_lp32.std()), num_tokens=int(diff.numel()))
    if dist.get_rank() == 0:
        with open(cli.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
