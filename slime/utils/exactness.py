"""Start-up checks of ``--true-on-policy`` and ``--deterministic-mode``: refuse every combination whose
results cannot be exact.

``--true-on-policy`` makes the engine's log-prob of each sampled token equal the trainer's π_old bit for
bit by running one set of batch-invariant ops on both sides (``slime/backends/batch_invariant.py``);
``--deterministic-mode`` with the embedded engine runs the engine on the same ops (a sample's tokens must
not depend on the batch it decoded in) with a sampling seed per sample. Both hold only where slime owns
the kernels, and only on the CPU today, in fp32 or bf16 (the engine's dtype and the trainer's the same).
"""

from __future__ import annotations

import os

from slime.utils.passthrough import sglang_value

#: the device types the engine-vs-trainer equality has been verified on; CUDA joins once the GPU tests of
#: tests/backends/test_batch_invariant.py and tests/ray/test_exact_runs_gpu.py (-m gpu) pass on one
VERIFIED_DEVICES = ("cpu",)
#: device types named here (comma-separated) are let through as if verified: for running the verification
#: itself on a new device (the GPU tests and loop), never for training whose exactness matters
VERIFY_ENV = "SLIME_VERIFY_EXACTNESS_ON"


def verified_devices() -> tuple[str, ...]:
    """:data:`VERIFIED_DEVICES`, plus the device types a verification run names in :data:`VERIFY_ENV`."""
    extra = tuple(d.strip() for d in os.environ.get(VERIFY_ENV, "").split(",") if d.strip())
    return VERIFIED_DEVICES + tuple(d for d in extra if d not in VERIFIED_DEVICES)

INSTEAD = "drop --true-on-policy and correct the train/rollout mismatch with --use-tis (TIS/MIS)"
#: engine dtype names (--embedded-engine-dtype, --sglang-dtype) -> the dtype the batch-invariant ops are tested in
EXACT_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def validate_exactness(args) -> None:
    """Raise naming the flag that cannot be exact and what to use instead (nothing without the flags)."""
    true_on_policy = args.true_on_policy
    if true_on_policy:
        reason = _trainer_refusal(args)
        if reason is not None:
            raise ValueError(f"--true-on-policy: {reason}")
    embedded = args.rollout_backend == "embedded" and not args.rollout_external
    if true_on_policy or (args.deterministic_mode and embedded and not args.debug_train_only):
        flag = "--true-on-policy" if true_on_policy else "--deterministic-mode (with the embedded engine)"
        reason = _engine_refusal(args, "drop --true-on-policy and correct the mismatch with --use-tis (TIS/MIS)"
                                 if true_on_policy else "drop --deterministic-mode")
        if reason is not None:
            raise ValueError(f"{flag}: {reason}")


def _trainer_refusal(args) -> str | None:
    if args.train_backend != "fsdp":
        return (f"--train-backend {args.train_backend} runs Megatron's kernels, which are not the engine's; "
                "use --train-backend fsdp, or " + INSTEAD)
    if args.rollout_external:
        return "external engines (--rollout-external-engine-addrs) are not slime's embedded engine; " + INSTEAD
    if args.rollout_backend != "embedded":
        return ("--rollout-backend sglang samples with SGLang's kernels; even its deterministic build "
                "(--sglang-enable-deterministic-inference) reproduces itself, not the trainer's log-probs. Use "
                "--rollout-backend embedded, or " + INSTEAD)
    engine = _engine_dtype(args)
    trainer = "bfloat16" if args.fsdp_mixed_precision == "bf16" else "float32"  # auto: fp32 on the CPU
    if engine in EXACT_DTYPES.values() and engine != trainer:
        return (f"the engine computes in {engine} and the trainer in {trainer}: the log-probs of two dtypes cannot "
                "be equal. Use --embedded-engine-dtype bfloat16 with --fsdp-mixed-precision bf16, or fp32 on both "
                "sides (neither flag on the CPU)")
    if args.fsdp_compile:
        return "--fsdp-compile lets the compiler choose the trainer's kernels; drop --fsdp-compile"
    if args.rollout_top_p != 1.0:
        return ("--rollout-top-p < 1 renormalises the trainer's log-probs over the nucleus while the engine "
                "returns full-vocabulary ones; use --rollout-top-p 1")
    return None


def _engine_refusal(args, instead: str) -> str | None:
    forwarded = dict(args.sglang_passthrough or {})
    quantization = forwarded.get("quantization") or sglang_value(args, "sglang_quantization")
    if quantization:
        return f"FP8 rollout (--sglang-quantization {quantization}) samples from rounded weights; {instead}"
    kv_dtype = forwarded.get("kv-cache-dtype")
    if kv_dtype not in (None, "auto"):
        return f"--sglang-kv-cache-dtype {kv_dtype} rounds the cached keys and values; {instead}"
    if forwarded.get("speculative-algorithm"):
        return (f"speculative decoding (--sglang-speculative-algorithm {forwarded['speculative-algorithm']}) "
                f"verifies drafts in a multi-token pass that is not batch-invariant; drop the speculative flags")
    dtype = _engine_dtype(args)
    if dtype not in EXACT_DTYPES.values():
        return f"engine dtype {dtype}: the batch-invariant ops are exact in fp32 and bf16 only; {instead}"
    import torch

    if torch.cuda.is_available() and "cuda" not in verified_devices():
        return ("exact only on the CPU today: the batch-invariant ops on CUDA await their GPU verification "
                f"(tests/backends/test_batch_invariant.py -m gpu); {instead}")
    return None


def _engine_dtype(args) -> str:
    """The embedded engine's compute dtype on the CPU (``auto``: fp32), by :data:`EXACT_DTYPES` name where it
    has one, else as given."""
    dtype = args.embedded_engine_dtype or dict(args.sglang_passthrough or {}).get("dtype") or "auto"
    return "float32" if dtype == "auto" else EXACT_DTYPES.get(dtype, dtype)
