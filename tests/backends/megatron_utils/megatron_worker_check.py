"""GPU check of the training worker on the Megatron backend, run under torchrun by test_megatron_gpu.py (no Ray, no engine).

    torchrun --nproc-per-node N tests/backends/megatron_utils/megatron_worker_check.py \
        --hf-dir DIR --save DIR --out result.json [--resume] [--offload] [extra slime flags...]

Without --resume: init from the HF weights, train rollout 0 (records every step's ppo_kl), save it,
optionally offload + onload, train rollout 1. With --resume: init from --load (= --save), which must
resume at rollout 1, and train rollout 1 on the same data. Each run records rollout 1's metrics and
a checksum of every exported HF tensor, so the test can require resume to be exact.
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
    parser.add_argument("--save", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--role", default="actor", choices=["actor", "critic"])
    parser.add_argument("--routing-check", action="store_true",
                        help="MoE routing replay (pass --use-routing-replay or --use-rollout-routing-replay): the expert "
                             "choices the training forward uses, after the routers were perturbed")
    parser.add_argument("--save-hf", default=None, help="with --no-optimizer: also write the model as an HF directory")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="one rollout step's passes without the optimizer (Megatron's optimizer needs CUDA): "
                             "log-probs, loss metrics and the reduced gradients, for comparing layouts on the CPU")
    cli, extra = parser.parse_known_args()
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        from megatron_cpu import patch_for_cpu

        from slime.backends.megatron_utils.backend import CPU_TESTING_ENV

        patch_for_cpu()
        os.environ[CPU_TESTING_ENV] = "1"
    from slime.backends.training.worker import TrainWorker
    from slime.arguments import parse_args
    from tests.backends.fsdp_utils.fsdp_test_utils import make_samples, rank_data

    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    argv = ["--train-backend", "megatron", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "4",
            "--hf-checkpoint", cli.hf_dir, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--seed", "0", "--lr", "1e-4", "--save", cli.save,
            "--actor-num-gpus-per-node", str(world), *extra]
    if cli.resume:
        argv += ["--load", cli.save]
    args = parse_args(argv)
    worker = TrainWorker(args, role=cli.role)
    if cli.routing_check:
        return routing_check(worker, args, cli, rank, world)
    if cli.no_optimizer:
        return no_optimizer_pass(worker, args, cli, rank, world)
    start = worker.init()
    result = {"start": start, "world": world}
    layout = worker.layout
    data = [rank_data(args, make_samples(8, seed=s, vocab=400), dp_size=layout.dp_size, rank=layout.dp_rank) for s in (1, 2)]
    if not cli.resume:
        metrics0 = worker.train(0, data[0])
        result["rollout0"] = {k: v for k, v in metrics0.items() if k.startswith(("train/", "rollout/"))}
        result["rollout0_ppo_kl"] = [m.get("train/ppo_kl") for m in worker.get_step_metrics()]
        worker.save(0)
        if cli.role == "critic" and rank == 0:  # in a PPO run the actor's checkpoint marker sits beside <save>/critic;
            # --load validation reads that one (without it, --load would count as empty and the critic start fresh)
            with open(os.path.join(cli.save, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("0")
        if cli.offload and cuda:
            before = torch.cuda.memory_allocated()
            worker.offload()
            result["offload_freed_bytes"] = before - torch.cuda.memory_allocated()
            worker.onload()
    result["optimizer_before_rollout1"] = optimizer_summary(worker.backend.optimizer)
    result["weights_before_rollout1"] = weight_sums(worker)
    metrics = worker.train(1, data[1])
    result["rollout1"] = {k: v for k, v in metrics.items() if k.startswith("train/")}
    result["rollout1_steps"] = worker.get_step_metrics()
    result["rollout1_ppo_kl"] = [m.get("train/ppo_kl") for m in worker.get_step_metrics()]
    result["weights"] = weight_sums(worker)
    finish(result, cli.out, rank)


def finish(result: dict, out: str, rank: int) -> None:
    """Rank 0 writes ``result`` as JSON to ``out``; every rank leaves the process group."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def optimizer_summary(optimizer) -> dict:
    """What a resume must restore of the optimizer: each param group's lr/step and the sums of
    every Adam state tensor (so a diverging resume names the part that differs)."""
    from slime.backends.megatron_utils.offload import inner_optimizers

    out = {}
    for i, inner in enumerate(inner_optimizers(optimizer)):
        out[f"opt{i}_groups"] = [{k: (float(v) if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) else str(v))
                                  for k, v in g.items() if k != "params"} for g in inner.param_groups]
        sums: dict = {}
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    sums[key] = sums.get(key, 0.0) + float(value.double().abs().sum())
        out[f"opt{i}_state_sums"] = sums
    return out


