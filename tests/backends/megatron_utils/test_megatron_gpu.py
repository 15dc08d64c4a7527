"""GPU tests of the Megatron backend (marked ``gpu``; skipped without CUDA or Megatron-Core).

Runbook — on the two-GPU kind (``nvidia-h200-x2``), TWO calls: ``-k 1gpu`` (7 checks, 4 min 46 s on
2026-11-30) and ``-k 2gpu`` (12 checks: 7 min 24 s, plus 2 min 26 s for the three CP=2 ones, ``-k cp2``);
torchrun launches of ~15-60 s each. The DeepSeek-V3 / GLM-4.5 parity checks (added 2026-12-01, not yet
run on a GPU) go in a third call, ``-k "deepseek or glm4"`` (one 1-GPU, three 2-GPU checks); exclude
them from the other two with ``-k "1gpu and not deepseek"`` / ``-k "2gpu and not deepseek and not glm4"``. Each
prints one summary line per check at the end (also written to ``$OUT/megatron_gpu_summary.txt``):

  1. wheels: ``megatron-core==0.19.2`` only (it imports nothing else the machine lacks; triton
     comes with the CUDA torch wheel; bench/GPU_RUNBOOK.md).
     No Ray, router or server packages for this file (test_megatron_loop_gpu.py needs them);
  2. each call (limit 600 s), with ``-k 1gpu`` or ``-k 2gpu``:
         export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
         timeout 560 python -m pytest -q -m gpu -p no:cacheprovider tests/backends/megatron_utils/test_megatron_gpu.py -k 1gpu 2>&1 | tail -80
     ``-k 1gpu`` keeps the single-GPU checks (the one-GPU kind is enough for them; on the pair they
     can share the call with the loop test on the other GPU, ``CUDA_VISIBLE_DEVICES=0`` / ``1``),
     ``-k 2gpu`` the two-GPU ones (TP=2, PP=2, EP=2, DP=2, the critic at PP=2, PP=2 vs one GPU).
     A failing torchrun also puts its error lines in the summary.
  3. optional, same machine: the MFU next to FSDP2's on the same workload (one GPU each)
         torchrun --nproc-per-node 1 bench/megatron_train_step.py --model qwen3-0.6b --out $OUT
         python bench/train_step.py --model qwen3-0.6b --max-tokens-per-gpu 16384 --num-samples 224 --group-size 8
     and the GRPO loop through Ray (test_megatron_loop_gpu.py: add ``ray==2.60.0 jsonschema
     referencing rpds-py jsonschema-specifications smg==1.13.0 setproctitle fastapi uvicorn starlette pydantic
     pydantic-core annotated-types typing-inspection`` to the wheels; colocated 2 min 12 s,
     disaggregated 1 min 48 s on 2026-11-30).

Expected: every line passes; parity fp32 log-prob differences ~1e-5..1e-3 nats, gradients within
1e-3 relative (MoE 2e-2: a near-tie router flip), bf16 log-prob mean differences of the order of
HF's own bf16-vs-fp32 drift; ppo_kl lists starting with 0.0; resume "equal True True".

What each check shows (``MEGATRON <check>: ...`` lines):

* ``parity[...]`` — a Qwen3-0.6B-architecture model (4 layers, random weights with a spread large
  enough that a wrong QKV order, RoPE or norm shows; vocabulary 151936, padded at TP=2) and a small
  Qwen3-MoE: HF -> Megatron -> HF export bit-exact; Megatron's log-probs through the trainer's
  pipeline schedule equal HF's in fp32 (to float rounding) and within bf16 noise under autocast;
  the trainer's reduced gradients (DDP + ``finalize_model_grads``) equal HF's in fp32. The line
  carries each decoder layer's hidden-state difference and the worst gradient tensors, so a
  failing layout is named by one run.
* ``worker[...]`` — the training worker on the Megatron backend, tiny model: two GRPO rollout steps (two optimizer
  steps each), ``ppo_kl`` exactly 0 at each rollout's first step, offload/onload, save, and a
  resume from the checkpoint that reproduces rollout 1's metrics and weights exactly; the same for
  the PPO critic (value head included in the checkpoint and the weights compared).
* ``pp2-vs-1gpu`` / ``cp2-vs-1gpu`` — rollout 0 at PP=2 / CP=2 equals the one-GPU run within bf16 tolerance.
* ``routing-replay[...]`` — MoE routing replay (R2: recorded in the π_old pass; R3: the engine's
  per-token experts) is what the training forward uses after the routers were perturbed.
* ``conversion-tools`` — tools/convert_hf_to_torch_dist.py then convert_torch_dist_to_hf.py give
  back the same tensors.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[3]
CHECK = Path(__file__).with_name("megatron_parity_check.py")
WORKER = Path(__file__).with_name("megatron_worker_check.py")
SUMMARY: list[str] = []
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if SUMMARY:
        sys.__stdout__.write("\n==== Megatron GPU summary ====\n" + "\n".join(SUMMARY) + "\n")


def _report(line: str) -> None:
    """One summary line; appended to $OUT/megatron_gpu_summary.txt at once, so a run cut short by a
    time limit still brings back the lines of the checks that finished."""
    SUMMARY.append("MEGATRON " + line)
    print("MEGATRON " + line)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"], "megatron_gpu_summary.txt"), "a") as f:
            f.write("MEGATRON " + line + "\n")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torchrun(script: Path, nproc: int, *argv: str, timeout: int = 600) -> None:
    pytest.importorskip("megatron.core")
    if _gpus() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", str(script), *argv]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        _report(f"{script.name} {' '.join(argv[-6:])}: FAILED rc={proc.returncode}: "
                + " | ".join(line for line in proc.stderr.splitlines()[-400:] if "Error" in line)[-600:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def _save(model, path: Path) -> str:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)  # not all ones, so a swapped norm would show
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_dense(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3-0.6B widths (hidden 1024, 16 heads, 8 KV heads, head_dim 128, ffn 3072, vocab 151936), 4 layers;
    # 151936 is a multiple of 128 but not of 256: padded only at TP=2
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)
    return _save(Qwen3ForCausalLM(config), tmp_path_factory.mktemp("qwen3_dense"))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=4000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=1000000,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, mlp_only_layers=[0], max_position_embeddings=4096)
    return _save(Qwen3MoeForCausalLM(config), tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """DeepSeek-V3 architecture at small widths: MLA (q/kv LoRA, YaRN), 8 experts top-2 of 2 groups keep 1,
    a shared expert, the first layer dense."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=4000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
                              kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=4096,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    return _save(DeepseekV3ForCausalLM(config), tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=4000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                           max_position_embeddings=4096,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
    return _save(Glm4MoeForCausalLM(config), tmp_path_factory.mktemp("glm4_moe"))


PARITY = [("1gpu-dense-tp1", "qwen3_dense", 1, 1, 1), ("1gpu-dense-tp1-padded", "qwen3_dense", 1, 1, 1),
          ("2gpu-dense-tp2", "qwen3_dense", 2, 1, 1),
          ("2gpu-dense-pp2", "qwen3_dense", 1, 2, 1), ("1gpu-moe", "qwen3_moe", 1, 1, 1),
          ("2gpu-moe-ep2", "qwen3_moe", 1, 1, 2), ("2gpu-moe-pp2", "qwen3_moe", 1, 2, 1),
          ("2gpu-dense-cp2", "qwen3_dense", 1, 1, 1),  # context parallel: CP=2 from the case name
          ("1gpu-deepseek-v3", "deepseek_v3", 1, 1, 1), ("2gpu-deepseek-v3-ep2", "deepseek_v3", 1, 1, 2),
          ("2gpu-deepseek-v3-pp2", "deepseek_v3", 1, 2, 1), ("2gpu-glm4-moe-ep2", "glm4_moe", 1, 1, 2)]
# (DeepSeek-V3's MLA runs padded micro-batches: without TE its core attention is slime's LatentCoreAttention)
# (an MoE at TP=2 needs sequence parallelism, hence Transformer Engine: refused on the lent machine;
# the MoE at PP=2 runs only here: on the CPU MoE models use fixed sequence lengths)


@pytest.mark.parametrize("case,hf,tp,pp,ep", PARITY, ids=[p[0] for p in PARITY])
def test_parity_with_hf(request, tmp_path, case, hf, tp, pp, ep):
    out = tmp_path / "result.json"
    cp = 2 if case.endswith("-cp2") else 1
    _torchrun(CHECK, tp * pp * ep * cp, "--hf-dir", request.getfixturevalue(hf), "--tp", str(tp), "--pp", str(pp),
              "--ep", str(ep), "--cp", str(cp), "--out", str(out), *(["--padded"] if case.endswith("-padded") else []))
    r = json.loads(out.read_text())
    bad = len(r["roundtrip_mismatches"]) + len(r["roundtrip_missing"]) + len(r["roundtrip_extra"])
    _report(f"parity[{case}]: {'thd' if r['packed'] else 'padded'} vocab {r['vocab_size']}->{r['padded_vocab_size']} roundtrip_bad={bad} "
            f"fp32 lp max {r['logprob_fp32_max_abs']:.2e} mean {r['logprob_fp32_mean_abs']:.1e} (std {r['logprob_std']:.2f}) | "
            f"bf16 lp max {r['logprob_max_abs']:.3f} mean {r['logprob_mean_abs']:.4f} (HF bf16 drift {r['hf_bf16_vs_fp32_mean_abs']:.4f} "
            f"max {r['hf_bf16_vs_fp32_max_abs']:.3f}; Megatron bf16 vs HF fp32 max {r['logprob_vs_fp32_max_abs']:.3f}) | "
            f"grad rel {r['grad_max_rel']:.1e} worst {r['grad_worst'][:2]} | layers {[f'{x:.1e}' for x in r.get('layer_max_abs', [])]} "
            f"logits {r.get('logits_max_abs', float('nan')):.1e} | output-layer rows {r['output_layer_rows']}")
    assert bad == 0, r
    # the trainer's path is packed (varlen flash attention without Transformer Engine) unless asked to pad
    assert r["packed"] == (not case.endswith("-padded") and hf != "deepseek_v3"), r
    if cp == 1:
        assert r["output_layer_rows"] == 50, r  # the LM head ran on the first micro-batch's 20 + 30 response rows only
    else:  # each CP rank ran it on its own share of those rows
        assert 0 < r["output_layer_rows"] < 50, r
    assert r["logprob_std"] > 1.0, r  # the log-probs spread over nats: a wrong layout would be far off
    assert r["logprob_fp32_max_abs"] < 2e-3, r
    assert r["logprob_mean_abs"] < max(0.06, 3 * r["hf_bf16_vs_fp32_mean_abs"]), r
    if hf == "qwen3_dense":
        assert r["logprob_max_abs"] < 0.5, r
    else:  # a router near-tie flips between any two bf16 runs: no further from fp32 than HF's own bf16
        assert r["logprob_vs_fp32_max_abs"] < max(0.5, 2 * r["hf_bf16_vs_fp32_max_abs"]), r
    # fp32 gradients; an MoE router decision that flips on a near-tie moves a few expert gradients
    assert r["grad_max_rel"] < (1e-3 if hf == "qwen3_dense" else 2e-2), r


# --------------------------------------------------------------------------- the trainer and the tools

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0))


