"""Megatron vs HF on one checkpoint, run under torchrun (GPU: NCCL; CPU: gloo, see megatron_cpu.py).

    torchrun --nproc-per-node N tests/backends/megatron_utils/megatron_parity_check.py \
        --hf-dir DIR --tp 1 --pp 1 --ep 1 --out result.json [--no-grads] [--padded]

Builds the GPTModel of the HF checkpoint at DIR (shape flags from its config.json) for this rank's
TP/PP/EP shard, loads the safetensors into it, and records in one JSON (written by rank 0):

* ``roundtrip_*``: HF-named export (TP/EP gathered, pipeline stages broadcast) vs the safetensors,
  bit for bit — the names of mismatching, missing and extra tensors;
* ``layer_max_abs`` (fp32): per decoder layer, the largest difference between Megatron's and HF's
  hidden state after that layer, plus ``embedding_max_abs`` and ``logits_max_abs`` (vocabulary
  padding cut) — the first large entry names the place where the two models part;
* ``logprob_fp32_*``: response-token log-probs through the trainer's path (the pipeline schedule,
  two micro-batches, packed unless ``--padded``) vs HF, fp32, and ``output_layer_rows``: the most hidden-state rows the output
  layer was run on in one micro-batch of that path (its response rows only: 50); on GPU also ``logprob_*`` under bf16 autocast on both sides and
  HF's own bf16-vs-fp32 drift ``hf_bf16_vs_fp32_mean_abs`` / ``_max_abs``, and Megatron's bf16
  against HF's fp32 (``logprob_vs_fp32_*``: in an MoE a near-tie router decision flips between two
  bf16 runs and moves that token by up to a nat, so its bound is HF's own bf16 error);
* ``grad_*`` (fp32, unless ``--no-grads``): the gradient of Σ w·log π (fixed random w) through the
  schedule's training pass vs HF's, per parameter shard: ``grad_max_rel`` and the worst tensors.
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
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (packed micro-batches only)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-grads", action="store_true")
    parser.add_argument("--padded", action="store_true", help="right-padded micro-batches on the trainer's path (default: packed)")
    cli = parser.parse_args()

    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    global PACKED
    PACKED = not cli.padded
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        from megatron_cpu import patch_for_cpu

        patch_for_cpu()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    from megatron.core import parallel_state as ps

    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import weight_mapping as wm
    from slime.backends.megatron_utils.model_config import fill_model_args, hf_validate_args, load_hf_config
    from slime.arguments import get_parser

    dist.init_process_group("nccl" if cuda else "gloo")
    ps.initialize_model_parallel(cli.tp, cli.pp, context_parallel_size=cli.cp, expert_model_parallel_size=cli.ep,
                                 expert_tensor_parallel_size=1)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)

    parser_, _ = get_parser(parse_sglang=False)
    args = parser_.parse_args(["--rollout-batch-size", "1", "--num-rollout", "1", "--tensor-model-parallel-size", str(cli.tp),
                               "--pipeline-model-parallel-size", str(cli.pp), "--expert-model-parallel-size", str(cli.ep),
                               "--context-parallel-size", str(cli.cp),
                               "--expert-tensor-parallel-size", "1", "--hf-checkpoint", cli.hf_dir])
    hf_config = load_hf_config(cli.hf_dir)
    fill_model_args(args, hf_config)
    hf_validate_args(args, hf_config)
    args.padded_vocab_size = wm.padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, cli.tp)
    overrides = {}
    if not cuda:
        overrides = dict(use_cpu_initialization=True, perform_initialization=False, batch_p2p_comm=False)
        if not getattr(args, "num_experts", None):
            # Megatron refuses variable lengths with its allgather dispatcher even for dense models;
            # a dense model never dispatches (MoE on the CPU: fixed lengths, hence PP = 1)
            overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    config = mm.transformer_config(args, **overrides)
    model = mm.model_provider(args, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                              config=config)
    model.to(device)
    layout = mm.layout_for(args, hf_config)
    mm.load_hf_weights(model, cli.hf_dir, layout)

    result = {"tp": cli.tp, "pp": cli.pp, "ep": cli.ep, "cp": cli.cp, "packed": PACKED, "device": device.type, "model_type": hf_config["model_type"],
              "vocab_size": layout.vocab_size, "padded_vocab_size": layout.padded_vocab_size,
              "transformer_engine": mm.have_transformer_engine()}
    result.update(roundtrip(model, layout, cli.hf_dir, hf_config))

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(cli.hf_dir, dtype=torch.float32).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    lengths, responses = [37, 64, 11, 90], [20, 30, 5, 41]
    tokens = [torch.randint(0, hf_config["vocab_size"], (n,), generator=generator) for n in lengths]
    weights = [torch.randn(r, generator=generator) for r in responses]
    model.eval()
    if cli.cp == 1:  # (one sample at a time through the padded layout: not a context-parallel layout)
        result.update(layer_diffs(model, hf, tokens, responses, layout, device))
    result.update(logprob_parity(model, hf, tokens, responses, layout, device, cuda))
    if not cli.no_grads:
        model.train()
        result.update(grad_parity(model, hf, tokens, responses, weights, layout, device))
    if dist.get_rank() == 0:
        with open(cli.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def roundtrip(model, layout, hf_dir, hf_config) -> dict:
    from slime.backends.megatron_utils import model as mm

    reader = mm.HFCheckpointReader(hf_dir)
    mismatches, exported = [], set()
    for name, tensor in mm.iter_hf_weights(model, layout):
        exported.add(name)
        if not torch.equal(tensor.cpu(), reader(name).to(tensor.dtype)) or tensor.dtype != reader(name).dtype:
            mismatches.append(name)
    expected = set(reader._where) - ({"lm_head.weight"} if hf_config.get("tie_word_embeddings") else set())
    return {"roundtrip_mismatches": mismatches, "roundtrip_missing": sorted(expected - exported),
            "roundtrip_extra": sorted(exported - expected)}


def _gather_to_all(values: dict) -> dict:
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, values)
    merged = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = max(merged.get(key, 0.0), value)
    return merged


@torch.no_grad()
def layer_diffs(model, hf, tokens, responses, layout, device) -> dict:
    """fp32, one sample at a time, no pipeline schedule: each stage compares the layers it holds
    (a later stage is fed HF's hidden state at its first layer, so a stage is judged on its own)."""
    from megatron.core import parallel_state as ps

    from slime.backends.megatron_utils import forward as fw
    from slime.backends.megatron_utils import model as mm

    gpt = mm.unwrap(model)
    diffs: dict = {}
    for t, r in zip(tokens[:2], responses[:2]):
        ids = t[None].to(device)
        out = hf(ids, output_hidden_states=True)
        hf_states = out.hidden_states  # [embeddings, after layer 0, ..., after the last layer + final norm]
        captured = {}
        hooks = [layer.register_forward_hook(lambda mod, inp, output, n=layer.layer_number - 1:
                                             captured.__setitem__(n, (output[0] if isinstance(output, tuple) else output)))
                 for layer in gpt.decoder.layers]
        if ps.is_pipeline_first_stage():
            hooks.append(gpt.embedding.register_forward_hook(lambda mod, inp, output: captured.__setitem__("emb", output)))
        else:
            first = gpt.decoder.layers[0].layer_number - 1
            gpt.set_input_tensor(hf_states[first].transpose(0, 1).contiguous())
        inputs = fw.micro_batch_inputs([t], [r], device, packed=False)
        output = fw.run_model(gpt, inputs, all_positions=True)
        for h in hooks:
            h.remove()
        if "emb" in captured:
            diffs["embedding_max_abs"] = max(diffs.get("embedding_max_abs", 0.0),
                                             float((captured["emb"][:, 0] - hf_states[0][0]).abs().max()))
        for n, state in captured.items():
            if n == "emb":
                continue
            # HF's last hidden state has the final norm applied: the last layer is compared through the logits
            if n + 1 < len(hf_states) - 1:
                key = f"layer_{n}"
                diffs[key] = max(diffs.get(key, 0.0), float((state[:, 0] - hf_states[n + 1][0]).abs().max()))
        if ps.is_pipeline_last_stage():
            logits = output.reshape(-1, output.shape[-1])[:, : layout.vocab_size]
            diffs["logits_max_abs"] = max(diffs.get("logits_max_abs", 0.0), float((logits - out.logits[0]).abs().max()))
            if layout.padded_vocab_size > layout.vocab_size:
                diffs["padding_logits_max_abs"] = float(output[..., layout.vocab_size:].abs().max())
    merged = _gather_to_all(diffs)
    layers = {int(k.split("_")[1]): v for k, v in merged.items() if k.startswith("layer_")}
    return {"layer_max_abs": [layers[i] for i in sorted(layers)],
            **{k: v for k, v in merged.items() if not k.startswith("layer_")}}


PACKED = True  # the layout of the trainer's path (--padded)


def _trainer_batches(tokens, responses, device):
    from megatron.core import parallel_state as ps

    from slime.backends.megatron_utils import forward as fw

    half = len(tokens) // 2
    cp = dict(cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank())
    return [fw.micro_batch_inputs(tokens[:half], responses[:half], device, packed=PACKED, sample_indices=list(range(half)), **cp),
            fw.micro_batch_inputs(tokens[half:], responses[half:], device, packed=PACKED,
                                  sample_indices=list(range(half, len(tokens))), **cp)]


OUTPUT_LAYER_ROWS: list[int] = []


def _megatron_log_probs(model, tokens, responses, layout, device, autocast) -> torch.Tensor:
    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import pipeline
    from slime.algorithms import functional as algo

    def collect(inputs, logits):
        return logits.new_zeros(()), inputs.gather(algo.compute_log_probs(logits.float(), inputs.targets, 1.0)).cpu()

    gpt = mm.unwrap(model)
    rows: list[int] = []  # hidden-state rows the output layer is run on, per micro-batch (last stage)
    hook = gpt.output_layer.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0] * inp[0].shape[1])) \
        if getattr(gpt, "post_process", False) else None
    with torch.no_grad():
        parts = pipeline.forward_backward(model, _trainer_batches(tokens, responses, device), collect, forward_only=True,
                                          vocab_size=layout.vocab_size, autocast_dtype=torch.bfloat16 if autocast else None)
    if hook is not None:
        hook.remove()
    OUTPUT_LAYER_ROWS[:] = rows
    return torch.cat(pipeline.broadcast_from_last_stage(parts))


