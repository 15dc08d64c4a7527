"""FSDP2 trainer worker on the tiny model (CPU, gloo): exactness of packing, accumulation and DP,
first-step invariants, learning, checkpoints, HF export, weight buckets, PPO critic."""

import copy
import os

import pytest
import torch

from slime.backends.training.backend import ModelOutput
from slime.backends.training.worker import TrainWorker
from tests.backends.fsdp_utils.fsdp_test_utils import (
    free_port,
    make_args,
    make_samples,
    rank_data,
    regrouped,
    spawned_step_gradients,
    step_zero_gradients,
)

pytestmark = pytest.mark.usefixtures("single_rank")

LOSS_FLAGS = ("--num-steps-per-rollout", "1", "--use-kl-loss", "--kl-loss-coef", "0.1", "--entropy-coef", "0.01",
              "--rollout-temperature", "0.8", "--log-probs-chunk-size", "5")


def new_worker(args):
    worker = TrainWorker(args)
    worker.init()
    return worker


def test_packed_log_probs_equal_unpacked(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--rollout-temperature", "0.7", rbs=3)
    worker = new_worker(args)
    data = rank_data(args, make_samples(6))
    n = len(data.tokens)
    packed, _ = worker.backend.forward_only("model", regrouped(data, [list(range(n))]), ModelOutput("log_probs"))
    single, _ = worker.backend.forward_only("model", regrouped(data, [[i] for i in range(n)]), ModelOutput("log_probs"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i in range(n):
        tokens, r = data.tokens[i], int(data.response_lengths[i])
        with torch.no_grad():
            logits = reference(tokens[None]).logits[0].float() / 0.7
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - r - 1, len(tokens) - 1), tokens[-r:]]
        torch.testing.assert_close(packed[i], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(single[i], expected, atol=1e-5, rtol=0)


def _assert_same_step(a, b):
    (metrics_a, grads_a), (metrics_b, grads_b) = a, b
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5, abs=1e-7), key
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("per_token", [False, True])
def test_loss_and_grads_independent_of_micro_batching(tiny_model_dir, per_token):
    extra = LOSS_FLAGS + (("--calculate-per-token-loss",) if per_token else ())
    worker = new_worker(make_args(tiny_model_dir, *extra, rbs=4))
    results, counts = [], []
    for batching in (("--micro-batch-size", "8"), ("--micro-batch-size", "1"),
                     ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "24")):
        args = make_args(tiny_model_dir, *extra, *batching, rbs=4)
        data = rank_data(args, make_samples(8, seed=1))
        counts.append(len(data.schedule.micro_batch_indices))
        results.append(step_zero_gradients(worker, data))
    assert counts[0] == 1 and counts[1] == 8 and 1 < counts[2] < 8
    _assert_same_step(results[0], results[1])
    _assert_same_step(results[0], results[2])


