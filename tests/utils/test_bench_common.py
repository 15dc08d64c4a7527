"""bench/common.py: the card a result was measured on names its file and its roofline (DEVICE.md's results format)."""

from __future__ import annotations

import pytest
import torch

from bench import common


@pytest.mark.parametrize("name,peak,of", [
    ("NVIDIA H200", 4.8e12, "NVIDIA H200"),
    ("NVIDIA H100 80GB HBM3", 3.35e12, "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H100 PCIe", 2.0e12, "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", 3.9e12, "NVIDIA H100 NVL"),
    ("NVIDIA GH200 480GB", 4.8e12, "H200 (assumed; this is NVIDIA GH200 480GB)"),
    ("NVIDIA A100-SXM4-80GB", 4.8e12, "H200 (assumed; this is NVIDIA A100-SXM4-80GB)")])
def test_hbm_peak_is_the_cards_own_spec_or_named_as_assumed(name, peak, of):
    assert common.hbm_peak(name) == (peak, of)


@pytest.mark.parametrize("name,count,machine", [("NVIDIA H200", 1, "nvidia-h200"), ("NVIDIA H200", 2, "nvidia-h200-x2"),
                                                ("NVIDIA H100 80GB HBM3", 1, "nvidia-h100"),
                                                ("NVIDIA H100 80GB HBM3", 4, "nvidia-h100-x4"),
                                                ("NVIDIA GH200 480GB", 1, "NVIDIA GH200 480GB")])
def test_machine_name_and_roofline_follow_the_gpu(monkeypatch, name, count, machine):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    assert common.machine_name() == machine
    assert common.hbm_peak() == common.hbm_peak(name)


def test_without_a_gpu_the_roofline_is_named_as_assumed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.hbm_peak() == (4.8e12, "H200 (assumed; this is no GPU)")
    assert common.machine_name().startswith("cpu-")


def _decode_config(**changes):
    config = {"model": "/ckpt/Qwen3-4B", "batch": 128, "position": 143, "quantization": None, "fp8_gemm_backend": None,
              "kv_cache_dtype": "torch.bfloat16", "without": [], "with": [], "steps": 100, "sample": "none"}
    return {**config, **changes}


def test_a_rerun_of_the_same_variant_replaces_the_file_and_a_flag_makes_a_new_one():
    name = common.result_name("decode_step", "nvidia-h200", _decode_config())
    assert name == "decode_step-nvidia-h200-qwen3-4b-bf16-b128-p143"
    assert common.result_name("decode_step", "nvidia-h200", _decode_config(steps=50)) == name  # how long it ran: same file
    variants = {common.result_name("decode_step", "nvidia-h200", _decode_config(**changes)) for changes in (
        {"quantization": "w8a8_fp8", "fp8_gemm_backend": "cublas"}, {"quantization": "w8a8_fp8"},
        {"kv_cache_dtype": "torch.float8_e4m3fn"}, {"without": ["down_hand_off"]}, {"batch": 16})}
    assert len(variants) == 5 and name not in variants
    assert "w8a8_fp8-cublas" in common.result_name("decode_step", "nvidia-h200",
                                                   _decode_config(quantization="w8a8_fp8", fp8_gemm_backend="cublas"))


def test_write_result_names_the_file_by_model_and_variant(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "machine_name", lambda: "nvidia-h100")
    config = {"model": "qwen3-0.6b", "num_requests": 32, "prompt_len": 16, "output_len": 256, "quantization": "fp8",
              "fp8_gemm_backend": "auto", "kv_cache_dtype": "bfloat16", "logprob_gap_requests": 32}
    common.write_result("engine_decode", config, {"tokens_per_s": 1.0}, str(tmp_path), echo=False)
    assert [p.name for p in tmp_path.iterdir()] == ["engine_decode-nvidia-h100-qwen3-0.6b-fp8-b32-logprob-gap.json"]


def test_results_files_are_named_by_what_they_measure_not_when():
    import json
    import pathlib
    import re

    results = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"
    for path in sorted(results.glob("*.json")):
        result = json.loads(path.read_text())
        assert path.name.startswith(f"{result['benchmark']}-{result['machine']}-".replace("NVIDIA H100 80GB HBM3", "nvidia-h100")) \
            or result["machine"].startswith("NVIDIA"), path.name
        assert not re.search(r"-20\d{6}|-s\d{2}[a-z]?\b|-run\d|-[0-9a-f]{7,}\b", path.stem), path.name
        assert result.get("date") and result.get("git_commit") and result.get("command"), path.name


@pytest.mark.parametrize("benchmark,config,name", [
    ("weight_sync", {"runs": ["qwen3-0.6b/tensor", "qwen3-1.7b/distributed"], "bucket_mb": [4096, 1024]},
     "weight_sync-m-qwen3-pipelined"),
    ("logprob_head", {"rows": 16384, "hidden": 1024, "vocab": 151936}, "logprob_head-m-head1024x151936"),
    ("delta_sync", {"models": {"qwen3-0.5b": {"lr": 5e-7}}}, "delta_sync-m-qwen3-0.5b-lr5e-07"),
    ("e2e_grpo", {"model": "qwen3-0.6b", "prompts": 16, "n_samples_per_prompt": 8, "max_new_tokens": 256,
                  "side": "slime", "slime_extra": ["--sglang-quantization", "fp8", "--use-tis"]},
     "e2e_grpo-m-qwen3-0.6b-128x256-slime-only-fp8-tis"),
    ("spec_decode", {"model": "/ckpt/qwen3-0.6b", "num_requests": 64, "engines": ["off", "ngram", "ngram-adaptive"]},
     "spec_decode-m-qwen3-0.6b-b64-ngram-adaptive"),
    ("engine_decode", {"model": "qwen3-0.6b architecture, random bf16 weights", "num_requests": 128, "prompt_len": 256,
                       "output_len": 512, "quantization": None, "kv_cache_dtype": "bfloat16"},
     "engine_decode-m-qwen3-0.6b-bf16-256in-512out"),
    ("engine_decode", {"model": "qwen3-vl-2b architecture, random bf16 weights", "num_requests": 64, "prompt_len": 64,
                       "output_len": 128, "quantization": None, "kv_cache_dtype": "bfloat16", "images_per_request": 1,
                       "image_size": 448}, "engine_decode-m-qwen3-vl-2b-bf16-b64-64in-128out-img1x448"),
    ("e2e_grpo", {"model": "qwen3-vl-2b", "prompts": 16, "n_samples_per_prompt": 4, "max_new_tokens": 64,
                  "side": "slime", "task": "vlm-shapes", "image_size": 448, "images_per_prompt": 1},
     "e2e_grpo-m-qwen3-vl-2b-64x64-slime-only-shapes-img448"),
    ("e2e_grpo", {"model": "qwen3-1.7b", "prompts": 16, "n_samples_per_prompt": 4, "max_new_tokens": 64,
                  "side": "slime", "task": "vlm-shapes", "image_size": 448, "images_per_prompt": 0},
     "e2e_grpo-m-qwen3-1.7b-64x64-slime-only-shapes-text"),
])
def test_each_bench_names_its_model_and_variant(benchmark, config, name):
    assert common.result_name(benchmark, "m", config) == name