def _hf_log_probs(hf, tokens, responses, device, autocast: bool, grad: bool = False) -> torch.Tensor:
    from slime.algorithms import functional as algo

    pieces = []
    with torch.set_grad_enabled(grad), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for t, r in zip(tokens, responses):
            out = hf(t[None].to(device)).logits[0].float()
            pieces.append(algo.compute_log_probs(out[len(t) - r - 1: len(t) - 1], t[len(t) - r:].to(device), 1.0))
    return torch.cat(pieces)


def logprob_parity(model, hf, tokens, responses, layout, device, cuda: bool) -> dict:
    megatron32 = _megatron_log_probs(model, tokens, responses, layout, device, autocast=False)
    hf32 = _hf_log_probs(hf, tokens, responses, device, autocast=False).cpu()
    diff32 = (megatron32 - hf32).abs()
    out = dict(logprob_fp32_max_abs=float(diff32.max()), logprob_fp32_mean_abs=float(diff32.mean()),
               logprob_mean=float(hf32.mean()), logprob_std=float(hf32.std()), num_tokens=int(diff32.numel()),
               output_layer_rows=_gather_to_all({"rows": max(OUTPUT_LAYER_ROWS, default=0)})["rows"])
    if cuda:
        megatron16 = _megatron_log_probs(model, tokens, responses, layout, device, autocast=True)
        hf16 = _hf_log_probs(hf, tokens, responses, device, autocast=True).cpu()
        diff = (megatron16 - hf16).abs()
        out.update(logprob_max_abs=float(diff.max()), logprob_mean_abs=float(diff.mean()),
                   hf_bf16_vs_fp32_mean_abs=float((hf16 - hf32).abs().mean()),
                   hf_bf16_vs_fp32_max_abs=float((hf16 - hf32).abs().max()),
                   logprob_vs_fp32_max_abs=float((megatron16 - hf32).abs().max()),
                   logprob_vs_fp32_mean_abs=float((megatron16 - hf32).abs().mean()))
    return out


