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
    # bf16 autocast on both sides; the same math in a different kernel order
    assert result["logprob_max_abs"] < 0.25 and result["logprob_mean_abs"] < 0.03, result


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
