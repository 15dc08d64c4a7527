"""Contract tests for every rollout-side hook (docs/INTERFACES.md §2.2–2.8, 2.15–2.18).

Each test builds ``args`` with ``parse_args`` exactly as a user's command line would (the hook's
flag pointing at a sample plugin in ``tests/plugin_contracts/sample_plugins``), loads the hook with
``slime.utils.misc.load_function``, calls it with realistic inputs (against a scripted stand-in
engine where generation is needed) and checks its signature, return shape and side effects.

Point a test at your own plugin with an environment variable named after the flag:

    SLIME_CONTRACT_ROLLOUT_FUNCTION_PATH              --rollout-function-path            (§2.2)
    SLIME_CONTRACT_CUSTOM_GENERATE_FUNCTION_PATH      --custom-generate-function-path    (§2.3)
    SLIME_CONTRACT_CUSTOM_RM_PATH                     --custom-rm-path, single form      (§2.4)
    SLIME_CONTRACT_CUSTOM_RM_PATH_BATCHED             --custom-rm-path, batch form       (§2.4, --group-rm)
    SLIME_CONTRACT_DYNAMIC_SAMPLING_FILTER_PATH       --dynamic-sampling-filter-path     (§2.5)
    SLIME_CONTRACT_BUFFER_FILTER_PATH                 --buffer-filter-path               (§2.6)
    SLIME_CONTRACT_ROLLOUT_SAMPLE_FILTER_PATH         --rollout-sample-filter-path       (§2.7)
    SLIME_CONTRACT_ROLLOUT_ALL_SAMPLES_PROCESS_PATH   --rollout-all-samples-process-path (§2.8)
    SLIME_CONTRACT_CUSTOM_ROLLOUT_LOG_FUNCTION_PATH   --custom-rollout-log-function-path (§2.15)
    SLIME_CONTRACT_CUSTOM_EVAL_ROLLOUT_LOG_FUNCTION_PATH  --custom-eval-rollout-log-function-path (§2.15)
    SLIME_CONTRACT_DATA_SOURCE_PATH                   --data-source-path                 (§2.16)
    SLIME_CONTRACT_EVAL_FUNCTION_PATH                 --eval-function-path               (§2.17)
    SLIME_CONTRACT_ROLLOUT_SAMPLE_HOOK_PATH           --rollout-sample-hook-path         (§2.18)

e.g. ``SLIME_CONTRACT_CUSTOM_RM_PATH=my_pkg.rewards.score pytest tests/plugin_contracts``. Your
module must be importable (the working directory is on ``sys.path``). Generation-dependent hooks
run against the stand-in engine, whose responses are short letter strings ("aab").
"""

import asyncio
import inspect
import json
import os

import pytest

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.data_source import DataSource, RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.sample_hooks import apply_rollout_sample_hooks, set_current_rollout_id
from slime.rollout.sglang_rollout import GenerateState, generate_rollout
from slime.arguments import parse_args
from slime.utils.async_utils import run
from slime.utils.misc import load_function
from slime.utils.types import Sample
from tests.rollout.stand_in_engine import Reply, StandInEngine

PLUGINS = "tests.plugin_contracts.sample_plugins"
DEFAULTS = {
    "rollout_function_path": f"{PLUGINS}.rollout_fn.generate_rollout",
    "custom_generate_function_path": f"{PLUGINS}.generate.generate",
    "custom_rm_path": f"{PLUGINS}.reward.reward",
    "custom_rm_path_batched": f"{PLUGINS}.reward.batched_reward",
    "dynamic_sampling_filter_path": f"{PLUGINS}.filters.keep_if_any_correct",
    "buffer_filter_path": f"{PLUGINS}.filters.pop_last",
    "rollout_sample_filter_path": f"{PLUGINS}.hooks.remove_odd",
    "rollout_all_samples_process_path": f"{PLUGINS}.hooks.record_all",
    "custom_rollout_log_function_path": f"{PLUGINS}.hooks.rollout_log",
    "custom_eval_rollout_log_function_path": f"{PLUGINS}.hooks.eval_log",
    "data_source_path": f"{PLUGINS}.data_source.TaggedDataSource",
    "eval_function_path": f"{PLUGINS}.rollout_fn.generate_rollout",
    "rollout_sample_hook_path": f"{PLUGINS}.hooks.tag_sample",
}