def _checkpoint_named(tensors: dict) -> dict:
    """transformers 5 keeps a layer's experts fused (``mlp.experts.gate_up_proj`` ``[E, 2·I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``); the mapping speaks checkpoint names (one tensor per expert)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, both in enumerate(tensor):
                gate, up = both.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, down in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def grad_parity(model, hf, tokens, responses, weights, layout, device) -> dict:
    """Gradient of Σ w·log π, fp32: the trainer's path (Megatron DDP, the schedule's training pass
    over two micro-batches, ``finalize_model_grads``: TP sums of qk-layernorm grads, tied embedding
    copies across stages) vs HF."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import pipeline
    from slime.backends.megatron_utils import weight_mapping as wm
    from slime.algorithms import functional as algo

    gpt = mm.unwrap(model)
    ddp = DistributedDataParallel(config=gpt.config, module=gpt, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
    ddp.zero_grad_buffer()
    w = {i: weights[i].to(device) for i in range(len(tokens))}

    # Megatron's DDP averages the gradients over the data- and context-parallel ranks; here every
    # data-parallel rank (the EP=2 case) runs the same samples, while the CP ranks' gradients are
    # parts of one sum (the trainer's loss carries the whole factor, its DP ranks run different samples)
    scale = ps.get_context_parallel_world_size()

    def loss_fn(inputs, logits):
        log_probs = inputs.gather(algo.compute_log_probs(logits.float(), inputs.targets, 1.0))
        weight = torch.cat([w[i] for i in inputs.sample_indices])
        return (log_probs * weight).sum() * scale, None

    pipeline.forward_backward(ddp, _trainer_batches(tokens, responses, device), loss_fn, forward_only=False,
                              vocab_size=layout.vocab_size)
    finalize_model_grads([ddp])
    hf.zero_grad(set_to_none=True)
    (_hf_log_probs(hf, tokens, responses, device, autocast=False, grad=True) * torch.cat(weights).to(device)).sum().backward()
    hf_grads = _checkpoint_named({n: p.grad.detach() for n, p in hf.named_parameters() if p.grad is not None})
    hf_grads.setdefault("lm_head.weight", hf_grads.get("model.embed_tokens.weight"))
    names = mm._global_names(gpt, layout, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
    ranks = mm._rank_info()
    worst: dict = {}
    for local_name, param in gpt.named_parameters():
        name = names[local_name]
        grad = param.main_grad
        full = wm.hf_to_megatron_tensor(name, hf_grads.__getitem__, layout)
        tp_size, tp_rank = (ranks["etp_size"], ranks["etp_rank"]) if wm.is_expert_param(name) else (ranks["tp_size"], ranks["tp_rank"])
        expected = wm.tp_split(name, full, tp_size)[tp_rank].to(grad.device)
        scale = float(expected.abs().max()) or 1.0
        worst[name] = float((grad - expected).abs().max()) / scale
    merged = _gather_to_all(worst)
    top = sorted(merged.items(), key=lambda kv: -kv[1])[:5]
    return {"grad_max_rel": max(merged.values()), "grad_worst": top, "grad_tensors": len(merged)}


if __name__ == "__main__":
    main()
