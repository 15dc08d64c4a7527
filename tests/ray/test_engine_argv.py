"""Which ``--sglang-*`` flags reach an embedded engine's command line."""

from slime.arguments import parse_args
from slime.ray.engine_actor import embedded_engine_argv

BASE = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", "/tmp",
        "--rollout-batch-size", "4", "--num-rollout", "1"]


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
    # SGLang 0.5.23's name (what --sglang-cuda-graph-max-bs is rewritten to) reaches the same engine flag
    argv = embedded_engine_argv(parse_args(BASE + ["--sglang-cuda-graph-max-bs-decode", "16"]), gpu=True)
    assert argv[argv.index("--cuda-graph-max-bs") + 1] == "16"


def test_cpu_engine_threads_share_the_cores():
    from tests.parsed_args import default_args

    from slime.ray.engine_actor import cpu_engine_threads

    sync_one = default_args(rollout_num_gpus=1, rollout_num_gpus_per_engine=1, actor_num_nodes=1, actor_num_gpus_per_node=1)
    assert cpu_engine_threads(sync_one, cpu_count=8) == 8  # the trainer is idle while the engine generates
    two_engines = default_args(**{**vars(sync_one), "rollout_num_gpus": 2})
    assert cpu_engine_threads(two_engines, cpu_count=8) == 4
    overlapping = default_args(**{**vars(two_engines), "rollout_overlaps_training": True, "actor_num_gpus_per_node": 2})
    assert cpu_engine_threads(overlapping, cpu_count=8) == 2  # 2 engines + 2 training ranks at once
    assert cpu_engine_threads(overlapping, cpu_count=2) == 1


def test_engine_decodes_a_whole_rollout_step_at_once_unless_told():
    from slime.ray.engine_actor import embedded_engine_argv
    from slime.arguments import parse_args

    base = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--rollout-batch-size", "16",
            "--n-samples-per-prompt", "8", "--num-rollout", "1"]
    argv = embedded_engine_argv(parse_args(base + ["--rollout-num-gpus", "1"]), gpu=False)
    assert argv[argv.index("--max-running-requests") + 1] == "128"  # 16 prompts x 8 samples on one engine
    argv = embedded_engine_argv(parse_args(base + ["--rollout-num-gpus", "2"]), gpu=False)
    assert argv[argv.index("--max-running-requests") + 1] == "64"
    argv = embedded_engine_argv(parse_args(base + ["--rollout-num-gpus", "1", "--sglang-max-running-requests", "32"]), gpu=False)
    assert argv[argv.index("--max-running-requests") + 1] == "32"


def test_fp8_flags_reach_the_engine_and_the_exact_weight_check_is_refused():
    import pytest

    for quantization in ("fp8", "w8a8_fp8"):
        argv = embedded_engine_argv(parse_args(BASE + ["--sglang-quantization", quantization,
                                                       "--sglang-fp8-gemm-backend", "dequant"]), gpu=True)
        assert argv[argv.index("--quantization") + 1] == quantization
        assert argv[argv.index("--fp8-gemm-backend") + 1] == "dequant"
    with pytest.raises(ValueError, match="--check-weight-update-equal .* --sglang-quantization fp8"):
        parse_args(BASE + ["--sglang-quantization", "fp8", "--check-weight-update-equal"])


def test_speculative_flags_reach_the_engine_and_parse_there():
    from slime.backends.embedded_engine.config import parse_args as engine_parse_args, speculative_config

    args = parse_args(BASE + ["--sglang-speculative-algorithm", "STANDALONE", "--sglang-speculative-draft-model-path",
                              "/tmp/draft", "--sglang-speculative-num-steps", "3",
                              "--sglang-speculative-ngram-max-trie-depth", "6"])
    argv = embedded_engine_argv(args, gpu=False)
    config = speculative_config(engine_parse_args(["--model-path", "/tmp", *argv]))
    assert (config.algorithm, config.draft_model_path, config.num_draft_tokens, config.ngram_max_match) == (
        "STANDALONE", "/tmp/draft", 4, 6)


