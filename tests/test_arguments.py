"""parse_args: flag spellings and defaults, pass-through, and one test per §4.4 validation rule."""

import pytest

from slime.arguments import parse_args

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]


def parse(*extra):
    return parse_args(BASE + [str(x) for x in extra])


def test_defaults_match_spec():
    args = parse()
    assert args.n_samples_per_prompt == 1 and args.rollout_temperature == 1.0 and args.rollout_top_k == -1
    assert args.advantage_estimator == "grpo" and args.loss_type == "policy_loss" and args.kl_loss_type == "k1"
    assert args.eps_clip == 0.2 and args.eps_clip_high == 0.2 and args.lr == 1e-6 and args.seed == 1234
    assert args.clip_grad == 1.0 and args.update_weight_buffer_size == 512 * 1024**2
    assert args.sglang_server_concurrency == 512 and args.rollout_seed == 42 and args.input_key == "input"
    assert args.data_source_path == "slime.rollout.data_source.RolloutDataSourceWithBuffer"
    assert args.rollout_function_path == "slime.rollout.sglang_rollout.generate_rollout"
    assert args.eval_function_path == args.rollout_function_path
    assert args.rollout_global_dataset is True and args.rewards_normalization is True
    assert args.over_sampling_batch_size == 4 and args.global_batch_size == 4
    assert args.offload_train is False and args.offload_rollout is False and not hasattr(args, "offload")
    assert args.start_rollout_id == 0 and args.use_critic is False and args.rollout_external is False
    assert args.rollout_sample_hook_path == [] and args.world_size == 8
    # n_samples_per_prompt == 1 disables std normalisation (rule 27)
    assert args.grpo_std_normalization is False


def test_megatron_style_flags_and_custom_arguments():
    def add(parser):
        parser.add_argument("--my-hook-param", type=int, default=3)
        return parser

    megatron = [a if a != "fsdp" else "megatron" for a in BASE] + ["--debug-rollout-only"]  # no Megatron-Core needed
    args = parse_args(megatron + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--lr-decay-style", "cosine",
                                  "--adam-beta2", "0.98", "--recompute-granularity", "full", "--num-layers", "28"],
                      add_custom_arguments=add)
    assert args.tensor_model_parallel_size == 2 and args.sequence_parallel and args.lr_decay_style == "cosine"
    assert args.adam_beta2 == 0.98 and args.num_layers == 28 and args.my_hook_param == 3


def test_passthrough_kept_for_forwarding():
    args = parse("--sglang-mem-fraction-static", "0.7", "--router-policy", "round_robin", "--sglang-enable-dp-attention")
    assert args.sglang_mem_fraction_static == 0.7
    assert args.sglang_passthrough["mem-fraction-static"] == 0.7
    assert args.sglang_passthrough["enable-dp-attention"] is True
    assert args.router_policy == "round_robin" and args.router_passthrough["policy"] == "round_robin"
    # slime's router defaults
    assert args.router_log_level == "warn" and args.router_balance_abs_threshold == 10


def test_unknown_flag_suggests_closest(capsys):
    with pytest.raises(SystemExit):
        parse("--rollout-temprature", "0.5")
    assert "did you mean --rollout-temperature" in capsys.readouterr().err


def test_missing_backend_library_names_install_command():
    with pytest.raises(ValueError, match=r"pip install -e '\.\[megatron\]'"):
        parse_args(["--rollout-batch-size", "1", "--num-rollout", "1", "--rollout-backend", "embedded"])
    with pytest.raises(ValueError, match=r"--rollout-backend embedded"):
        parse_args(["--rollout-batch-size", "1", "--num-rollout", "1", "--train-backend", "fsdp"])
    # no engine needed: no SGLang needed
    parse_args(["--rollout-batch-size", "1", "--num-rollout", "1", "--train-backend", "fsdp", "--debug-train-only"])


