"""The Megatron backend on the CPU: real Megatron-Core (gloo, see megatron_cpu.py) vs HF and vs one rank.

Tensor parallelism (2 ranks) and pipeline parallelism (2 stages, Megatron's 1F1B schedule) on the
tiny Qwen3 (vocabulary 591, padded to 768 / 640), expert parallelism on a tiny Qwen3-MoE: HF ->
Megatron -> HF export bit-exact, each decoder layer's hidden state, the response log-probs through
the trainer's schedule, and the gradients after Megatron DDP + ``finalize_model_grads`` equal HF's
to float32 rounding. Then the training worker's own passes on the Megatron backend at PP=2 and CP=2 against one rank.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_cpu  # noqa: E402

CHECK = HERE / "megatron_parity_check.py"


def _run(hf_dir: str, out: Path, tp: int = 1, pp: int = 1, ep: int = 1, padded: bool = False, cp: int = 1) -> dict:
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp * ep * cp), "--standalone",
               str(CHECK), "--hf-dir", hf_dir, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--cp", str(cp),
               "--out", str(out)]
    command += ["--padded"] if padded else []
    proc = subprocess.run(command, cwd=megatron_cpu.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("tp,pp,padded", [(2, 1, False), (1, 2, False), (2, 1, True)], ids=["tp2", "pp2", "tp2-padded"])
def test_megatron_matches_hf_on_cpu(tiny_model_dir, tmp_path, tp, pp, padded):
    """The trainer's path in the packed (thd) layout — the local spec's PackedCoreAttention, per-token
    rotary angles — and right-padded."""
    result = _run(str(tiny_model_dir), tmp_path / "result.json", tp=tp, pp=pp, padded=padded)
    assert result["packed"] == (not padded) and not result["transformer_engine"]
    assert result["padded_vocab_size"] > result["vocab_size"]  # the padding is there, and must not count
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []
    assert len(result["layer_max_abs"]) == 3 and max(result["layer_max_abs"]) < 1e-5, result
    assert result["logits_max_abs"] < 1e-4 and result["padding_logits_max_abs"] == 0.0, result
    assert result["num_tokens"] == 96 and result["logprob_fp32_max_abs"] < 1e-4, result
    # the output layer ran on the response rows only (20 + 30 in the first micro-batch), not on all 2 x 64 positions
    assert result["output_layer_rows"] == 50, result
    # every parameter shard's gradient, incl. the qk-layernorm weights TP ranks share and the tied
    # embedding both end stages hold
    assert result["grad_tensors"] >= 34 and result["grad_max_rel"] < 1e-4, result


def test_context_parallel_matches_hf_on_cpu(tiny_model_dir, tmp_path):
    """CP=2: each rank holds two of the four chunks of every sample (padded to a multiple of 4),
    attends to the keys and values gathered from both ranks, and the response log-probs gathered
    back — and the gradients summed over the two ranks — equal HF's."""
    result = _run(str(tiny_model_dir), tmp_path / "result.json", cp=2)
    assert result["cp"] == 2 and result["packed"]
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []
    assert result["num_tokens"] == 96 and result["logprob_fp32_max_abs"] < 1e-4, result
    assert 0 < result["output_layer_rows"] < 50, result  # each rank ran the output layer on its share of the rows
    assert result["grad_tensors"] >= 34 and result["grad_max_rel"] < 1e-4, result


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A Qwen3-MoE: 8 experts, top-2, a dense first layer, vocabulary 4000 (padded to 4096)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from slime.utils.tiny_model import build_tokenizer

    config = Qwen3MoeConfig(vocab_size=4000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
                            tie_word_embeddings=False, mlp_only_layers=[0], max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    build_tokenizer(1024).save_pretrained(path)
    return str(path)


def test_moe_expert_parallel_matches_hf_on_cpu(tiny_moe_dir, tmp_path):
    """The MoE at EP=2: experts split over the two ranks, tokens dispatched between them; export,
    log-probs and gradients (router and experts included) equal HF's."""
    result = _run(tiny_moe_dir, tmp_path / "result.json", ep=2)
    assert result["padded_vocab_size"] == 4096
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []
    assert result["logprob_std"] > 0.5 and result["logprob_fp32_max_abs"] < 1e-4, result
    assert result["output_layer_rows"] == 50, result  # the response rows only
    assert result["grad_tensors"] == 57 and result["grad_max_rel"] < 1e-4, result


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_moe_families_at_expert_parallel_match_hf_on_cpu(arch, request, tmp_path):
    """DeepSeek-V3 (Megatron-Core's MLA with slime's latent core attention, YaRN; sigmoid router with
    expert bias and group-limited top-k; shared expert; dense first layer) and GLM-4.5 (partial
    rotary, qkv bias, qk-norm, the same router) at EP=2 against transformers: export bit-exact (the
    expert bias buffer included), log-probs through the schedule and every gradient."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    result = _run(model_dir, tmp_path / "result.json", ep=2, padded=arch == "deepseek_v3")
    assert result["model_type"] == arch and result["packed"] is (arch != "deepseek_v3")
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []
    assert result["logprob_std"] > 0.1 and result["logprob_fp32_max_abs"] < 1e-5, result
    assert result["grad_tensors"] == (98 if arch == "deepseek_v3" else 90) and result["grad_max_rel"] < 1e-4, result


def test_glm4_dense_at_tensor_parallel_matches_hf_on_cpu(tiny_glm4_dir, tmp_path):
    """GLM-4 dense (slime's sandwich-norm layer: norms on the attention and MLP outputs; interleaved rotary on half
    of each head; qkv bias; HF's fused gate_up_proj) at TP=2 against transformers: export bit-exact, every layer's
    hidden state, log-probs through the schedule and every gradient. Right-padded micro-batches: without
    Transformer Engine the trainer does not pack a model with interleaved rotary (``supports_packing``)."""
    result = _run(tiny_glm4_dir, tmp_path / "result.json", tp=2, padded=True)
    assert result["model_type"] == "glm4" and not result["packed"]
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []
    assert max(result["layer_max_abs"]) < 1e-5 and result["logprob_fp32_max_abs"] < 1e-4, result
    # 9 tensors a layer (the two output norms' among them) x 4, embedding, final norm, output layer
    assert result["grad_tensors"] == 39 and result["grad_max_rel"] < 1e-4, result


WORKER = HERE / "megatron_worker_check.py"


def _worker_pass(hf_dir: str, tmp_path: Path, nproc: int, *flags: str, env: dict | None = None, name: str = "") -> dict:
    import torch

    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    out = tmp_path / f"worker_{nproc}{name}.pt"
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", str(WORKER),
               "--hf-dir", hf_dir, "--save", str(tmp_path / f"ckpt_{nproc}{name}"), "--out", str(out), "--no-optimizer", *flags]
    proc = subprocess.run(command, cwd=megatron_cpu.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def test_worker_pipeline_parallel_equals_one_rank(tiny_model_dir, tmp_path):
    """The training worker's own passes on the Megatron backend (both pipeline stages given the same shard, π_old through the
    schedule and broadcast from the last stage, advantages, the training forward/backward of the
    first optimizer step, finalize_model_grads) at PP=2 give what one rank gives: the same per-sample
    log-probs, the same step metrics (ppo_kl exactly 0), the same reduced gradient of every tensor."""
    import torch

    one = _worker_pass(str(tiny_model_dir), tmp_path, 1)
    two = _worker_pass(str(tiny_model_dir), tmp_path, 2, "--pipeline-model-parallel-size", "2")
    assert len(one["log_probs"]) == 8 and sorted(one["log_probs"]) == sorted(two["log_probs"])
    for sample, values in one["log_probs"].items():
        assert values == pytest.approx(two["log_probs"][sample], abs=1e-5), sample
        # compute_log_probs called on each rank's own shard (the PPO loop does): the same values
        assert values == pytest.approx(two["direct"][sample], abs=1e-5), sample
    assert one["metrics"]["ppo_kl"] == 0.0 and two["metrics"]["ppo_kl"] == 0.0
    # colocated mode exports the weights of an offloaded trainer (from the host copies)
    assert one["offloaded_export_equal"] and two["offloaded_export_equal"]
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for key, value in one["rollout"].items():
        assert two["rollout"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(one["grads"]) == set(two["grads"]) and len(one["grads"]) > 30
    assert sum(float(g.abs().sum()) for g in one["grads"].values()) > 0
    for name, grad in one["grads"].items():
        assert torch.allclose(two["grads"][name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max())), name


def test_worker_context_parallel_equals_one_rank(tiny_model_dir, tmp_path):
    """The Megatron backend at CP=2 (both CP ranks given the same shard, each sample's chunks split
    between them, K/V gathered, the response values gathered back): the same per-sample log-probs,
    step metrics and reduced gradients as one rank."""
    import torch

    one = _worker_pass(str(tiny_model_dir), tmp_path, 1)
    two = _worker_pass(str(tiny_model_dir), tmp_path, 2, "--context-parallel-size", "2", name="cp")
    assert len(one["log_probs"]) == 8 and sorted(one["log_probs"]) == sorted(two["log_probs"])
    for sample, values in one["log_probs"].items():
        assert values == pytest.approx(two["log_probs"][sample], abs=1e-5), sample
        assert values == pytest.approx(two["direct"][sample], abs=1e-5), sample
    assert two["metrics"]["ppo_kl"] == 0.0
    assert two["offloaded_export_equal"]
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for key, value in one["rollout"].items():
        assert two["rollout"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(one["grads"]) == set(two["grads"]) and len(one["grads"]) > 30
    for name, grad in one["grads"].items():
        assert torch.allclose(two["grads"][name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max())), name


def test_worker_fused_triton_head_equals_the_torch_head(tiny_model_dir, tmp_path):
    """The trainer's log-probs and entropy through the fused Triton kernels (run by Triton's
    interpreter on the CPU; SLIME_LOGPROB_HEAD=triton fails where they cannot run) give the torch
    path's π_old log-probs, step metrics and reduced gradients, with an entropy term in the loss."""
    import torch

    flags = ("--entropy-coef", "0.01")
    torch_head = _worker_pass(str(tiny_model_dir), tmp_path, 1, *flags, env={"SLIME_LOGPROB_HEAD": "torch"}, name="torch")
    fused = _worker_pass(str(tiny_model_dir), tmp_path, 1, *flags, name="triton",
                         env={"SLIME_LOGPROB_HEAD": "triton", "TRITON_INTERPRET": "1"})
    assert len(torch_head["log_probs"]) == 8 and sorted(torch_head["log_probs"]) == sorted(fused["log_probs"])
    for sample, values in torch_head["log_probs"].items():
        assert values == pytest.approx(fused["log_probs"][sample], abs=1e-5), sample
    assert fused["metrics"]["ppo_kl"] == 0.0 and fused["metrics"]["entropy_loss"] > 1.0
    for key, value in torch_head["metrics"].items():
        assert fused["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(torch_head["grads"]) == set(fused["grads"]) and len(fused["grads"]) > 30
    for name, grad in torch_head["grads"].items():
        assert torch.allclose(fused["grads"][name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max())), name


@pytest.mark.parametrize("parallel", [("--pipeline-model-parallel-size", "2"), ("--context-parallel-size", "2")],
                         ids=["pp2", "cp2"])
def test_critic_equals_the_fsdp_critic(tiny_model_dir, tmp_path, parallel):
    """The Megatron critic (GPTModel + value head, no tied output layer) at PP=2 or CP=2 computes the same
    values V_old and the same value loss (§5.5, GAE returns) as the FSDP critic on the same weights
    and value head, and saves an HF directory with the value head the FSDP critic loads."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from slime.backends.training.worker import TrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import ensure_single_rank_group, make_samples, rank_data

    critic_dir = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, critic_dir)
    generator = torch.Generator().manual_seed(3)
    save_file({"weight": torch.randn(1, 128, generator=generator) * 0.5, "bias": torch.tensor([0.3])},
              str(critic_dir / "value_head.safetensors"))
    flags = ("--role", "critic", "--advantage-estimator", "ppo", *parallel, "--save-hf", str(tmp_path / "saved"))
    megatron = _worker_pass(str(critic_dir), tmp_path, 2, *flags)

    ensure_single_rank_group()
    from slime.arguments import parse_args

    args = parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "4",
                       "--hf-checkpoint", str(critic_dir), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                       "--global-batch-size", "4", "--seed", "0", "--advantage-estimator", "ppo"])
    data = rank_data(args, make_samples(8, seed=1, vocab=400))
    results = {}
    for name, path in (("original", critic_dir), ("saved", tmp_path / "saved")):
        args.hf_checkpoint = str(path)
        critic = TrainWorker(args, role="critic")
        critic.init()
        prepared = critic.prepare(0, data)
        sums, _, _ = critic.forward_backward(prepared, 0)
        results[name] = (prepared, float(sums["value_loss"]) / critic.step_normaliser(prepared, 0))
    prepared, value_loss = results["original"]
    assert len(megatron["log_probs"]) == 8 and len(megatron["direct"]) == 8
    for index, values in zip(prepared.sample_indices, prepared.values):
        assert megatron["log_probs"][str(index)] == pytest.approx(values.tolist(), abs=1e-4), index
        assert megatron["direct"][str(index)] == pytest.approx(values.tolist(), abs=1e-4), index  # the loop's call
    assert megatron["metrics"]["value_loss"] == pytest.approx(value_loss, rel=1e-5)
    # the HF directory the Megatron critic wrote (bf16 backbone, fp32 head) gives the FSDP critic nearly the same values
    saved, saved_loss = results["saved"]
    for a, b in zip(saved.values, prepared.values):
        assert a.tolist() == pytest.approx(b.tolist(), abs=0.1)
    assert saved_loss == pytest.approx(value_loss, rel=0.05)


@pytest.mark.parametrize("flag", ["--use-routing-replay", "--use-rollout-routing-replay"], ids=["R2", "R3"])
def test_routing_replay_uses_the_recorded_or_engine_experts(tiny_moe_dir, tmp_path, flag):
    """After the π_old pass the routers are perturbed so that their own top-k picks other experts
    for many tokens; the training forward still uses, call by call, the experts the π_old pass
    recorded (R2) or the engine reported per token (R3, also in the π_old pass)."""
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    out = tmp_path / "routing.json"
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone", str(WORKER),
               "--hf-dir", tiny_moe_dir, "--save", str(tmp_path / "ckpt"), "--out", str(out), "--routing-check", flag]
    proc = subprocess.run(command, cwd=megatron_cpu.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    # 2 MoE layers x 8 micro-batches of one sample (π_old), x 4 in the first optimizer step
    assert result["old_pass_calls"] == 16 and result["train_calls"] == 8, result
    assert result["train_actions"] == ["RouterReplayAction.REPLAY_FORWARD"], result
    expected_old = "RouterReplayAction.RECORD" if flag == "--use-routing-replay" else "RouterReplayAction.REPLAY_FORWARD"
    assert result["old_pass_actions"] == [expected_old], result
    assert result["old_pass_matches"] and result["train_matches"], result
    assert result["train_own_choice_differs"] > 10, result


def test_moe_at_tp2_without_sequence_parallel_is_refused_by_name(tiny_moe_dir, tmp_path):
    """Megatron-Core refuses MoE training at TP > 1 without sequence parallelism only at the first
    forward; the worker says so at start-up, naming the flags."""
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(WORKER),
               "--hf-dir", tiny_moe_dir, "--save", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out.pt"), "--no-optimizer",
               "--tensor-model-parallel-size", "2"]
    proc = subprocess.run(command, cwd=megatron_cpu.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--tensor-model-parallel-size 2 on an MoE model" in proc.stderr and "--sequence-parallel" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_rollout_routing_replay_on_the_sigmoid_moe_families(arch, request, tmp_path):
    """R3 with DeepSeek-V3's router (sigmoid scores, expert bias, group-limited top-k; MLA
    micro-batches padded) and GLM-4.5's (the same sigmoid router over one group; packed micro-batches)
    through the Megatron training worker: after the routers are perturbed, both the π_old pass and the
    training forward use the engine's experts, call by call, in all 3 MoE layers."""
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    model_dir = request.getfixturevalue({"deepseek_v3": "tiny_deepseek_v3_dir", "glm4_moe": "tiny_glm4_moe_dir"}[arch])
    out = tmp_path / "routing.json"
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone", str(WORKER),
               "--hf-dir", model_dir, "--save", str(tmp_path / "ckpt"), "--out", str(out), "--routing-check",
               "--use-rollout-routing-replay"]
    proc = subprocess.run(command, cwd=megatron_cpu.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["old_pass_calls"] == 24 and result["train_calls"] == 12, result  # 3 MoE layers
    assert result["old_pass_actions"] == result["train_actions"] == ["RouterReplayAction.REPLAY_FORWARD"], result
    assert result["old_pass_matches"] and result["train_matches"] and result["train_own_choice_differs"] > 0, result


def test_megatron_hooks_are_called_with_their_documented_arguments(tiny_model_dir, tmp_path):
    """--custom-model-provider-path builds the trained and the reference model, --custom-megatron-init-path
    runs once per rank at the end of initialisation, --custom-megatron-before-log-prob-hook-path before each
    forward-only log-prob pass (store prefix "" for π_old, "ref_" for the reference) with the provider's model."""
    import json

    log = tmp_path / "hooks.jsonl"
    result = _worker_pass(str(tiny_model_dir), tmp_path, 1, "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", str(tiny_model_dir),
                          "--custom-model-provider-path", "megatron_hooks.provider",
                          "--custom-megatron-init-path", "megatron_hooks.init",
                          "--custom-megatron-before-log-prob-hook-path", "megatron_hooks.before_log_prob",
                          env={"SLIME_TEST_HOOK_LOG": str(log)}, name="hooks")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    hooks = [c["hook"] for c in calls]
    # actor, then reference, each one pipeline stage holding the embedding and the head
    assert [c for c in calls if c["hook"] == "provider"] == [{"rank": 0, "hook": "provider", "pre_process": True,
                                                              "post_process": True}] * 2
    assert hooks.count("init") == 1 and hooks.index("init") > max(i for i, h in enumerate(hooks) if h == "provider")
    assert [c for c in calls if c["hook"] == "init"][0]["hf_checkpoint"] == str(tiny_model_dir)
    passes = [(c["store_prefix"], c["provider_model"]) for c in calls if c["hook"] == "before_log_prob"]
    assert ("", True) in passes and ("ref_", True) in passes
    assert len(result["log_probs"]) == 8  # the run went on with the provider's model