def plugin(attr: str) -> str:
    return os.environ.get(f"SLIME_CONTRACT_{attr.upper()}", DEFAULTS[attr])


def flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


@pytest.fixture(scope="module")
def engine():
    server = StandInEngine(lambda payload: Reply(tokens=[0, 0, 1])).start()  # response "aab"
    yield server
    server.stop()


@pytest.fixture
def data_files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"input": f"question {i}", "label": "aab"}) for i in range(6)) + "\n")
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text(json.dumps({"input": "eval question", "label": "aab"}) + "\n")
    return str(train), str(evaluation)


@pytest.fixture
def make_args(tiny_model_dir, data_files, engine):
    train, evaluation = data_files

    def build(*extra):
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", tiny_model_dir,
            "--prompt-data", train, "--input-key", "input", "--label-key", "label", "--rm-type", "f1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
            "--rollout-max-response-len", "8", "--eval-prompt-data", "toy", evaluation,
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(engine.port), *extra,
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        return args

    return build


def finished_group(args, rewards=(1.0, 0.0)):
    group = []
    for i, reward in enumerate(rewards):
        sample = Sample(group_index=0, index=i, prompt="q", tokens=[1, 2, 3, 4], response="aab", response_length=2,
                        loss_mask=[1, 1], rollout_log_probs=[-0.1, -0.2], reward=reward, label="aab",
                        status=Sample.Status.COMPLETED)  # fmt: skip
        group.append(sample)
    return group


