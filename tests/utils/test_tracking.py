import json

from slime.utils.tracking import Tracker
from tests.parsed_args import default_args


def _args(tmp_path, **overrides):
    return default_args(**{"run_dir": str(tmp_path / "run"), "num_rollout": None, **overrides})  # no known total


def test_metrics_jsonl_and_console(tmp_path, capsys):
    tracker = Tracker(_args(tmp_path))
    tracker.log({"train/pg_loss": 0.5, "rollout/raw_reward/mean": 1, "bad": float("nan"), "text": "x"}, 3, "train")
    tracker.console(3, {"train/pg_loss": 0.5, "perf/step_time": 2.0, "other/thing": 1})  # no terminal: a line
    tracker.close()
    (record,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert record["kind"] == "train" and record["step"] == 3
    assert record["train/pg_loss"] == 0.5 and "bad" not in record and "text" not in record
    line = capsys.readouterr().out
    assert line.startswith("step 4 | 2.00 s/step | ") and "pg_loss=0.5" in line and "step_s=2" in line and "other" not in line


def test_tensorboard_receives_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(_args(tmp_path, use_tensorboard=True, tb_project_name=str(tmp_path / "tb")))
    for step in range(3):
        tracker.log({"rollout/raw_reward/mean": step / 2}, step, "rollout")
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("rollout/raw_reward/mean")] == [0.0, 0.5, 1.0]
