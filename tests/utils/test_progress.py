"""The console during a run: a tqdm bar on a terminal, short step lines elsewhere, evaluations always,
no reward keys for supervised runs; metrics.jsonl keeps every step."""

import io
import json
from types import SimpleNamespace

from slime.utils.progress import StepProgress
from slime.utils.tracking import Tracker


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _args(tmp_path, **overrides):
    values = dict(run_dir=str(tmp_path / "run"), use_tensorboard=False, use_wandb=False, num_rollout=50,
                  loss_type="policy_loss", console_log_interval=None)
    values.update(overrides)
    return SimpleNamespace(**values)


def _step_metrics(step):
    return {"rollout/raw_reward/mean": step / 100, "rollout/raw_reward/std": 0.1, "train/pg_loss": 0.5,
            "train/grad_norm": 1.25, "perf/step_time": 2.0, "rollout/zero_std/count_0": 3}


def _run(tracker, steps=range(50)):
    for step in steps:
        for kind in ("rollout", "train", "perf"):
            tracker.log(_step_metrics(step), step, kind)
        if step == 9:
            tracker.console_eval(10, {"eval/heldout": 0.44, "eval/heldout/response_len/mean": 5.0,
                                      "eval/heldout-truncated_ratio": 0.0, "eval/heldout-pass@2": 0.5})
        tracker.console(step, _step_metrics(step))
    tracker.close()


def test_log_file_gets_a_few_readable_step_lines(tmp_path):
    tracker = Tracker(_args(tmp_path))
    tracker.progress = StepProgress(tracker.args, stream=io.StringIO())
    stream = tracker.progress.stream
    _run(tracker)
    lines = stream.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert 15 <= len(steps) <= 21  # not 50: the first, every 3rd, the last
    assert steps[0].startswith("step 1/50 (2%) | ") and steps[-1].startswith("step 50/50 (100%) | ")
    assert "s/step" in steps[0] and "left" in steps[0]
    assert "reward=0.49" in steps[-1] and "pg_loss=0.5" in steps[-1] and "grad_norm=1.25" in steps[-1]
    assert "2.00 s/step" in steps[0]  # the first step: its own step time
    assert "zero_std" not in stream.getvalue() and "\r" not in stream.getvalue()
    assert "eval after step 10 | eval/heldout=0.44 | eval/heldout-pass@2=0.5" in lines  # evaluations always, scores only
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(records) == 3 * 50 and all("rollout/raw_reward/mean" in r for r in records)  # every step kept


def test_console_log_interval_and_resumed_runs(tmp_path):
    stream = io.StringIO()
    progress = StepProgress(_args(tmp_path, console_log_interval=10), stream=stream)
    for step in range(20, 50):  # resumed at step 20
        progress.step(step, _step_metrics(step))
    steps = [line.split(" | ")[0] for line in stream.getvalue().splitlines()]
    assert steps == ["step 21/50 (42%)", "step 30/50 (60%)", "step 40/50 (80%)", "step 50/50 (100%)"]


def test_supervised_runs_show_no_rewards(tmp_path):
    stream = io.StringIO()
    progress = StepProgress(_args(tmp_path, loss_type="sft_loss", num_rollout=3), stream=stream)
    for step in range(3):
        progress.step(step, {"rollout/raw_reward/mean": 0.0, "rollout/rewards": 0.0, "train/loss": 1.5 - step / 10})
    text = stream.getvalue()
    assert "reward" not in text and "loss=1.3" in text and "pg_loss" not in text


def test_terminal_gets_one_progress_bar(tmp_path):
    tracker = Tracker(_args(tmp_path))
    terminal = Terminal()
    tracker.progress = StepProgress(tracker.args, stream=terminal)
    _run(tracker)
    text = terminal.getvalue()
    assert "rollout steps" in text and "50/50" in text and "reward=0.49" in text  # the bar, at its end
    assert text.count("\n") == 2  # the bar redraws in place (\r): only the eval line and the bar's end stay
    assert "\reval after step 10 | eval/heldout=0.44 | eval/heldout-pass@2=0.5\n" in text  # the eval line, printed above the bar