def weight_sums(worker) -> dict[str, float]:
    """Σx + Σx² of every HF-named tensor (the critic: its backbone and its value head)."""
    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import pipeline

    backend = worker.backend
    named = list(mm.iter_hf_weights(backend.model, backend.model_layout, torch.float32, skip_prefixes=backend._head_prefixes()))
    if worker.role == "critic":
        gpt = mm.unwrap(backend.model)
        head = {f"value_head.{k}": v.detach().float().cpu() for k, v in gpt.output_layer.named_parameters()} \
            if getattr(gpt, "post_process", False) else None
        named += list(pipeline.broadcast_from_last_stage(head).items())
    return {name: float(t.double().sum()) + float((t.double() ** 2).sum()) for name, t in named}


def routing_check(worker, args, cli, rank: int, world: int) -> None:
    """π_old pass, then the routers' weights perturbed (their own top-k would now choose other
    experts), then the first optimizer step's forward/backward; records which experts every
    router call used against what it should have used (R2: the π_old pass's choice; R3: the
    engine's, given here as random choices per token)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils.routing_replay import rollout_targets
    from tests.backends.fsdp_utils.fsdp_test_utils import make_samples, rank_data

    backend = worker.backend
    backend.build_optimizer = lambda: (None, None)
    worker.init()
    samples = make_samples(8, seed=1, vocab=400)
    topk, experts, layers = args.moe_router_topk, backend.model_layout.num_experts, backend.model_layout.num_layers
    generator = torch.Generator().manual_seed(7)
    for sample in samples:  # the engine's choice: distinct random experts per token and layer
        sample.rollout_routed_experts = torch.rand(len(sample.tokens) - 1, layers, experts, generator=generator
                                                   ).argsort(-1)[..., :topk].tolist()
    data = rank_data(args, samples, dp_size=worker.layout.dp_size, rank=worker.layout.dp_rank)
    calls: list = []
    original = RouterReplay.get_replay_topk

    def logged(self, scores, topk_, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, indices = original(self, scores, topk_, num_groups, group_topk, default_compute_topk)
        own = default_compute_topk(scores, topk_, num_groups, group_topk)[1]
        calls.append((self, self.router_replay_action, indices.detach().cpu(), own.detach().cpu()))
        return probs, indices

    RouterReplay.get_replay_topk = logged
    prepared = worker.prepare(0, data)
    old_pass = list(calls)
    gpt = mm.unwrap(backend.model)
    with torch.no_grad():
        for module in gpt.modules():
            if getattr(module, "router_replay", None) is not None:
                module.weight.add_(torch.randn(module.weight.shape, generator=generator).to(module.weight.device) * 2.0)
    calls.clear()
    worker.forward_backward(prepared, 0)
    train_pass = list(calls)
    expected_train: list = []
    if args.use_rollout_routing_replay:
        counts = prepared.schedule.num_microbatches
        batches = [backend.inputs(prepared, mb) for mb in prepared.schedule.micro_batch_indices if mb]
        routed = prepared.rollout_routed_experts
        for inputs in batches:
            expected_train += rollout_targets(inputs, [routed[i] for i in inputs.sample_indices], backend.routing.layers, topk, "cpu")
        expected_old = expected_train
        expected_train = expected_train[: len(backend.routing.layers) * counts[0]]
    else:
        expected_old = [c[2] for c in old_pass]
        expected_train = expected_old[: len(train_pass)]
    result = {
        "old_pass_calls": len(old_pass), "train_calls": len(train_pass),
        "old_pass_actions": sorted({str(c[1]) for c in old_pass}), "train_actions": sorted({str(c[1]) for c in train_pass}),
        "old_pass_matches": all(torch.equal(c[2], e) for c, e in zip(old_pass, expected_old)) and len(old_pass) == len(expected_old),
        "train_matches": all(torch.equal(c[2], e) for c, e in zip(train_pass, expected_train)) and len(train_pass) == len(expected_train),
        # what the perturbed routers would have chosen themselves: must differ, or the check shows nothing
        "train_own_choice_differs": sum(int((c[3] != c[2]).any(-1).sum()) for c in train_pass),
    }
    finish(result, cli.out, rank)


def offloaded_export_equal(backend) -> bool:
    """Colocated mode pushes the weights after offloading the trainer: the HF tensors exported from
    the host copies equal those exported before. On the CPU the offload is simulated the way the
    GPU path leaves the model (host copies of the parameter buffers, device storage freed)."""
    from slime.backends.megatron_utils import model as mm

    def export():
        return {name: tensor.detach().cpu().clone() for name, tensor in mm.iter_hf_weights(
            backend.model, backend.model_layout, torch.float32, skip_prefixes=backend._head_prefixes(),
            param_source=backend.offloaded_param_source())}

    before = export()
    buffers = backend.ddp_model.buffers + backend.ddp_model.expert_parallel_buffers
    if torch.cuda.is_available():
        backend.offload()
    else:
        backend._host_copies = {i: buffer.param_data.clone() for i, buffer in enumerate(buffers)}
        for buffer in buffers:
            buffer.param_data.untyped_storage().resize_(0)
        backend.offloaded = True
    after = export()
    if torch.cuda.is_available():
        backend.onload()
    else:
        for i, buffer in enumerate(buffers):
            saved = backend._host_copies[i]
            buffer.param_data.untyped_storage().resize_(saved.numel() * saved.element_size())
            buffer.param_data.copy_(saved)
        backend._host_copies, backend.offloaded = {}, False
    return before.keys() == after.keys() and len(before) > 0 and all(torch.equal(before[k], after[k]) for k in before)


def gather_reduced_grad_shards(ddp) -> None:
    """With the distributed optimizer, finalize_model_grads reduce-scatters the gradient buffers:
    each data(-and-context)-parallel rank then holds only its shard of the reduced gradient. Put
    the shards together on every rank (as the optimizer's all-gather does for the weights)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        group = buffer.data_parallel_group
        if group.size() == 1:
            continue
        for bucket in buffer.buckets:
            shards = shard_buffer(bucket.grad_data, group.size())
            dist.all_gather(shards, shards[group.rank()].clone(), group=group)


def no_optimizer_pass(worker, args, cli, rank: int, world: int) -> None:
    """compute_log_probs + advantages + the first optimizer step's forward/backward and
    finalize_model_grads, through the worker's own code; records per-sample log-probs (the
    critic: values), the step's reduced metrics and every parameter's reduced gradient (HF-named,
    full; the critic's value head excluded)."""
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron_utils import model as mm
    from tests.backends.fsdp_utils.fsdp_test_utils import make_samples, rank_data

    backend = worker.backend
    backend.build_optimizer = lambda: (None, None)
    worker.init()
    # every rank of a data-parallel replica (the TP x PP x CP ranks) gets the shard of its dp rank
    shard = rank_data(args, make_samples(8, seed=1, vocab=400), dp_size=worker.layout.dp_size, rank=worker.layout.dp_rank)
    # the loop's direct call on this rank's shard (PPO): answered for exactly these samples
    direct = worker.compute_values(shard) if cli.role == "critic" else worker.compute_log_probs(shard)["log_probs"]
    direct_by_sample = {str(int(i)): v.tolist() for i, v in zip(shard.sample_indices, direct)}
    prepared = worker.prepare(0, shard)
    backend.ddp_model.zero_grad_buffer()
    sums, _, _ = worker.forward_backward(prepared, 0)
    finalize_model_grads([backend.ddp_model])
    gather_reduced_grad_shards(backend.ddp_model)
    metrics = worker.reduce_sums(sums, worker.step_normaliser(prepared, 0))
    rollout = worker.rollout_metrics(prepared) if cli.role == "actor" else {}
    # gradients in the HF layout: the same export path as the weights, applied to main_grad
    gpt = mm.unwrap(backend.model)
    saved = {name: p.data.clone() for name, p in gpt.named_parameters()}
    for p in gpt.parameters():
        p.data.copy_(p.main_grad)
    grads = {name: tensor.double() for name, tensor in
             mm.iter_hf_weights(backend.model, backend.model_layout, torch.float32, skip_prefixes=backend._head_prefixes())}
    for name, p in gpt.named_parameters():
        p.data.copy_(saved[name])
    offloaded_equal = offloaded_export_equal(backend)
    if cli.role == "critic" and cli.save_hf:
        worker.save_hf(cli.save_hf)
    samples = [int(i) for i in prepared.sample_indices] if prepared.sample_indices is not None else list(range(len(prepared.tokens)))
    # the actor's step may skip the π_old pass (one optimizer step, nothing needs it): then the
    # direct pass's log-probs are the recorded ones
    if cli.role == "critic":
        per_sample = prepared.values
    else:
        per_sample = prepared.log_probs if prepared.log_probs is not None else direct
    log_probs = {str(k): v.tolist() for k, v in zip(samples, per_sample)}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (log_probs, direct_by_sample))
    if rank == 0:
        merged = {k: v for part, _ in gathered for k, v in part.items()}
        direct_all = {k: v for _, part in gathered for k, v in part.items()}
        torch.save({"metrics": metrics, "rollout": rollout, "log_probs": merged, "direct": direct_all, "grads": grads,
                    "offloaded_export_equal": offloaded_equal}, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