WORKER_CASES = {"1gpu-dp1": (1, ()), "2gpu-dp2": (2, ()),
                # sequence parallelism needs Transformer Engine's (or Apex's) norms, absent on the lent machine
                "2gpu-tp2": (2, ("--tensor-model-parallel-size", "2")),
                "2gpu-pp2": (2, ("--pipeline-model-parallel-size", "2")),
                "2gpu-cp2": (2, ("--context-parallel-size", "2")),
                "2gpu-critic-pp2": (2, ("--role", "critic", "--advantage-estimator", "ppo", "--pipeline-model-parallel-size", "2"))}
_WORKER_RESULTS: dict = {}


def _worker_runs(case: str, tiny_dir: str, root: Path) -> tuple[dict, dict]:
    """(first run, resumed run) of a worker case; cached so the PP comparison reuses them."""
    if case not in _WORKER_RESULTS:
        nproc, flags = WORKER_CASES[case]
        save, first, resumed = root / case / "ckpt", root / case / "first.json", root / case / "resumed.json"
        save.parent.mkdir(parents=True, exist_ok=True)
        _torchrun(WORKER, nproc, "--hf-dir", tiny_dir, "--save", str(save), "--out", str(first), "--offload", *flags)
        _torchrun(WORKER, nproc, "--hf-dir", tiny_dir, "--save", str(save), "--out", str(resumed), "--resume", *flags)
        a, b = json.loads(first.read_text()), json.loads(resumed.read_text())
        ckpt_dir = save / "critic" if "--role" in flags else save  # the critic saves under <save>/critic
        a["latest"] = (ckpt_dir / "latest_checkpointed_iteration.txt").read_text()
        _WORKER_RESULTS[case] = (a, b)
    return _WORKER_RESULTS[case]


