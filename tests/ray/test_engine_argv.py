"""Which ``--sglang-*`` flags reach an embedded engine's command line."""

from slime.ray.engine_actor import embedded_engine_argv
from slime.utils.arguments import parse_args

BASE = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", "/tmp", "--prompt-data",
        "x.jsonl", "--rollout-batch-size", "4", "--num-rollout", "1"]


def test_engine_speed_flags_are_forwarded_and_sglang_only_ones_dropped():
    args = parse_args(BASE + ["--sglang-attention-backend", "torch_native", "--sglang-disable-cuda-graph",
                              "--sglang-cuda-graph-max-bs", "32", "--sglang-chunked-prefill-size", "4096",
                              "--sglang-enable-metrics"])
    argv = embedded_engine_argv(args, gpu=True)
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert "--disable-cuda-graph" in argv
    assert argv[argv.index("--cuda-graph-max-bs") + 1] == "32"
    assert argv[argv.index("--chunked-prefill-size") + 1] == "4096"
    assert "--enable-metrics" not in argv  # an SGLang option the embedded engine does not have