def test_kv_cache_dtype_reaches_the_engine_and_parses_there():
    from slime.backends.embedded_engine.config import parse_args as engine_args

    argv = embedded_engine_argv(parse_args(BASE + ["--sglang-kv-cache-dtype", "fp8_e4m3"]), gpu=True)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert engine_args(["--model-path", "/tmp", *argv]).kv_cache_dtype == "fp8_e4m3"
    assert "--kv-cache-dtype" not in embedded_engine_argv(parse_args(BASE), gpu=False)  # auto: the engine's default


def test_rollout_routing_replay_turns_on_the_engines_routed_experts():
    assert "--enable-return-routed-experts" not in embedded_engine_argv(parse_args(BASE), gpu=False)
    argv = embedded_engine_argv(parse_args(BASE + ["--use-rollout-routing-replay"]), gpu=False)
    assert argv.count("--enable-return-routed-experts") == 1


def test_colocated_offloading_gpu_engines_get_the_memory_saver_when_it_is_installed(monkeypatch):
    from slime.ray import engine_actor

    colocated = parse_args(BASE + ["--colocate", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"])
    assert colocated.offload_rollout  # the default: offloading on until the first step measures
    monkeypatch.setattr(engine_actor, "memory_saver_installed", lambda: True)
    assert "--enable-memory-saver" in embedded_engine_argv(colocated, gpu=True)
    assert "--enable-memory-saver" not in embedded_engine_argv(colocated, gpu=False)  # CPU: nothing moves
    resident = parse_args(BASE + ["--colocate", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                                  "--no-offload-rollout"])
    assert "--enable-memory-saver" not in embedded_engine_argv(resident, gpu=True)
    apart = parse_args(BASE + ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"])
    assert "--enable-memory-saver" not in embedded_engine_argv(apart, gpu=True)
    monkeypatch.setattr(engine_actor, "memory_saver_installed", lambda: False)  # the copy path, with a warning-free start
    assert "--enable-memory-saver" not in embedded_engine_argv(colocated, gpu=True)


def test_adaptive_speculation_flags_reach_the_engine(tmp_path):
    """``--sglang-speculative-adaptive`` (and its config) reach the embedded engine, which parses them."""
    from slime.backends.embedded_engine.config import parse_args as parse_server_args, speculative_config

    config = tmp_path / "adaptive.json"
    config.write_text('{"1": {"candidate_steps": [0, 2]}}')
    argv = embedded_engine_argv(parse_args(BASE + ["--sglang-speculative-algorithm", "NGRAM", "--sglang-speculative-adaptive",
                                                   "--sglang-speculative-adaptive-config", str(config)]), gpu=False)
    assert "--speculative-adaptive" in argv
    assert argv[argv.index("--speculative-adaptive-config") + 1] == str(config)
    resolved = speculative_config(parse_server_args(["--model-path", "/tmp", *argv]))
    assert resolved.adaptive and resolved.adaptive_config == str(config)


def test_cuda_graph_batch_sizes_reach_the_engine_as_a_list_and_parse_there():
    """``--sglang-cuda-graph-bs-decode 1 2 4 8`` (SGLang 0.5.23's name; the old ``--sglang-cuda-graph-bs`` is
    rewritten to it) becomes the embedded engine's ``--cuda-graph-bs 1 2 4 8``, each size its own token, and the
    engine reads back the list; a size list with nothing within the running-request limit is refused by name."""
    import pytest

    from slime.backends.embedded_engine.config import parse_args as engine_args

    for flag in ("--sglang-cuda-graph-bs-decode", "--sglang-cuda-graph-bs"):
        argv = embedded_engine_argv(parse_args(BASE + [flag, "1", "2", "4", "8"]), gpu=True)
        start = argv.index("--cuda-graph-bs")
        assert argv[start + 1: start + 5] == ["1", "2", "4", "8"]
        assert engine_args(["--model-path", "/tmp", *argv]).cuda_graph_bs == [1, 2, 4, 8]
    with pytest.raises(SystemExit, match="--cuda-graph-bs 96 128: no size is within"):
        engine_args(["--model-path", "/tmp", "--max-running-requests", "64", "--cuda-graph-bs", "96", "128"])
    with pytest.raises(SystemExit, match="must be >= 1"):
        engine_args(["--model-path", "/tmp", "--cuda-graph-bs", "0", "4"])
