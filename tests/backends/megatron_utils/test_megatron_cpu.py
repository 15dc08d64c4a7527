"""The Megatron backend's model path on the CPU: real Megatron-Core (gloo, see megatron_cpu.py) vs HF.

Tensor parallelism (2 ranks) and pipeline parallelism (2 stages, Megatron's 1F1B schedule) on the
tiny Qwen3 (vocabulary 591, padded to 768 / 640): HF -> Megatron -> HF export bit-exact, each
decoder layer's hidden state, the response log-probs through the trainer's schedule, and the
gradients after Megatron DDP + ``finalize_model_grads`` equal HF's to float32 rounding.
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


def _run(hf_dir: str, out: Path, tp: int = 1, pp: int = 1) -> dict:
    path = megatron_cpu.pythonpath()
    if path is None:
        pytest.skip("Megatron-Core's code is not unpacked in .venv/megatron-core (bash scripts/setup-env.sh does it)")
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp), "--standalone", str(CHECK),
               "--hf-dir", hf_dir, "--tp", str(tp), "--pp", str(pp), "--out", str(out)]
    proc = subprocess.run(command, cwd=megatron_cpu.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_megatron_matches_hf_on_cpu(tiny_model_dir, tmp_path, tp, pp):
    result = _run(str(tiny_model_dir), tmp_path / "result.json", tp=tp, pp=pp)
    assert result["padded_vocab_size"] > result["vocab_size"]  # the padding is there, and must not count
    assert result["roundtrip_mismatches"] == [] and result["roundtrip_missing"] == [] and result["roundtrip_extra"] == []
    assert len(result["layer_max_abs"]) == 3 and max(result["layer_max_abs"]) < 1e-5, result
    assert result["logits_max_abs"] < 1e-4 and result["padding_logits_max_abs"] == 0.0, result
    assert result["num_tokens"] == 96 and result["logprob_fp32_max_abs"] < 1e-4, result
    # every parameter shard's gradient, incl. the qk-layernorm weights TP ranks share and the tied
    # embedding both end stages hold
    assert result["grad_tensors"] >= 34 and result["grad_max_rel"] < 1e-4, result
