"""slime.rollout.forge_load.generate_rollout replays --save-debug-rollout-data dumps (docs/INTERFACES.md §3.1)."""

from argparse import Namespace

import pytest
import torch

from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.forge_load import generate_rollout
from slime.utils.types import Sample


def _samples(step, n=3):
    return [Sample(index=step * 10 + i, prompt=f"p{i}", tokens=[1, 2, 3 + i], response=f"r{i}", response_length=1,
                   reward={"acc": float(i), "fmt": 1.0}, rollout_id=100 * step + i,
                   status=Sample.Status.TRUNCATED if i == 2 else Sample.Status.COMPLETED) for i in range(n)]


def _args(template, **kw):
    return Namespace(load_forge_rollout_data=template, reward_key="acc", **kw)


def test_each_step_replays_its_own_dump_and_a_step_without_one_replays_step_zero(tmp_path):
    template = str(tmp_path / "dump" / "{rollout_id}.pt")
    for step in (0, 1):
        save_debug_rollout_data(template, _samples(step), rollout_id=step, evaluation=False)
    args = _args(template)
    out = {step: call_rollout_fn(generate_rollout, args, step, None, evaluation=False) for step in (0, 1, 5)}
    assert all(isinstance(o, RolloutFnTrainOutput) for o in out.values())
    assert [s.index for s in out[1].samples] == [10, 11, 12]
    assert [s.rollout_id for s in out[1].samples] == [100, 101, 102]  # the stored ids, not the step's
    assert [s.tokens for s in out[5].samples] == [s.tokens for s in _samples(0)]
    assert [s.index for s in out[5].samples] == [0, 1, 2]
    assert out[1].samples[2].status == Sample.Status.TRUNCATED and out[1].samples[0].reward == {"acc": 0.0, "fmt": 1.0}


def test_a_literal_path_is_replayed_every_step(tmp_path):
    path = str(tmp_path / "batch.pt")
    save_debug_rollout_data(path, _samples(3), rollout_id=3, evaluation=False)
    for step in (0, 7):
        assert [s.index for s in generate_rollout(_args(path), step, None).samples] == [30, 31, 32]


def test_evaluation_replays_the_eval_dump_as_forge_eval_and_is_empty_without_one(tmp_path):
    template = str(tmp_path / "{rollout_id}.pt")
    save_debug_rollout_data(template, _samples(4), rollout_id=4, evaluation=True)
    out = call_rollout_fn(generate_rollout, _args(template), 4, None, evaluation=True)
    assert isinstance(out, RolloutFnEvalOutput) and list(out.data) == ["forge_eval"]
    data = out.data["forge_eval"]
    assert data["rewards"] == [0.0, 1.0, 2.0]  # reduced with --reward-key
    assert data["truncated"] == [False, False, True]
    assert [s.index for s in data["samples"]] == [40, 41, 42]
    assert generate_rollout(_args(template), 5, None, evaluation=True).data == {}
    # beside a literal training path: eval_<id>.pt in its folder
    literal = str(tmp_path / "train.pt")
    assert list(generate_rollout(_args(literal), 4, None, evaluation=True).data) == ["forge_eval"]


def test_missing_or_foreign_dumps_are_named(tmp_path):
    with pytest.raises(ValueError, match="needs --load-forge-rollout-data"):
        generate_rollout(_args(None), 0, None)
    with pytest.raises(FileNotFoundError, match=r"rollout 2 at .*2\.pt"):
        generate_rollout(_args(str(tmp_path / "{rollout_id}.pt")), 2, None)
    foreign = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, foreign)
    with pytest.raises(ValueError, match=r"weights\.pt is not a rollout dump"):
        generate_rollout(_args(str(foreign)), 0, None)