def test_one_vs_two_gloo_ranks(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    extra = LOSS_FLAGS + ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "24")
    args = make_args(tiny_model_dir, *extra, rbs=4)
    single = step_zero_gradients(new_worker(args), rank_data(args, make_samples(8, seed=1)), rollout_metrics=True)
    out = tmp_path / "two_ranks.pt"
    mp.spawn(spawned_step_gradients, args=(2, free_port(), str(tiny_model_dir), extra, 8, 4, str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=False)
    _assert_same_step(single, (two["reduced"], two["grads"]))


def test_first_step_invariants(tiny_model_dir):
    args = make_args(tiny_model_dir, *LOSS_FLAGS)
    worker = new_worker(args)
    data = rank_data(args, make_samples(4))
    computed = worker.compute_log_probs(data)
    for old, ref in zip(computed["log_probs"], computed["ref_log_probs"]):
        assert torch.equal(old, ref)
    metrics = worker.train(0, data)
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/kl_loss"] == 0.0
    assert "rollout/log_probs" not in metrics  # one step per rollout: the π_old pass is skipped (§5)
    for key in ("train/pg_loss", "train/entropy_loss", "train/grad_norm", "train/lr-pg_0",
                "rollout/ref_log_probs", "rollout/advantages", "perf/actor_train_tok_per_s", "perf/actor_train_tflops"):
        assert key in metrics, key
    assert metrics["train/ppo_kl"] == 0.0


def test_grpo_steps_raise_rewarded_log_probs(tiny_model_dir):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--lr", "2e-3", "--clip-grad", "10")
    worker = new_worker(args)
    data = rank_data(args, make_samples(4, rewards=[1.0, 0.0, 0.0, 1.0]))
    before_params = {k: v.full_tensor().clone() for k, v in worker.backend.model.state_dict().items()}
    before = [lp.sum() for lp in worker.compute_log_probs(data)["log_probs"]]
    for rollout_id in range(3):
        worker.train(rollout_id, data)
    after = [lp.sum() for lp in worker.compute_log_probs(data)["log_probs"]]
    assert after[0] > before[0] and after[3] > before[3]
    assert after[1] < before[1] and after[2] < before[2]
    changed = [k for k, v in worker.backend.model.state_dict().items() if not torch.equal(v.full_tensor(), before_params[k])]
    assert len(changed) > len(before_params) // 2


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async_save"])
def test_save_load_resumes_bit_identical(tiny_model_dir, tmp_path, async_save):
    """With --async-save the checkpoint is written while the next step changes the parameters and
    the optimizer state in place: what is resumed is still the state of the step that saved it."""
    extra = ("--num-steps-per-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.1", "--lr", "1e-3",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", *(["--async-save"] if async_save else []))
    save_dir = str(tmp_path / "ckpt")
    args = make_args(tiny_model_dir, *extra, "--save", save_dir, rbs=2)
    data = rank_data(args, make_samples(4))
    worker = new_worker(args)
    worker.train(0, data)
    worker.save(0)
    expected = worker.train(1, copy.copy(data))  # async: runs while checkpoint 0 is written
    worker.wait_for_save()
    assert open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read() == "0"
    resumed_args = make_args(tiny_model_dir, *extra, "--load", save_dir, rbs=2)
    resumed = TrainWorker(resumed_args)
    assert resumed.init() == 1
    got = resumed.train(1, copy.copy(data))
    for key, value in expected.items():
        if not key.startswith("perf/"):
            assert got[key] == value, key
    for (name, a), (_, b) in zip(worker.backend.model.state_dict().items(), resumed.backend.model.state_dict().items()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def _without_gradient(worker, name: str):
    """Drop ``name``'s gradient before every optimizer step, as for a parameter the loss did not reach
    (an expert no token was routed to): Adam creates no state for it."""
    backend = worker.backend
    param = dict(backend.model.named_parameters())[name]
    step = backend.optimizer_step

    def optimizer_step():
        param.grad = None
        return step()

    backend.optimizer_step = optimizer_step
    return param


def test_resume_with_a_parameter_that_has_no_optimizer_state(tiny_model_dir, tmp_path):
    """The checkpoint holds Adam state only for parameters that had a gradient; a fresh optimizer's
    load template has it for all of them. The resume loads what was saved (before: DCP's "Missing key
    in checkpoint state_dict: optim.state.<name>.step") and goes on exactly as the uninterrupted run."""
    name = "model.layers.0.self_attn.q_proj.weight"
    extra = ("--num-steps-per-rollout", "2", "--lr", "1e-3")
    save_dir = str(tmp_path / "ckpt")
    args = make_args(tiny_model_dir, *extra, "--save", save_dir, rbs=2)
    data = rank_data(args, make_samples(4))
    worker = new_worker(args)
    param = _without_gradient(worker, name)
    worker.train(0, data)
    assert param not in worker.backend.optimizer.state and len(worker.backend.optimizer.state) > 1
    worker.save(0)
    expected = worker.train(1, copy.copy(data))
    resumed = TrainWorker(make_args(tiny_model_dir, *extra, "--load", save_dir, rbs=2))
    assert resumed.init() == 1
    resumed_param = _without_gradient(resumed, name)
    state = resumed.backend.optimizer.state
    assert resumed_param not in state and len(state) == len(worker.backend.optimizer.state)
    assert {float(s["step"]) for s in state.values()} == {2.0}
    got = resumed.train(1, copy.copy(data))
    for key, value in expected.items():
        if not key.startswith("perf/"):
            assert got[key] == value, key
    for (key, a), (_, b) in zip(worker.backend.model.state_dict().items(), resumed.backend.model.state_dict().items()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), key


def test_hf_export_reloads_with_same_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--lr", "1e-3")
    worker = new_worker(args)
    worker.train(0, rank_data(args, make_samples(4)))
    out = tmp_path / "hf"
    worker.save_hf(str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(out)
    tokens = torch.tensor([[5, 17, 42, 99, 7, 300]])
    with torch.no_grad():
        ours = worker.backend.model(input_ids=tokens).logits
        theirs = reloaded(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(original(input_ids=tokens).logits, theirs)


def test_weight_buckets_are_full_hf_named_tensors(tiny_model_dir):
    from safetensors.torch import load_file

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1")
    worker = new_worker(args)
    reference = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    limit = 200_000
    buckets = list(worker.iter_weight_buckets(limit))
    names = [name for bucket in buckets for name, _ in bucket]
    assert sorted(names) == sorted(reference)
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
        for name, tensor in bucket:
            assert torch.equal(tensor.cpu(), reference[name]), name


def test_ppo_critic_value_loss_falls(tiny_model_dir):
    args = make_args(tiny_model_dir, "--advantage-estimator", "ppo", "--num-steps-per-rollout", "1", "--lr", "1e-3",
                     "--critic-lr", "3e-3", "--value-clip", "10")
    critic = TrainWorker(args, role="critic")
    critic.init()
    actor = new_worker(args)
    data = rank_data(args, make_samples(4, rewards=[1.0, -1.0, 0.5, 2.0]))
    losses = []
    for rollout_id in range(10):
        values = critic.compute_values(data)
        assert [v.numel() for v in values] == [int(n) for n in data.response_lengths]
        losses.append(critic.train(rollout_id, data.replace(values=values))["train/critic-value_loss"])
    assert losses[-1] < 0.3 * losses[0], losses
    metrics = actor.train(0, data.replace(values=critic.compute_values(data)))
    assert metrics["train/ppo_kl"] == 0.0 and "rollout/values" in metrics


def test_hooks_are_called_with_documented_signatures(tiny_model_dir, monkeypatch):
    import sys
    import types

    calls = []
    module = types.ModuleType("_fsdp_hooks")
    module.postprocess = lambda args, rollout_id, rollout_data: calls.append(("post", rollout_id, "advantages" in rollout_data))
    module.before_step = lambda args, rollout_id, step_id, model, optimizer, sched: calls.append(("step", rollout_id, step_id))

    def reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
        calls.append(("reducer", len(total_lengths)))
        return lambda x: x.sum() * 0.0

    def custom_loss(args, batch, logits, sum_of_sample_mean):
        calls.append(("loss", tuple(logits.shape[:2]), len(batch["unconcat_tokens"])))
        value = sum_of_sample_mean(torch.zeros(sum(batch["response_lengths"])) + logits.mean())
        return value, {"custom": value.detach()}

    module.reducer, module.custom_loss = reducer, custom_loss
    monkeypatch.setitem(sys.modules, "_fsdp_hooks", module)
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "2", "--rollout-data-postprocess-path", "_fsdp_hooks.postprocess",
                     "--custom-megatron-before-train-step-hook-path", "_fsdp_hooks.before_step",
                     "--custom-pg-loss-reducer-function-path", "_fsdp_hooks.reducer")
    worker = new_worker(args)
    data = rank_data(args, make_samples(4))
    metrics = worker.train(3, data)
    assert ("post", 3, True) in calls and ("step", 3, 0) in calls and ("step", 3, 1) in calls
    assert any(c[0] == "reducer" for c in calls) and metrics["train/pg_loss"] == 0.0
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--loss-type", "custom_loss",
                     "--custom-loss-function-path", "_fsdp_hooks.custom_loss")
    metrics = new_worker(args).train(0, rank_data(args, make_samples(4)))
    assert "train/custom" in metrics and any(c[0] == "loss" for c in calls)


@pytest.mark.gpu
def test_gpu_bf16_offload_onload(tiny_model_dir):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1")
    worker = new_worker(args)
    assert worker.backend.mixed_precision
    worker.train(0, rank_data(args, make_samples(4)))
    backend = worker.backend

    def device_tensors():
        params = [p.to_local() if hasattr(p, "to_local") else p for p in backend.model.parameters()]
        states = [v.to_local() if hasattr(v, "to_local") else v
                  for st in backend.optimizer.state.values() for k, v in st.items() if k != "step" and torch.is_tensor(v)]
        return params, states

    params, states = device_tensors()
    snapshot = [t.detach().cpu() for t in params + states]
    held = sum(t.numel() * t.element_size() for t in params + states)
    del params, states  # no reference here may keep the device copies alive
    before = torch.cuda.memory_allocated()
    worker.begin_offload()  # the optimizer state starts for the host (the weight push would run now)
    worker.offload()
    assert before - torch.cuda.memory_allocated() >= held  # parameters and Adam state left the device
    host_params, host_states = device_tensors()
    # on the host in pinned memory: the copies both ways run at pinned bandwidth
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host_params + host_states)
    worker.onload()  # the parameters now, the optimizer state on a side stream until the optimizer step awaits it
    worker.backend.await_optimizer_state()
    params, states = device_tensors()
    assert all(t.is_cuda for t in params + states)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(snapshot, params + states))  # bit-exact round trip
    worker.train(1, rank_data(args, make_samples(4)))


@pytest.mark.gpu
def test_gpu_steps_offloaded_between_them_train_as_resident_ones(tiny_model_dir):
    """Colocated offloading between steps (the optimizer state leaves on a side stream while the push would
    run, and comes back while the forward and backward passes run) trains the same weights as a worker that
    stays on the device: the optimizer step waits for the state it reads."""
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--lr", "1e-3", rbs=2)
    data = rank_data(args, make_samples(4))
    resident, moved = new_worker(args), new_worker(args)
    for step in range(3):
        expected = resident.train(step, copy.copy(data))
        got = moved.train(step, copy.copy(data))
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-3, abs=1e-6), step
        moved.begin_offload()
        moved.offload()
        moved.onload()
    for (name, a), (_, b) in zip(resident.backend.model.state_dict().items(), moved.backend.model.state_dict().items()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async_save"])
def test_gpu_save_load_resumes_with_fused_adamw(tiny_model_dir, tmp_path, async_save):
    """On CUDA the optimizer is the fused AdamW (its step counts are device tensors): a resume from
    the checkpoint restores the step count and moments, so the next rollout's metrics and weights
    match the uninterrupted run (to GPU rounding: kernels with atomics are not bit-deterministic).
    With --async-save the state is staged from the GPU to host memory and written while step 1 runs."""
    extra = ("--num-steps-per-rollout", "2", "--lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
             *(["--async-save"] if async_save else []))
    save_dir = str(tmp_path / "ckpt")
    args = make_args(tiny_model_dir, *extra, "--save", save_dir, rbs=2)
    data = rank_data(args, make_samples(4))
    worker = new_worker(args)
    assert worker.backend.optimizer.defaults.get("fused")
    worker.train(0, data)
    worker.save(0)
    expected = worker.train(1, copy.copy(data))
    worker.wait_for_save()
    resumed = TrainWorker(make_args(tiny_model_dir, *extra, "--load", save_dir, rbs=2))
    assert resumed.init() == 1
    steps = {float(s["step"]) for s in resumed.backend.optimizer.state.values()}
    assert steps == {2.0}, steps
    got = resumed.train(1, copy.copy(data))
    for key in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/grad_norm", "train/entropy_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-6), key
    for (name, a), (_, b) in zip(worker.backend.model.state_dict().items(), resumed.backend.model.state_dict().items()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_gpu_packed_attention_gradients_reach_every_parameter(tiny_model_dir):
    """The default GPU attention (varlen flash, or flash-attn) passes gradients to its inputs: every
    trainable parameter, the q/k/v projections and norms included, gets one, pointing where SDPA's
    (block-causal mask) points. A parameter without a gradient would get no Adam state."""
    args = make_args(tiny_model_dir, *LOSS_FLAGS, rbs=4)
    sdpa_args = make_args(tiny_model_dir, *LOSS_FLAGS, "--fsdp-attn-implementation", "sdpa", rbs=4)
    data = rank_data(args, make_samples(8, seed=1))
    worker = new_worker(args)
    assert worker.backend.attn_implementation != "sdpa"
    trainable = {name for name, p in worker.backend.model.named_parameters() if p.requires_grad}
    _, grads = step_zero_gradients(worker, data)
    _, sdpa_grads = step_zero_gradients(new_worker(sdpa_args), copy.copy(data))
    assert set(grads) == set(sdpa_grads) == trainable, sorted(trainable - set(grads))
    for name in grads:
        cosine = torch.nn.functional.cosine_similarity(grads[name].flatten().float(), sdpa_grads[name].flatten().float(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


@pytest.mark.gpu
def test_gpu_packed_varlen_attention_matches_unpacked_fp32(tiny_model_dir):
    """On GPU the packed micro-batch runs PyTorch's varlen flash attention (no [T, T] mask); its
    log-probs match per-sample fp32 HF forwards within bf16 tolerance."""
    from transformers import AutoModelForCausalLM

    from slime.backends.training import varlen_attention

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", rbs=4)
    worker = new_worker(args)
    if varlen_attention.available():
        assert worker.backend.attn_implementation == "slime_varlen"
    data = rank_data(args, make_samples(8))
    n = len(data.tokens)
    packed, _ = worker.backend.forward_only("model", regrouped(data, [list(range(n))]), ModelOutput("log_probs"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    for i in range(n):
        tokens, r = data.tokens[i].cuda(), int(data.response_lengths[i])
        with torch.no_grad():
            logits = reference(tokens[None]).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - r - 1, len(tokens) - 1), tokens[-r:]]
        torch.testing.assert_close(packed[i].float().cuda(), expected, atol=0.05, rtol=0)


def test_only_train_params_name_list_freezes_the_rest(tiny_model_dir):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--lr", "1e-3", "--only-train-params-name-list", r"layers\.0\.mlp")
    worker = new_worker(args)
    before = {k: v.full_tensor().clone() for k, v in worker.backend.model.state_dict().items()}
    worker.train(0, rank_data(args, make_samples(4, rewards=[1.0, 0.0, 1.0, 0.0])))
    changed = {k for k, v in worker.backend.model.state_dict().items() if not torch.equal(v.full_tensor(), before[k])}
    assert changed and all("layers.0.mlp" in k for k in changed)


def test_unsupported_flags_fail_naming_them(tiny_model_dir):
    with pytest.raises(NotImplementedError, match="--use-routing-replay / --use-rollout-routing-replay with --keep-old-actor"):
        TrainWorker(make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--use-routing-replay", "--keep-old-actor"))
    with pytest.raises(ValueError, match="need an MoE model; model_type 'qwen3' has no MoE router"):
        new_worker(make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--use-rollout-routing-replay"))


def test_log_correct_samples_reports_the_entropy_of_correct_samples(tiny_model_dir):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--log-correct-samples")
    worker = new_worker(args)
    data = rank_data(args, make_samples(4, rewards=[1.0, 0.0, 0.5, 1.0]))
    entropy = worker.compute_log_probs(data)["entropy"]  # the π_old pass computes entropy under the flag
    masks = [m.float() for m in data.loss_masks]
    expected = sum(float((entropy[i] * masks[i]).sum()) for i in (0, 3)) / sum(float(masks[i].sum()) for i in (0, 3))
    everything = sum(float((e * m).sum()) for e, m in zip(entropy, masks)) / sum(float(m.sum()) for m in masks)
    assert abs(expected - everything) > 1e-4  # the correct samples' entropy is not the batch's
    metrics = worker.train(0, data)  # single optimizer step: the π_old pass still runs for the entropy
    assert metrics["rollout/correct_entropy"] == pytest.approx(expected, rel=1e-5)