@pytest.fixture(scope="module")
def worker_root(tmp_path_factory):
    return tmp_path_factory.mktemp("worker")


@pytest.mark.parametrize("case", list(WORKER_CASES))
def test_grpo_steps_ppo_kl_zero_and_exact_resume(tiny_dir, worker_root, case):
    """Two rollout steps (2 optimizer steps each): ppo_kl is exactly 0 at each rollout's first step;
    offload/onload between them and a resume from the saved checkpoint give the same rollout 1."""
    a, b = _worker_runs(case, tiny_dir, worker_root)
    same_weights = b["weights"] == a["weights"]
    critic = "critic" in case
    loss_key = "train/critic-value_loss" if critic else "train/loss"
    _report(f"worker[{case}]: ppo_kl r0 {a['rollout0_ppo_kl']} r1 {a['rollout1_ppo_kl']} | start {a['start']}->{b['start']} | "
            f"resume metrics equal {b['rollout1'] == a['rollout1']} weights equal {same_weights} | "
            f"offload freed {a.get('offload_freed_bytes', 0) / 2**20:.1f} MiB | {loss_key} r0 {a['rollout0'].get(loss_key)} "
            f"r1 {a['rollout1'].get(loss_key)}")
    assert a["start"] is None and b["start"] == 1
    if critic:  # no ppo_kl on the critic; its value loss is a positive number each rollout
        assert a["rollout0"][loss_key] > 0 and a["rollout1"][loss_key] > 0
    else:
        assert len(a["rollout0_ppo_kl"]) == 2 and a["rollout0_ppo_kl"][0] == 0.0 and a["rollout1_ppo_kl"][0] == 0.0
        assert a["rollout0_ppo_kl"][1] != 0.0  # the second step sees updated weights
    assert a["offload_freed_bytes"] > 0
    assert b["weights_before_rollout1"] == a["weights_before_rollout1"]
    sums = [r["optimizer_before_rollout1"] for r in (a, b)]  # Adam moments and step counts, per inner optimizer
    assert [{k: v for k, v in s.items() if k.endswith("_state_sums")} for s in sums][0] == \
        [{k: v for k, v in s.items() if k.endswith("_state_sums")} for s in sums][1], sums
    assert b["rollout1"] == a["rollout1"]
    assert same_weights
    assert a["latest"] == "0"


