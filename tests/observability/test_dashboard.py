"""Run dashboard: metrics.jsonl -> PNG plots and one HTML page (users without wandb)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime.observability.dashboard import PANELS, panel_keys, read_metrics, render_dashboard
from slime.utils.tracking import Tracker
from tests.parsed_args import default_args

ROOT = Path(__file__).resolve().parents[2]
REAL_RUN = Path(__file__).parent / "data" / "real_run_metrics.jsonl"
PNG = b"\x89PNG\r\n\x1a\n"


def tracker_args(run_dir):
    return default_args(run_dir=str(run_dir))


def test_real_run_renders_every_panel(tmp_path):
    """A metrics.jsonl written by a real 4-step CPU run of train.py (GRPO, tiny model; see data/README.md)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(REAL_RUN, run / "metrics.jsonl")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "run_dashboard.py"), str(run)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = run / "dashboard"
    assert sorted(p.stem for p in out.glob("*.png")) == sorted(
        ["reward", "response_length", "kl", "entropy", "loss", "step_time", "throughput"])
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 8_000, png
    page = (out / "index.html").read_text()
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 7  # self-contained: images inline
    assert "rollout/raw_reward/mean" in page and "4 steps (0–3)" in page


def test_panels_pick_the_right_series(tmp_path):
    tracker = Tracker(tracker_args(tmp_path))
    for step in range(3):
        tracker.log({"rollout/raw_reward/mean": 0.1 * step, "rollout/response_len/mean": 4.0,
                     "perf/rollout_time": 1.0, "perf/actor_train_time": 0.5}, step, "rollout")
        tracker.log({"train/ppo_kl": 0.0, "train/entropy_loss": 2.0, "train/pg_loss": 0.3}, step, "train")
        tracker.log({"perf/rollout_time": 1.5, "perf/train_time": 2.0, "perf/step_time": 3.6}, step, "perf")
        tracker.log({"eval/math": 0.5, "eval/math-truncated_ratio": 0.0}, step, "eval")
    tracker.log({"perf/rollout_time": 9.0, "perf/train_time": 2.0, "perf/step_time": 11.0}, 2, "perf")  # resumed
    tracker.close()
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert series["perf/rollout_time"] == {0: 1.5, 1: 1.5, 2: 9.0}  # the perf record wins; a step's last value
    keys = {panel.name: panel_keys(panel, series) for panel in PANELS}
    assert keys["reward"] == ["eval/math", "rollout/raw_reward/mean"]
    assert keys["step_time"] == ["perf/rollout_time", "perf/train_time"]  # no sub-phase, no total (drawn as line)
    assert keys["kl"] == ["train/ppo_kl"] and keys["entropy"] == ["train/entropy_loss"]
    result = render_dashboard(tmp_path)
    assert set(result["plots"]) == {"reward", "response_length", "kl", "entropy", "loss", "step_time"}


def test_bad_inputs_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        render_dashboard(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "train/loss": 1.0}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        render_dashboard(tmp_path)
    result = subprocess.run([sys.executable, "-m", "slime.observability.dashboard", str(tmp_path)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "metrics.jsonl:2" in result.stderr
