"""GPU tests of the Megatron backend (marked ``gpu``; skipped without CUDA or Megatron-Core).

Runbook (the lent H200 machine, DEVICE.md):
  1. wheels to carry — Megatron-Core imports nothing beyond torch / numpy / packaging (all present
     there) except ``triton``, which the CUDA torch wheel already brings:
         ../shared/tools/device-wheels megatron-core==0.19.2
     (add ``ray==2.60.0 jsonschema referencing rpds-py jsonschema-specifications smg==1.13.0
     fastapi uvicorn starlette pydantic pydantic-core annotated-types typing-inspection`` for the
     GRPO loop test);
  2. on the machine: ``export PYTHONPATH=/tmp/site:$PWD`` and
         python -m pytest -q -m gpu tests/backends/megatron_utils/test_megatron_gpu.py
     On the two-GPU kind the TP=2 / PP=2 / EP=2 cases run too (``NCCL_NVLS_ENABLE=0`` is set here).

What each test shows: Megatron log-probs of a Qwen3-0.6B-architecture model (fewer layers, random
weights with a large enough spread that a wrong QKV order or RoPE would show) and of a small
Qwen3-MoE equal the HF model's within bf16 tolerance; HF -> Megatron -> HF export is bit-exact.
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


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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

    # Qwen3-0.6B widths (hidden 1024, 16 heads, 8 KV heads, head_dim 128, ffn 3072, vocab 151936), 4 layers
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)
    return _save(Qwen3ForCausalLM(config), tmp_path_factory.mktemp("qwen3_dense"))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=1000000,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, mlp_only_layers=[0], max_position_embeddings=4096)
    return _save(Qwen3MoeForCausalLM(config), tmp_path_factory.mktemp("qwen3_moe"))


def _run(hf_dir: str, tmp_path, tp=1, pp=1, ep=1) -> dict:
    pytest.importorskip("megatron.core")
    if _gpus() < tp * pp * ep:
        pytest.skip(f"needs {tp * pp * ep} GPUs")
    out = tmp_path / f"result_tp{tp}_pp{pp}_ep{ep}.json"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp * ep), "--standalone",
               str(CHECK), "--hf-dir", hf_dir, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result


def _assert_roundtrip(result: dict) -> None:
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []


def _assert_logprobs(result: dict) -> None:
    # fp32 on both sides: the same network up to float rounding (a wrong head order, RoPE or router
    # would be off by nats: the log-probs spread over several nats)
    assert result["logprob_std"] > 1.0, result
    assert result["logprob_fp32_max_abs"] < 2e-3, result
    # bf16 autocast on both sides: within bf16 noise, no more than HF's own bf16-vs-fp32 drift allows
    assert result["logprob_mean_abs"] < max(0.06, 3 * result["hf_bf16_vs_fp32_mean_abs"]), result
    assert result["logprob_max_abs"] < 0.5, result


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_dense_logprobs_and_roundtrip(qwen3_dense, tmp_path, tp):
    result = _run(qwen3_dense, tmp_path, tp=tp)
    _assert_roundtrip(result)
    _assert_logprobs(result)


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2)])
def test_qwen3_moe_logprobs_and_roundtrip(qwen3_moe, tmp_path, tp, ep):
    result = _run(qwen3_moe, tmp_path, tp=tp, ep=ep)
    _assert_roundtrip(result)
    _assert_logprobs(result)


@pytest.mark.parametrize("hf", ["qwen3_dense", "qwen3_moe"])
def test_pipeline_parallel_roundtrip(hf, request, tmp_path):
    _assert_roundtrip(_run(request.getfixturevalue(hf), tmp_path, pp=2))


# --------------------------------------------------------------------------- the trainer and the tools

WORKER = Path(__file__).with_name("megatron_worker_check.py")


def _torchrun(script: Path, nproc: int, *argv: str, timeout: int = 900) -> None:
    pytest.importorskip("megatron.core")
    if _gpus() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", str(script), *argv]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0))


@pytest.mark.parametrize("nproc,flags", [(1, ()), (2, ()), (2, ("--tensor-model-parallel-size", "2")),
                                         (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel"))],
                         ids=["dp1", "dp2", "tp2", "tp2-sp"])
def test_grpo_steps_ppo_kl_zero_and_exact_resume(tiny_dir, tmp_path, nproc, flags):
    """Two rollout steps (2 optimizer steps each): ppo_kl is exactly 0 at each rollout's first step;
    offload/onload between them and a resume from the saved checkpoint give the same rollout 1."""
    save = tmp_path / "ckpt"
    first, resumed = tmp_path / "first.json", tmp_path / "resumed.json"
    _torchrun(WORKER, nproc, "--hf-dir", tiny_dir, "--save", str(save), "--out", str(first), "--offload", *flags)
    _torchrun(WORKER, nproc, "--hf-dir", tiny_dir, "--save", str(save), "--out", str(resumed), "--resume", *flags)
    a, b = json.loads(first.read_text()), json.loads(resumed.read_text())
    print(json.dumps({k: v for k, v in a.items() if k != "weights"}), json.dumps({k: v for k, v in b.items() if k != "weights"}))
    assert a["start"] is None and b["start"] == 1
    assert len(a["rollout0_ppo_kl"]) == 2 and a["rollout0_ppo_kl"][0] == 0.0 and a["rollout1_ppo_kl"][0] == 0.0
    assert a["rollout0_ppo_kl"][1] != 0.0  # the second step sees updated weights
    assert a["offload_freed_bytes"] > 0
    assert b["rollout1"] == a["rollout1"]
    assert b["weights"] == a["weights"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "0"


def test_conversion_tools_round_trip(tiny_dir, tmp_path):
    """tools/convert_hf_to_torch_dist.py then tools/convert_torch_dist_to_hf.py gives back the same tensors."""
    from safetensors.torch import load_file

    dist_dir, back = tmp_path / "dist", tmp_path / "back"
    _torchrun(ROOT / "tools" / "convert_hf_to_torch_dist.py", 1, "--hf-checkpoint", tiny_dir, "--save", str(dist_dir))
    assert (dist_dir / "latest_checkpointed_iteration.txt").read_text() == "0"
    _torchrun(ROOT / "tools" / "convert_torch_dist_to_hf.py", 1, "--input-dir", str(dist_dir), "--output-dir", str(back),
              "--origin-hf-dir", tiny_dir)
    original, converted = load_file(os.path.join(tiny_dir, "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(converted) == set(original) - {"lm_head.weight"} or set(converted) == set(original)
    for name, tensor in converted.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