@pytest.mark.parametrize("case", ["2gpu-pp2", "2gpu-cp2"])
def test_2gpu_model_parallel_train_step_equals_one_gpu(tiny_dir, worker_root, case):
    """Rollout 0 at PP=2 (schedule 1F1B, stages on two GPUs) or CP=2 (each sample's chunks on two
    GPUs) vs one GPU: the same samples, so the same metrics up to bf16 rounding (the shared shard, the
    schedule, the loss scaling and the gradient reductions are all on the path)."""
    one, _ = _worker_runs("1gpu-dp1", tiny_dir, worker_root)
    two, _ = _worker_runs(case, tiny_dir, worker_root)
    keys = ["rollout/log_probs", "rollout/advantages", "train/entropy_loss", "train/pg_loss", "train/grad_norm", "train/ppo_kl"]
    diffs = {k: (one["rollout0"][k], two["rollout0"][k]) for k in keys}
    _report(f"{case[5:]}-vs-1gpu: " + ", ".join(f"{k} {x:.5g}/{y:.5g}" for k, (x, y) in diffs.items()))
    for key in ("rollout/log_probs", "train/entropy_loss"):
        x, y = diffs[key]
        assert y == pytest.approx(x, rel=2e-2), key
    x, y = diffs["train/grad_norm"]
    assert y == pytest.approx(x, rel=5e-2)
    x, y = diffs["train/pg_loss"]
    assert abs(x - y) < 2e-2 * max(1.0, abs(x))


