"""Mistakes a user makes, caught before any work starts: each test asserts the message the user sees and,
where files are involved, that nothing was created, changed or overwritten (docs/errors.md lists them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime.arguments import parse_args
from slime.preflight import (RunFinished, UserError, check_data_files, check_finished, check_hooks, check_reward,
                                   check_save_dir, main, preflight)

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]
HOOKS = "tests.preflight_hooks"
REPO = Path(__file__).parents[1]


def parse(*extra):
    return parse_args(BASE + [str(x) for x in extra])


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def snapshot(directory):
    """Every file under ``directory`` with its bytes and mtime: compared before and after a refusal."""
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(directory).rglob("*") if p.is_file()}


def make_checkpoint(directory, last_step):
    directory.mkdir(parents=True, exist_ok=True)
    for step in range(last_step + 1):
        (directory / f"iter_{step:07d}").mkdir(exist_ok=True)
        (directory / f"iter_{step:07d}" / "model.pt").write_bytes(bytes([step]) * 8)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(last_step))
    return directory


# ----------------------------------------------------------------------------- counts and intervals

@pytest.mark.parametrize("flags,message", [
    (["--rollout-batch-size", "0"], "--rollout-batch-size must be a positive number (got 0)"),
    (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be a positive number (got 0)"),
    (["--n-samples-per-prompt", "-2"], "--n-samples-per-prompt must be a positive number (got -2)"),
    (["--num-rollout", "-1"], "--num-rollout must be >= 0 (got -1)"),
    (["--save", "SAVE", "--save-interval", "0"], "--save-interval must be a positive number (got 0)"),
    (["--eval-interval", "0"], "--eval-interval must be a positive number (got 0)"),
    (["--global-batch-size", "0"], "--global-batch-size must be a positive number (got 0)"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive number (got 0)"),
    (["--rollout-max-response-len", "0"], "--rollout-max-response-len must be a positive number (got 0)"),
    (["--update-weights-interval", "0"], "--update-weights-interval must be a positive number (got 0)"),
    (["--over-sampling-batch-size", "0"], "--over-sampling-batch-size must be a positive number (got 0)"),
    (["--max-tokens-per-gpu", "-5"], "--max-tokens-per-gpu must be a positive number (got -5)"),
    (["--rollout-num-gpus-per-engine", "0"], "--rollout-num-gpus-per-engine must be a positive number (got 0)"),
    (["--reward-timeout", "0"], "--reward-timeout must be > 0 seconds (got 0)"),
    (["--stop-on-failed-ratio", "0"], "--stop-on-failed-ratio must be in (0, 1] (got 0)"),
    (["--stop-on-failed-ratio", "1.5"], "--stop-on-failed-ratio must be in (0, 1] (got 1.5)"),
])
def test_non_positive_counts_are_refused_naming_the_flag(flags, message, tmp_path):
    flags = [str(tmp_path / "save") if f == "SAVE" else f for f in flags]
    with pytest.raises(UserError) as error:
        parse(*flags)
    assert message in str(error.value)
    assert not (tmp_path / "save").exists()


def test_num_epoch_zero_is_refused():
    with pytest.raises(UserError, match="--num-epoch must be a positive number"):
        parse_args(["--rollout-batch-size", "4", "--num-epoch", "0", "--train-backend", "fsdp",
                    "--rollout-backend", "embedded"])


def test_colocate_with_disagreeing_gpu_counts_names_what_to_set():
    with pytest.raises(UserError) as error:
        parse("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1")
    expected = "--rollout-num-gpus (1) must equal --actor-num-nodes x --actor-num-gpus-per-node (1 x 2 = 2)"
    assert expected in str(error.value)
    assert "set --rollout-num-gpus 2" in str(error.value)
    args = parse("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2")  # agreeing: accepted
    assert args.rollout_num_gpus == 2 and args.colocate


# ----------------------------------------------------------------------------- --load and --save

def test_load_that_does_not_exist_is_an_error_and_save_is_untouched(tmp_path):
    save = make_checkpoint(tmp_path / "ckpt_typo", 3)
    before = snapshot(save)
    with pytest.raises(UserError) as error:
        parse("--load", tmp_path / "ckpt_typoo", "--save", save)
    assert f"--load '{tmp_path / 'ckpt_typoo'}' does not exist" in str(error.value)
    assert snapshot(save) == before and not (tmp_path / "ckpt_typoo").exists()


def test_load_equal_to_a_new_save_is_a_fresh_run(tmp_path):
    args = parse("--load", tmp_path / "new", "--save", tmp_path / "new")
    assert args.start_rollout_id == 0 and args.finetune


def test_save_holding_another_runs_checkpoints_is_refused(tmp_path):
    save = make_checkpoint(tmp_path / "other_run", 3)
    before = snapshot(save)
    with pytest.raises(UserError) as error:
        parse("--save", save)
    message = str(error.value)
    assert "already holds checkpoints of another run (last step 3)" in message
    assert f"--load {save}" in message and "--overwrite-save" in message
    assert snapshot(save) == before


def test_save_of_another_run_refused_also_when_loading_elsewhere(tmp_path):
    save = make_checkpoint(tmp_path / "other_run", 1)
    (tmp_path / "mine").mkdir()
    with pytest.raises(UserError, match="already holds checkpoints of another run"):
        parse("--load", tmp_path / "mine", "--save", save)


def test_overwrite_save_allows_writing_over_another_run(tmp_path):
    save = make_checkpoint(tmp_path / "other_run", 1)
    assert parse("--save", save, "--overwrite-save").overwrite_save


def test_load_equal_to_save_resumes(tmp_path):
    save = make_checkpoint(tmp_path / "run", 0)
    args = parse("--load", save, "--save", save)
    assert args.load == str(save) and args.start_rollout_id is None and not args.finetune


def test_save_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    args = parse("--save", tmp_path / "file")
    with pytest.raises(UserError, match="--save .* is a file, not a directory"):
        check_save_dir(args)


def test_save_that_cannot_be_created_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    args = parse("--save", tmp_path / "file" / "ckpt")
    with pytest.raises(UserError, match="is not writable .*checkpoints could not be saved"):
        check_save_dir(args)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_save_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    args = parse("--save", tmp_path / "ro")
    with pytest.raises(UserError, match="is not writable"):
        check_save_dir(args)


def test_resuming_a_finished_run_says_it_is_finished(tmp_path):
    save = make_checkpoint(tmp_path / "run", 1)
    args = parse("--load", save, "--save", save)  # --num-rollout 2: steps 0 and 1 are done
    with pytest.raises(RunFinished) as error:
        check_finished(args)
    assert "already finished" in str(error.value) and "completed rollout step 1" in str(error.value)
    assert "Raise --num-rollout" in str(error.value)
    check_finished(parse("--load", save, "--save", save, "--num-rollout", "5"))  # more steps to go: no error


# ----------------------------------------------------------------------------- hooks

@pytest.mark.parametrize("flags,message", [
    (["--custom-rm-path", "tests.utils.preflight_hookz.async_reward"],
     "--custom-rm-path tests.utils.preflight_hookz.async_reward: cannot load"),
    (["--custom-rm-path", f"{HOOKS}.async_rewrd"], "has no attribute 'async_rewrd'"),
    (["--custom-rm-path", "reward"], "expected a dotted path"),
    (["--custom-rm-path", f"{HOOKS}.reward_without_sample"], "cannot be called with (args, sample)"),
    (["--custom-rm-path", f"{HOOKS}.NOT_A_FUNCTION"], "is not callable (found int 42); expected [async] def reward("),
    (["--custom-rm-path", "tests.preflight_broken_module.reward"],
     "importing it raised RuntimeError: this module is broken on purpose"),
    (["--custom-generate-function-path", f"{HOOKS}.plain_generate"],
     "is a plain `def`; slime awaits it: write it as async def generate("),
    (["--rollout-function-path", f"{HOOKS}.rollout_without_data_source"],
     "cannot be called with (args, rollout_id, data_source)"),
    (["--eval-function-path", f"{HOOKS}.rollout_without_data_source"], "--eval-function-path"),
    (["--dynamic-sampling-filter-path", f"{HOOKS}.NOT_A_FUNCTION"], "--dynamic-sampling-filter-path"),
    (["--data-source-path", f"{HOOKS}.DataSourceWithoutArgs"], "expected class DataSource: __init__(self, args)"),
    (["--rollout-sample-hook-path", f"{HOOKS}.sample_hook", "--rollout-sample-hook-path", f"{HOOKS}.missing_hook"],
     "--rollout-sample-hook-path tests.preflight_hooks.missing_hook"),
    (["--loss-type", "custom_loss", "--custom-loss-function-path", f"{HOOKS}.loss_with_two_args"],
     "expected def loss(args, batch, logits, sum_of_sample_mean)"),
    (["--buffer-filter-path", f"{HOOKS}.missing"], "--buffer-filter-path"),
    (["--use-tis", "--custom-tis-function-path", f"{HOOKS}.loss_with_two_args"],
     "missing a required argument: 'batch'); expected def tis(args, *, pg_loss"),
])
def test_bad_hook_is_refused_at_start_naming_flag_and_expected_signature(flags, message):
    with pytest.raises(UserError) as error:
        check_hooks(parse(*flags))
    assert message in str(error.value)


@pytest.mark.parametrize("flags", [
    ["--custom-rm-path", f"{HOOKS}.async_reward"],
    ["--custom-rm-path", f"{HOOKS}.sync_reward"],  # a plain def reward is accepted (run in a worker thread)
    ["--custom-generate-function-path", f"{HOOKS}.async_generate"],
    ["--rollout-function-path", f"{HOOKS}.rollout_fn"],
    ["--buffer-filter-path", f"{HOOKS}.buffer_filter"],
    ["--rollout-sample-hook-path", f"{HOOKS}.sample_hook"],
    ["--use-tis", "--custom-tis-function-path", "slime.algorithms.functional.vanilla_tis_function"],  # keyword-called
])
def test_good_hooks_pass(flags):
    check_hooks(parse(*flags))


# ----------------------------------------------------------------------------- reward

def test_unknown_rm_type_lists_the_valid_ones():
    with pytest.raises(UserError) as error:
        check_reward(parse("--rm-type", "mathh"))
    assert "--rm-type 'mathh' is not a rule reward (did you mean math?)" in str(error.value)
    assert "deepscaler" in str(error.value) and "--custom-rm-path" in str(error.value)


def test_boxed_prefix_of_a_valid_rm_type_passes():
    check_reward(parse("--rm-type", "boxed_math"))


def test_remote_rm_needs_its_url():
    with pytest.raises(UserError, match="--rm-type remote_rm needs --rm-url"):
        check_reward(parse("--rm-type", "remote_rm"))


def test_no_reward_at_all_is_an_error(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "q", "label": "a"}])
    with pytest.raises(UserError) as error:
        check_reward(parse("--prompt-data", data))
    assert "no reward is configured: every sample would fail with reward 0" in str(error.value)


def test_reward_type_in_the_rows_metadata_counts_as_configured(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "q", "label": "a", "metadata": {"rm_type": "math"}}])
    check_reward(parse("--prompt-data", data))


def test_custom_generate_function_may_set_rewards_itself():
    check_reward(parse("--custom-generate-function-path", f"{HOOKS}.async_generate"))


# ----------------------------------------------------------------------------- data files

@pytest.mark.parametrize("rows,flags,message", [
    ([{"input": "q"}, {"input": "q"}, "{not json"], [], "d.jsonl:3: malformed JSON line"),
    ([{"input": "q"}, [1, 2]], [], "d.jsonl:2: expected a JSON object per line, got list"),
    ([{"input": "q"}, {"question": "q"}], [], "d.jsonl line 2: missing input key 'input' (--input-key)"),
    ([{"input": "q", "label": "a"}, {"input": "q"}], ["--label-key", "label"],
     "d.jsonl line 2: missing label key 'label' (--label-key)"),
    ([{"input": "q", "metadata": "{oops"}], [], "metadata key 'metadata' is a string but not valid JSON"),
    ([{"input": 5}], [], "input key 'input' must be a string or a list of chat messages"),
    ([], [], "d.jsonl holds no rows"),
])
def test_bad_prompt_data_names_file_line_and_key(tmp_path, rows, flags, message):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError) as error:
        check_data_files(parse("--prompt-data", data, *flags))
    assert message in str(error.value) and str(error.value).startswith("--prompt-data: ")


def test_non_utf8_byte_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"input": "ok"}\n{"input": "caf\xe9"}\n')
    with pytest.raises(UserError) as error:
        check_data_files(parse("--prompt-data", path))
    assert f"{path}:2: not UTF-8 (byte 0xe9 at column 15)" in str(error.value)


def test_malformed_last_line_of_eval_data_is_found_at_start(tmp_path):
    good = write_jsonl(tmp_path / "train.jsonl", [{"input": "q"}])
    rows = [{"input": f"q{i}"} for i in range(49)] + ["{broken"]
    evaluation = write_jsonl(tmp_path / "eval.jsonl", rows)
    with pytest.raises(UserError) as error:
        check_data_files(parse("--prompt-data", good, "--eval-prompt-data", "aime", evaluation, "--eval-interval", "1"))
    message = str(error.value)
    assert message.startswith("--eval-prompt-data (aime): ") and "eval.jsonl:50: malformed JSON" in message


def test_unsupported_data_format_is_named(tmp_path):
    (tmp_path / "d.csv").write_text("input\nq\n")
    with pytest.raises(UserError, match=r"unsupported prompt data format .*d.csv.*expected a .jsonl or .parquet"):
        check_data_files(parse("--prompt-data", tmp_path / "d.csv"))


def test_missing_prompt_file_is_named_at_parse(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompt-data: prompt file .*nope.jsonl' does not exist"):
        parse("--prompt-data", tmp_path / "nope.jsonl")


def test_good_data_passes_and_preflight_runs_once(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "q", "label": "a"}] * 3)
    args = parse("--prompt-data", data, "--label-key", "label", "--rm-type", "math", "--save", tmp_path / "ckpt")
    preflight(args)
    assert args._preflight_done and (tmp_path / "ckpt").is_dir() and not list((tmp_path / "ckpt").iterdir())


# ----------------------------------------------------------------------------- --sglang-* pass-through

def test_misspelt_sglang_flag_gets_did_you_mean():
    with pytest.raises(UserError, match="--sglang-mem-fraction-statc is not an option of the embedded engine; "
                                        "did you mean --sglang-mem-fraction-static"):
        parse("--sglang-mem-fraction-statc", "0.5")


def test_sglang_zero_value_is_forwarded_to_the_engine():
    from slime.ray.engine_actor import embedded_engine_argv

    argv = embedded_engine_argv(parse("--sglang-random-seed", "0", "--sglang-chunked-prefill-size", "0"), gpu=False)
    assert argv[argv.index("--random-seed") + 1] == "0"
    assert argv[argv.index("--chunked-prefill-size") + 1] == "0"


# ----------------------------------------------------------------------------- what the user sees

def _main(argv, entry=lambda args: None, env=None):
    """Run ``main`` in a subprocess-free way: capture its exit code and stderr."""
    import contextlib
    import io

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        main(entry, parse=lambda: parse(*argv))
    return exit_info.value.code, stderr.getvalue()


def test_a_mistake_is_one_message_without_traceback(monkeypatch):
    monkeypatch.delenv("SLIME_DEBUG", raising=False)
    code, err = _main(["--n-samples-per-prompt", "0"])
    assert code == 1 and err.startswith("slime: error: --n-samples-per-prompt must be a positive number (got 0)")
    assert "Traceback" not in err and len(err.splitlines()) == 2  # the message and the SLIME_DEBUG hint


def test_slime_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("SLIME_DEBUG", "1")
    with pytest.raises(UserError, match="--n-samples-per-prompt"):
        main(lambda args: None, parse=lambda: parse("--n-samples-per-prompt", "0"))


def test_finished_run_exits_zero_saying_so(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIME_DEBUG", raising=False)
    save = make_checkpoint(tmp_path / "run", 1)
    before = snapshot(save)
    ran = []
    code, err = _main(["--load", save, "--save", save, "--rm-type", "math"], entry=ran.append)
    assert code == 0 and "nothing to do" in err and "already finished" in err and not ran
    assert snapshot(save) == before


def test_user_error_during_the_run_is_one_message(monkeypatch):
    monkeypatch.delenv("SLIME_DEBUG", raising=False)

    def entry(args):
        from slime.rollout.step_checks import RunCannotLearn

        raise RunCannotLearn("rollout step 0: 8 of 8 samples FAILED")

    code, err = _main(["--rm-type", "math"], entry=entry)
    assert code == 1 and err.startswith("slime: error: rollout step 0: 8 of 8 samples FAILED")


@pytest.mark.timeout(120)
def test_train_py_with_a_typo_in_load_exits_before_anything_starts(tmp_path):
    """The whole entry point: exit 1, one message, the other run's checkpoints untouched, no run dir."""
    save = make_checkpoint(tmp_path / "ckpt_typo", 3)
    before = snapshot(save)
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    env.pop("SLIME_DEBUG", None)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *BASE, "--load", str(tmp_path / "ckpt_typoo"),
                             "--save", str(save), "--run-dir", str(tmp_path / "run")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "slime: error: --load" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(save) == before and not (tmp_path / "run").exists()


def test_a_component_that_fails_to_start_on_bad_input_is_one_message(monkeypatch):
    """A constructor in a Ray actor (the data source) rejecting the data: Ray keeps only the error's text."""
    from ray.exceptions import ActorDiedError, RayTaskError

    monkeypatch.delenv("SLIME_DEBUG", raising=False)
    error = ValueError("d.jsonl: every prompt (4) is longer than 8 tokens")
    task_error = RayTaskError("RolloutManager.__init__", "Traceback (most recent call last):\n  File x\n"
                              f"ValueError: {error}", error)

    def entry(args):
        raise ActorDiedError(task_error)

    code, err = _main(["--rm-type", "math"], entry=entry)
    assert code == 1 and err.startswith("slime: error: a component failed to start: ")
    assert "every prompt (4) is longer than 8 tokens" in err.splitlines()[0] and "Traceback" not in err