def param_names(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# §2.2
def test_rollout_function(make_args):
    args = make_args(flag("rollout_function_path"), plugin("rollout_function_path"))
    fn = load_function(args.rollout_function_path)
    assert inspect.signature(fn) == inspect.signature(generate_rollout)
    data_source = load_function(args.data_source_path)(args)
    set_current_rollout_id(0)
    output = call_rollout_fn(fn, args, 0, data_source, evaluation=False)
    assert isinstance(output, RolloutFnTrainOutput)
    assert len(output.samples) == args.rollout_batch_size
    for group in output.samples:
        assert len(group) == args.n_samples_per_prompt
        for sample in group:
            assert isinstance(sample, Sample) and isinstance(sample.status, Sample.Status)
            assert all(isinstance(t, int) for t in sample.tokens) and isinstance(sample.response, str)
            assert isinstance(sample.response_length, int) and sample.reward is not None
    assert output.metrics is None or isinstance(output.metrics, dict)


# §2.3
def test_custom_generate_function(make_args):
    args = make_args(flag("custom_generate_function_path"), plugin("custom_generate_function_path"))
    fn = load_function(args.custom_generate_function_path)
    assert inspect.iscoroutinefunction(fn)
    assert param_names(fn)[:3] == ["args", "sample", "sampling_params"]
    sampling_params = dict(GenerateState(args).sampling_params)
    kwargs = {"evaluation": False} if "evaluation" in param_names(fn) else {}
    prompt = Sample(prompt="question 0", index=0, group_index=0, label="aab")
    result = run(fn(args, prompt, sampling_params, **kwargs))
    samples = result if isinstance(result, list) else [result]
    assert samples and all(isinstance(s, Sample) for s in samples)
    if len(samples) > 1:
        assert samples[0].rollout_id is not None and len({s.rollout_id for s in samples}) == 1
    for sample in samples:
        assert sample.status != Sample.Status.PENDING and sample.tokens and isinstance(sample.response, str)
        assert 0 < sample.response_length <= len(sample.tokens)
        for per_token in (sample.loss_mask, sample.rollout_log_probs):
            assert per_token is None or len(per_token) == sample.response_length
    assert sampling_params == GenerateState(args).sampling_params  # not mutated


# §2.4
def test_custom_rm_single(make_args):
    args = make_args(flag("custom_rm_path"), plugin("custom_rm_path"))
    fn = load_function(args.custom_rm_path)
    assert inspect.iscoroutinefunction(fn), "--custom-rm-path must be `async def reward(args, sample, **kwargs)`"
    assert param_names(fn)[:2] == ["args", "sample"]
    sample = finished_group(args)[0]
    sample.reward = None
    reward = asyncio.run(fn(args, sample))
    assert isinstance(reward, (int, float, dict))
    if isinstance(reward, dict):
        assert args.reward_key in reward, "dict rewards need --reward-key naming one of their keys"


def test_custom_rm_batched(make_args):
    args = make_args("--group-rm", flag("custom_rm_path"), plugin("custom_rm_path_batched"))
    fn = load_function(args.custom_rm_path)
    assert inspect.iscoroutinefunction(fn) and param_names(fn)[:2] == ["args", "samples"]
    group = finished_group(args, rewards=(None, None, None))
    rewards = asyncio.run(fn(args, group))
    assert isinstance(rewards, list) and len(rewards) == len(group)
    assert all(isinstance(r, (int, float, dict)) for r in rewards)


# §2.5
def test_dynamic_sampling_filter(make_args):
    args = make_args(flag("dynamic_sampling_filter_path"), plugin("dynamic_sampling_filter_path"))
    fn = load_function(args.dynamic_sampling_filter_path)
    assert not inspect.iscoroutinefunction(fn) and param_names(fn)[:2] == ["args", "samples"]
    for rewards in [(1.0, 0.0), (0.0, 0.0), (1.0, 1.0)]:
        verdict = fn(args, finished_group(args, rewards))
        assert isinstance(verdict, (bool, DynamicFilterOutput))
        if isinstance(verdict, DynamicFilterOutput):
            assert isinstance(verdict.keep, bool) and (verdict.reason is None or isinstance(verdict.reason, str))


# §2.6
def test_buffer_filter(make_args):
    args = make_args(flag("buffer_filter_path"), plugin("buffer_filter_path"))
    fn = load_function(args.buffer_filter_path)
    assert param_names(fn)[:4] == ["args", "rollout_id", "buffer", "num_samples"]
    buffer = [finished_group(args) for _ in range(3)]
    before = [id(g) for g in buffer]
    taken = fn(args, None, buffer, 2)
    assert isinstance(taken, list) and len(taken) <= 2 and all(isinstance(g, list) for g in taken)
    assert sorted([id(g) for g in taken] + [id(g) for g in buffer]) == sorted(before)  # moved out of the buffer
    source = RolloutDataSourceWithBuffer(args)  # used by the built-in source
    source.add_samples(source.get_samples(2))
    assert len(source.get_samples(1)) == 1 and source.get_buffer_length() == 1


# §2.7
def test_rollout_sample_filter(make_args):
    args = make_args(flag("rollout_sample_filter_path"), plugin("rollout_sample_filter_path"))
    fn = load_function(args.rollout_sample_filter_path)
    assert param_names(fn)[:2] == ["args", "groups"]
    groups = [finished_group(args), finished_group(args)]
    rewards = [s.reward for g in groups for s in g]
    assert fn(args, groups) is None
    assert all(isinstance(s.remove_sample, bool) for g in groups for s in g)
    assert [s.reward for g in groups for s in g] == rewards


# §2.8
def test_rollout_all_samples_process(make_args):
    args = make_args(flag("rollout_all_samples_process_path"), plugin("rollout_all_samples_process_path"))
    fn = load_function(args.rollout_all_samples_process_path)
    assert param_names(fn)[:3] == ["args", "all_groups", "data_source"]
    source = RolloutDataSourceWithBuffer(args)
    assert fn(args, [finished_group(args), finished_group(args, (0.0, 0.0))], source) is None


# §2.15
def test_rollout_log_function(make_args):
    args = make_args(flag("custom_rollout_log_function_path"), plugin("custom_rollout_log_function_path"))
    fn = load_function(args.custom_rollout_log_function_path)
    assert param_names(fn) == ["rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"]
    assert isinstance(fn(0, args, finished_group(args), None, 1.5), bool)


def test_eval_rollout_log_function(make_args):
    args = make_args(flag("custom_eval_rollout_log_function_path"), plugin("custom_eval_rollout_log_function_path"))
    fn = load_function(args.custom_eval_rollout_log_function_path)
    assert param_names(fn) == ["rollout_id", "args", "data", "extra_metrics"]
    group = finished_group(args)
    data = {"toy": {"rewards": [1.0, 0.0], "truncated": [False, False], "samples": group}}
    assert isinstance(fn(0, args, data, None), bool)


# §2.16
def test_data_source(make_args, tmp_path):
    args = make_args(flag("data_source_path"), plugin("data_source_path"), "--save", str(tmp_path / "ckpt"))
    cls = load_function(args.data_source_path)
    assert param_names(cls.__init__)[:2] == ["self", "args"]
    source = cls(args)
    for method in ("get_samples", "add_samples", "save", "load", "__len__"):
        assert callable(getattr(source, method, None)), f"data source lacks {method}"
    assert isinstance(source, DataSource) or True  # subclassing the ABC is recommended, not required
    assert len(source) == 6
    groups = source.get_samples(2)
    assert len(groups) == 2 and all(len(g) == args.n_samples_per_prompt for g in groups)
    assert all(isinstance(s, Sample) and s.index is not None for g in groups for s in g)
    source.save(0)
    expected = source.get_samples(2)
    resumed_args = make_args(flag("data_source_path"), plugin("data_source_path"))
    resumed_args.load = str(tmp_path / "ckpt")
    resumed = cls(resumed_args)
    resumed.load(0)
    assert [[s.index for s in g] for g in resumed.get_samples(2)] == [[s.index for s in g] for g in expected]


# §2.17
def test_eval_function(make_args):
    args = make_args(flag("eval_function_path"), plugin("eval_function_path"))
    fn = load_function(args.eval_function_path)
    assert inspect.signature(fn) == inspect.signature(generate_rollout)
    output = call_rollout_fn(fn, args, 0, None, evaluation=True)
    assert isinstance(output, RolloutFnEvalOutput) and set(output.data) == {"toy"}
    for result in output.data.values():
        assert len(result["rewards"]) == len(result["truncated"]) == len(result["samples"]) > 0
        assert all(isinstance(r, (int, float)) for r in result["rewards"])


# §2.18
def test_rollout_sample_hook(make_args):
    args = make_args(flag("rollout_sample_hook_path"), plugin("rollout_sample_hook_path"))
    assert isinstance(args.rollout_sample_hook_path, list) and len(args.rollout_sample_hook_path) == 1
    hook = load_function(args.rollout_sample_hook_path[0])
    params = inspect.signature(hook).parameters
    assert list(params)[:2] == ["args", "sample"]
    sample = finished_group(args)[0]
    result = hook(args, sample, **{k: v for k, v in {"rollout_id": 5, "evaluation": False}.items()
                                   if k in params or any(p.kind is p.VAR_KEYWORD for p in params.values())})  # fmt: skip
    if inspect.isawaitable(result):
        result = asyncio.run(result)
    assert result is None or isinstance(result, Sample)
    set_current_rollout_id(9)
    nested = [finished_group(args), [finished_group(args)[0], finished_group(args)[1]]]
    out = asyncio.run(apply_rollout_sample_hooks(args, nested, evaluation=True))
    assert isinstance(out, list) and out is not nested and len(out) == 2 and len(out[1]) == 2
    assert all(isinstance(s, Sample) for g in out for s in g)
    args.rollout_sample_hook_path.append(f"{PLUGINS}.hooks.replace_sample")
    replaced = asyncio.run(apply_rollout_sample_hooks(args, finished_group(args)[0]))
    assert replaced.metadata["replaced"] is True
    args.rollout_sample_hook_path = []
    single = finished_group(args)[0]
    assert asyncio.run(apply_rollout_sample_hooks(args, single)) is single
