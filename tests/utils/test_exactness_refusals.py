"""``--true-on-policy`` and ``--deterministic-mode`` refuse at start what cannot be exact, saying why and what
to use instead (slime/utils/exactness.py); the combinations that can be exact parse."""

import pytest

from slime.arguments import parse_args

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]


def parse(*extra):
    return parse_args(BASE + [str(x) for x in extra])


def test_the_exact_combination_parses():
    args = parse("--true-on-policy", "--deterministic-mode")
    assert args.true_on_policy and args.deterministic_mode
    args = parse("--true-on-policy", "--embedded-engine-dtype", "bfloat16", "--fsdp-mixed-precision", "bf16")
    assert args.true_on_policy and args.fsdp_mixed_precision == "bf16"  # bf16 on both sides


@pytest.mark.parametrize("extra, said", [
    (["--train-backend", "megatron"], "use --train-backend fsdp"),
    (["--rollout-backend", "sglang"], "Use --rollout-backend embedded"),
    (["--sglang-quantization", "fp8"], "FP8 rollout"),
    (["--sglang-kv-cache-dtype", "fp8_e4m3"], "rounds the cached keys"),
    (["--sglang-speculative-algorithm", "NGRAM"], "not batch-invariant"),
    (["--embedded-engine-dtype", "float16"], "exact in fp32 and bf16 only"),
    (["--embedded-engine-dtype", "bfloat16"], "the engine computes in bfloat16 and the trainer in float32"),
    (["--fsdp-mixed-precision", "bf16"], "the engine computes in float32 and the trainer in bfloat16"),
    (["--sglang-dtype", "bf16"], "the engine computes in bfloat16 and the trainer in float32"),
    (["--fsdp-compile"], "drop --fsdp-compile"),
    (["--rollout-top-p", "0.9"], "use --rollout-top-p 1"),
])
def test_true_on_policy_refuses_what_cannot_be_exact(extra, said):
    with pytest.raises(ValueError, match="--true-on-policy") as error:
        parse("--true-on-policy", *extra)
    assert said in str(error.value)
    if "--train-backend" not in extra and "--rollout-backend" not in extra:
        parse(*extra)  # the same flags parse without it


@pytest.mark.parametrize("extra", [["--sglang-quantization", "fp8"], ["--sglang-speculative-algorithm", "NGRAM"],
                                   ["--embedded-engine-dtype", "float16"]])
def test_deterministic_mode_on_the_embedded_engine_refuses_what_is_not_batch_invariant(extra):
    with pytest.raises(ValueError, match="--deterministic-mode .*drop --deterministic-mode|--deterministic-mode"):
        parse("--deterministic-mode", *extra)


def test_deterministic_mode_runs_a_bf16_engine_on_the_cpu():
    assert parse("--deterministic-mode", "--embedded-engine-dtype", "bfloat16").deterministic_mode


def test_the_engine_refuses_speculative_decoding_with_deterministic_inference(tiny_model_dir):
    from slime.backends.embedded_engine.__main__ import build_server
    from slime.backends.embedded_engine.config import parse_args as engine_args

    args = engine_args(["--model-path", tiny_model_dir, "--enable-deterministic-inference",
                        "--speculative-algorithm", "NGRAM"])
    with pytest.raises(SystemExit, match="not batch-invariant"):
        build_server(args)


def test_the_engine_refuses_architectures_without_batch_invariant_forwards(tiny_qwen3_moe_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM is not supported"):
        ModelRunner(tiny_qwen3_moe_dir, device="cpu", num_slots=2, slot_capacity=32, true_on_policy=True)


def test_a_gpu_machine_is_refused_unless_a_verification_run_names_cuda(monkeypatch):
    """On a machine with CUDA both flags refuse at start (the engine would run there); the GPU tests' loop names
    CUDA in SLIME_VERIFY_EXACTNESS_ON to run the flags for verification."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("SLIME_VERIFY_EXACTNESS_ON", raising=False)
    for flag in ("--true-on-policy", "--deterministic-mode"):
        with pytest.raises(ValueError, match="exact only on the CPU today"):
            parse(flag)
    monkeypatch.setenv("SLIME_VERIFY_EXACTNESS_ON", "cuda")
    assert parse("--true-on-policy", "--deterministic-mode").true_on_policy