@pytest.mark.parametrize("flag", ["--use-routing-replay", "--use-rollout-routing-replay"], ids=["1gpu-R2", "1gpu-R3"])
def test_routing_replay(qwen3_moe, tmp_path, flag):
    """MoE routing replay on the GPU (alltoall dispatcher): after the routers are perturbed, the
    training forward still uses the experts of the π_old pass (R2) or of the engine (R3)."""
    from slime.utils.tiny_model import build_tokenizer

    build_tokenizer(1024).save_pretrained(qwen3_moe)
    out = tmp_path / "routing.json"
    _torchrun(WORKER, 1, "--hf-dir", qwen3_moe, "--save", str(tmp_path / "ckpt"), "--out", str(out), "--routing-check", flag)
    r = json.loads(out.read_text())
    _report(f"routing-replay[{flag}]: calls {r['old_pass_calls']}+{r['train_calls']} actions {r['old_pass_actions']}/"
            f"{r['train_actions']} old-pass ok {r['old_pass_matches']} train ok {r['train_matches']} "
            f"(own top-k would differ on {r['train_own_choice_differs']} tokens)")
    assert r["old_pass_matches"] and r["train_matches"] and r["train_own_choice_differs"] > 0, r


def test_1gpu_conversion_tools_round_trip(tiny_dir, tmp_path):
    """tools/convert_hf_to_torch_dist.py then tools/convert_torch_dist_to_hf.py gives back the same tensors."""
    from safetensors.torch import load_file

    dist_dir, back = tmp_path / "dist", tmp_path / "back"
    _torchrun(ROOT / "tools" / "convert_hf_to_torch_dist.py", 1, "--hf-checkpoint", tiny_dir, "--save", str(dist_dir))
    assert (dist_dir / "latest_checkpointed_iteration.txt").read_text() == "0"
    _torchrun(ROOT / "tools" / "convert_torch_dist_to_hf.py", 1, "--input-dir", str(dist_dir), "--output-dir", str(back),
              "--origin-hf-dir", tiny_dir)
    original, converted = load_file(os.path.join(tiny_dir, "model.safetensors")), load_file(str(back / "model.safetensors"))
    same = [name for name, tensor in converted.items()
            if tensor.dtype == original[name].dtype and torch.equal(tensor, original[name])]
    _report(f"conversion-tools: {len(same)}/{len(converted)} tensors identical")
    assert set(converted) == set(original) - {"lm_head.weight"} or set(converted) == set(original)
    assert len(same) == len(converted)