@pytest.mark.parametrize(
    "extra,error,match",
    [
        (["--eval-prompt-data", "a", "x.jsonl", "b"], ValueError, "name/path pairs"),  # 1
        (["--rollout-temperature", "0"], ValueError, "--rollout-temperature must be > 0"),  # 2
        (["--use-kl-loss", "--ref-load", "/no/such/dir"], FileNotFoundError, "--ref-load"),  # 3
        (["--use-opd"], ValueError, "--use-opd requires --opd-type"),  # 4
        (["--use-opd", "--opd-type", "sglang", "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"],
         ValueError, "needs --rm-url"),  # 4
        (["--max-weight-staleness", "-1"], ValueError, "--max-weight-staleness must be >= 0"),
        (["--opd-teacher-load", "/tmp"], ValueError, "--opd-teacher-load '/tmp' is not implemented"),  # 0 (refused)
        (["--eval-interval", "1"], ValueError, "--eval-interval needs at least one eval dataset"),  # 6
        (["--save-interval", "1"], ValueError, "--save-interval needs --save"),  # 7
        (["--kl-coef", "0.1", "--kl-loss-coef", "0.1", "--use-kl-loss", "--ref-load", "/tmp"], ValueError, "--kl-coef .* --kl-loss-coef"),  # 8
        (["--advantage-estimator", "reinforce_plus_plus"], ValueError, "requires --normalize-advantages"),  # 9
        (["--use-rollout-logprobs", "--use-tis"], ValueError, "--use-rollout-logprobs and --use-tis"),  # 10
        (["--get-mismatch-metrics"], ValueError, "--get-mismatch-metrics requires --custom-tis-function-path"),  # 11
        (["--use-dynamic-batch-size"], ValueError, "--use-dynamic-batch-size requires --max-tokens-per-gpu"),  # 12
        (["--context-parallel-size", "2"], ValueError, "--context-parallel-size 2 needs --train-backend megatron"),
        (["--save-debug-rollout-data", "x", "--save-debug-train-data", "x"], ValueError, "must not be equal"),  # 16
        (["--debug-rollout-only", "--debug-train-only"], ValueError, "cannot be combined"),  # 22
        (["--num-steps-per-rollout", "2", "--global-batch-size", "3"], ValueError, "disagrees"),  # 26
        (["--over-sampling-batch-size", "2"], ValueError, "--over-sampling-batch-size .* must be >="),  # 28
        (["--enable-mtp-training"], ValueError, "--enable-mtp-training True is not implemented"),  # 0
        (["--rollout-max-context-len", "10", "--rollout-max-prompt-len", "10"], ValueError, "--rollout-max-prompt-len"),  # 33
        (["--only-train-params-name-list", "a", "--freeze-params-name-list", "b"], ValueError, "mutually exclusive"),  # 34
        (["--update-weight-transport", "disk"], ValueError, "requires --update-weight-disk-dir"),  # 35
        (["--release-train"], ValueError, "--release-train True is not implemented .*--colocate"),  # 0
        (["--update-weight-mode", "delta"], ValueError, "requires --update-weight-transport disk"),  # 37
        (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "d", "--colocate"], ValueError, "incompatible with --colocate"),  # 37
        (["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "d"], ValueError, "--update-weight-local-checkpoint-dir"),  # 37
        (["--eps-clip-c", "0.5"], ValueError, "--eps-clip-c must be > 1"),
        (["--sglang-router-ip", "127.0.0.1"], ValueError, "must be given together"),
    ],
)
def test_validation_rules(extra, error, match):
    with pytest.raises(error, match=match):
        parse(*extra)


def test_num_rollout_or_epoch_required():  # 29
    with pytest.raises(ValueError, match="--num-rollout or --num-epoch"):
        parse_args(["--rollout-batch-size", "1", "--train-backend", "fsdp", "--rollout-backend", "embedded"])
    with pytest.raises(ValueError, match="--num-epoch needs the global dataset"):
        parse_args(["--rollout-batch-size", "1", "--num-epoch", "1", "--disable-rollout-global-dataset",
                    "--train-backend", "fsdp", "--rollout-backend", "embedded"])


def test_derived_values():
    args = parse("--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2", "--eps-clip", "0.3",
                 "--reward-key", "score", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512",
                 "--rollout-max-context-len", "100", "--dump-details", "/tmp/d", "--offload")
    assert args.global_batch_size == 8  # 26
    assert args.eps_clip_high == 0.3  # 14
    assert args.eval_reward_key == "score"  # 15
    assert args.log_probs_max_tokens_per_gpu == 512  # 12
    assert args.rollout_max_prompt_len == 99 and args.eval_max_context_len == 100  # 33
    assert args.save_debug_rollout_data == "/tmp/d/rollout_data/{rollout_id}.pt"  # 16
    assert args.offload_train and args.offload_rollout  # 20
    assert args.grpo_std_normalization is True


def _touch(tmp_path, *names):
    for name in names:
        (tmp_path / name).write_text('{"input": "q"}\n')
    return [str(tmp_path / name) for name in names]


def test_eval_prompt_data_single_path_and_pairs(tmp_path):  # 1
    e, a, b = _touch(tmp_path, "e.jsonl", "a.jsonl", "b.jsonl")
    args = parse("--eval-prompt-data", e, "--eval-temperature", "0.5", "--n-samples-per-eval-prompt", "3")
    assert args.eval_prompt_data == ["aime", e]
    (config,) = args.eval_datasets
    assert config.name == "aime" and config.temperature == 0.5 and config.n_samples_per_eval_prompt == 3
    assert config.top_p == 1.0 and config.input_key == "input"
    args = parse("--eval-prompt-data", "a", a, "b", b)
    assert [c.name for c in args.eval_datasets] == ["a", "b"]


def test_missing_prompt_files_fail_at_start_naming_the_path(tmp_path):
    (present,) = _touch(tmp_path, "train.jsonl")
    missing = str(tmp_path / "no_such.jsonl")
    with pytest.raises(FileNotFoundError, match=f"--prompt-data: prompt file '{missing}' does not exist"):
        parse("--prompt-data", missing)
    with pytest.raises(FileNotFoundError, match=f"--prompt-data: prompt file '{missing}' does not exist"):
        parse("--prompt-data", missing + "@[0:10]")  # the slice suffix is not part of the file name
    with pytest.raises(FileNotFoundError, match=f"--eval-prompt-data \\(held\\): prompt file '{missing}'"):
        parse("--prompt-data", present, "--eval-prompt-data", "held", missing)
    config = tmp_path / "eval.yaml"
    config.write_text(f"eval:\n  datasets:\n    - {{name: x, path: {missing}}}\n")
    with pytest.raises(FileNotFoundError, match=f"--eval-config \\(x\\): prompt file '{missing}'"):
        parse("--eval-config", config)
    args = parse("--prompt-data", present + "@[0:1]", "--eval-prompt-data", "held", present)
    assert args.prompt_data.endswith("@[0:1]")
    # nothing reads prompts when training on saved rollouts
    parse("--prompt-data", missing, "--load-debug-rollout-data", str(tmp_path / "{rollout_id}.pt"))


def test_eval_config_file(tmp_path):
    path = tmp_path / "eval.yaml"
    (x,) = _touch(tmp_path, "x.jsonl")
    path.write_text(f"eval:\n  defaults:\n    temperature: 0.3\n  datasets:\n    - name: x\n      path: {x}\n      rm_type: math\n")
    args = parse("--eval-config", path, "--eval-prompt-data", "ignored.jsonl")
    (config,) = args.eval_datasets
    assert (config.name, config.temperature, config.rm_type) == ("x", 0.3, "math")
    assert config.inject_metadata({"a": 1}) == {"a": 1, "rm_type": "math"}
    path.write_text("eval:\n  defaults:\n    bogus: 1\n  datasets:\n    - {name: x, path: y}\n")
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        parse("--eval-config", path)


def test_colocate_defaults_offload_and_respects_explicit_no():  # 23, 24
    args = parse("--colocate", "--actor-num-gpus-per-node", "2")
    assert args.offload_train and args.offload_rollout and args.rollout_num_gpus == 2
    args = parse("--colocate", "--no-offload-train")
    assert args.offload_train is False and args.offload_rollout is True


def test_debug_rollout_only_rewrites_gpus():  # 21
    args = parse_args(["--rollout-batch-size", "1", "--num-rollout", "1", "--rollout-backend", "embedded",
                       "--debug-rollout-only", "--rollout-num-gpus", "4", "--colocate"])
    assert args.actor_num_gpus_per_node == 4 and args.colocate is False and args.offload_train is False


def test_load_resolution(tmp_path):  # 5
    (tmp_path / "empty").mkdir()  # an existing directory with no checkpoint yet (one that does not exist is refused)
    args = parse("--load", tmp_path / "empty", "--ref-load", tmp_path)
    assert args.load == str(tmp_path) and args.no_load_optim and args.finetune and args.start_rollout_id == 0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    args = parse("--load", ckpt)
    assert args.load == str(ckpt) and args.start_rollout_id is None and not args.no_load_optim
    assert parse("--start-rollout-id", "5").start_rollout_id == 5


def test_critic_and_custom_config(tmp_path):  # 19, 32
    config = tmp_path / "c.yaml"
    config.write_text("tis_mode: truncate\neps_clip: 0.1\n")
    args = parse("--advantage-estimator", "ppo", "--custom-config-path", config)
    assert args.use_critic and args.critic_num_gpus_per_node == args.actor_num_gpus_per_node
    assert args.tis_mode == "truncate" and args.eps_clip == 0.1


def test_json_flags_parsed():
    args = parse("--apply-chat-template-kwargs", '{"enable_thinking": false}', "--train-env-vars", '{"A": "1"}')
    assert args.apply_chat_template_kwargs == {"enable_thinking": False} and args.train_env_vars == {"A": "1"}
    with pytest.raises(ValueError, match="--train-env-vars must be a JSON object"):
        parse("--train-env-vars", "[1]")


def test_fully_async_rollout_evaluates_with_the_default_rollout():
    base = ["--rollout-batch-size", "1", "--num-rollout", "1", "--train-backend", "fsdp", "--debug-train-only"]
    fully_async = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
    args = parse_args([*base, "--rollout-function-path", fully_async])
    assert args.eval_function_path == "slime.rollout.sglang_rollout.generate_rollout"
    args = parse_args([*base, "--rollout-function-path", fully_async, "--eval-function-path", "my.eval"])
    assert args.eval_function_path == "my.eval"  # never overrides what the user set
    assert parse_args([*base, "--rollout-function-path", "my.rollout"]).eval_function_path == "my.rollout"
