"""Data sources: grouping and indices, epochs with shuffling, buffer first, save/load resumes exactly."""

import json

import pytest

from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer, pop_first
from slime.rollout.sft_rollout import generate_rollout as sft_generate_rollout
from slime.arguments import parse_args
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample


def make_args(model_dir, prompt_path, *extra):
    return parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
        "--prompt-data", prompt_path, "--input-key", "input", "--label-key", "label",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "4", *extra,
    ])  # fmt: skip


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"input": f"q{i}", "label": str(i)}) for i in range(5)) + "\n")
    return str(path)


def _ids(groups):
    return [[(s.prompt, s.group_index, s.index) for s in g] for g in groups]


def test_groups_indices_and_epochs(tiny_model_dir, prompts):
    source = RolloutDataSource(make_args(tiny_model_dir, prompts))
    assert len(source) == 5
    groups = source.get_samples(3)
    assert _ids(groups)[0] == [("q0", 0, 0), ("q0", 0, 1)]
    assert groups[0][0] is not groups[0][1] and groups[2][1].index == 5
    groups = source.get_samples(3)  # wraps into epoch 1
    assert [g[0].prompt for g in groups] == ["q3", "q4", "q0"] and source.epoch_id == 1
    with pytest.raises(RuntimeError, match="read-only"):
        source.add_samples([])


def test_shuffle_per_epoch(tiny_model_dir, prompts):
    source = RolloutDataSource(make_args(tiny_model_dir, prompts, "--rollout-shuffle", "--rollout-seed", "3"))
    epoch0 = [g[0].prompt for g in source.get_samples(5)]
    epoch1 = [g[0].prompt for g in source.get_samples(5)]
    assert sorted(epoch0) == sorted(epoch1) == [f"q{i}" for i in range(5)] and epoch0 != epoch1


def test_buffer_first_then_dataset(tiny_model_dir, prompts):
    source = RolloutDataSourceWithBuffer(make_args(tiny_model_dir, prompts))
    back = source.get_samples(1)
    source.add_samples(back)
    assert source.get_buffer_length() == 1
    groups = source.get_samples(2)
    assert [g[0].prompt for g in groups] == ["q0", "q1"] and groups[0] is back[0]
    buffer = [[Sample(index=i)] for i in range(3)]
    assert [g[0].index for g in pop_first(None, None, buffer, 2)] == [0, 1] and len(buffer) == 1


def too_greedy_filter(args, rollout_id, buffer, num_samples):
    return list(buffer) + list(buffer)


def test_buffer_filter_path_and_errors(tiny_model_dir, prompts):
    args = make_args(tiny_model_dir, prompts, "--buffer-filter-path", "tests.rollout.test_data_source.too_greedy_filter")
    source = RolloutDataSourceWithBuffer(args)
    source.add_samples(source.get_samples(1))
    with pytest.raises(ValueError, match="buffer filter returned 2 groups but only 1 were asked for"):
        source.get_samples(1)
    with pytest.raises(ValueError, match="saving the data-source state needs --save"):
        source.save(0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_save_load_hands_out_identical_next_batch(tiny_model_dir, prompts, tmp_path, shuffle):
    ckpt = str(tmp_path / "ckpt")
    extra = ["--save", ckpt] + (["--rollout-shuffle"] if shuffle else [])
    original = RolloutDataSourceWithBuffer(make_args(tiny_model_dir, prompts, *extra))
    original.get_samples(2)
    original.get_samples(2)
    partial = original.get_samples(1)
    partial[0][0].tokens, partial[0][0].response_length = [1, 2, 3], 1
    partial[0][0].status, partial[0][0].metadata["start_rollout_id"] = Sample.Status.ABORTED, 1
    original.add_samples(partial)
    original.update_metadata({"note": 1})
    original.save(1)

    resumed_args = make_args(tiny_model_dir, prompts, *extra)
    resumed_args.load = ckpt  # validation rewrites --load for non-Megatron dirs; set it as train.py would
    resumed = RolloutDataSourceWithBuffer(resumed_args)
    resumed.load(1)
    assert resumed.get_metadata() == {"note": 1} and resumed.epoch_id == original.epoch_id
    expected, got = original.get_samples(4), resumed.get_samples(4)  # buffer + epoch wrap
    assert _ids(got) == _ids(expected)
    assert got[0][0].tokens == [1, 2, 3] and got[0][0].status == Sample.Status.ABORTED
    assert [g[0].label for g in got] == [g[0].label for g in expected]
    fresh = RolloutDataSourceWithBuffer(resumed_args)
    fresh.load(7)  # no state for step 7: starts from the beginning
    assert fresh.get_samples(1)[0][0].index == 0


def test_sft_rollout(tiny_model_dir, tmp_path):
    path = tmp_path / "sft.jsonl"
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": conv}) + "\n")
    args = make_args(tiny_model_dir, str(path), "--input-key", "messages", "--label-key", "", "--n-samples-per-prompt",
                     "1", "--rollout-batch-size", "1")  # fmt: skip
    source = RolloutDataSourceWithBuffer(args)
    out = sft_generate_rollout(args, 0, source)
    sample = out.samples[0][0]
    tok = load_tokenizer(tiny_model_dir)
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    assert tok.decode(response).startswith("hello<|im_end|>")
    assert sample.loss_mask[0] == 1 and len(sample.loss_mask) == sample.response_length and sample.reward == 0
    with pytest.raises(ValueError, match="no evaluation mode"):
        sft_generate_rollout(args, 0, source, evaluation=True)
