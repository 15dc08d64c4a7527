"""What the console shows while a run goes: a progress bar over the rollout steps, or short lines.

* On a terminal: one tqdm bar (steps done / ``--num-rollout``, rate, time left) whose postfix holds
  the last step's headline metrics; evaluation results are printed above it as lines of their own.
* Elsewhere (CI logs, ``> file``, ``nohup``): a line for the first step, then every
  ``--console-log-interval`` steps (default: about 20 lines per run) and the last step, each with
  the step count, the mean step time, the time left and the headline metrics; evaluations always.

Every metric of every step is in ``metrics.jsonl`` whatever the console shows. A supervised run
(``--loss-type sft_loss``) has no rewards, so its console lines leave the reward keys out.
"""

from __future__ import annotations

import math
import sys
import time

__all__ = ["StepProgress", "headline"]

#: (metric, label) shown per step, in this order, when the step has the metric; of keys sharing a
#: label only the first present is shown (an RL step's pg_loss, an SFT step's loss)
HEADLINE = (
    ("rollout/raw_reward/mean", "reward"), ("rollout/raw_reward", "reward"), ("train/pg_loss", "pg_loss"),
    ("train/loss", "pg_loss"), ("train/ppo_kl", "ppo_kl"), ("train/grad_norm", "grad_norm"),
    ("rollout/response_len/mean", "resp_len"), ("perf/step_time", "step_s"),
)
REWARD_KEYS = ("rollout/raw_reward", "rollout/rewards")
STEP_LINES_PER_RUN = 20  # non-terminal output: about this many step lines


def _format(value: float) -> str:
    return f"{value:.4g}"


def headline(metrics: dict, supervised: bool = False) -> str:
    """``reward=0.41 loss=0.12 ...`` of a step's metrics (reward keys left out for supervised runs)."""
    parts, seen = [], set()
    for key, label in HEADLINE:
        if key not in metrics or label in seen or (supervised and key.startswith(REWARD_KEYS)):
            continue
        value = metrics[key]
        if isinstance(value, (int, float)) and math.isfinite(value):
            shown = "loss" if key == "train/loss" else label
            parts.append(f"{shown}={_format(value)}")
            seen.add(label)
    return " ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class StepProgress:
    """The console view of a run's rollout steps (see the module docstring)."""

    def __init__(self, args, stream=None):
        self.stream = stream if stream is not None else sys.stdout
        self.total = args.num_rollout
        self.supervised = args.loss_type == "sft_loss"
        self.interval = args.console_log_interval
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = None
        self._first_step: int | None = None
        self._first_step_time: float | None = None
        self._started = None

    def _interval(self) -> int:
        if self.interval:
            return self.interval
        return max(1, math.ceil((self.total or STEP_LINES_PER_RUN) / STEP_LINES_PER_RUN))

    def step(self, rollout_id: int, metrics: dict) -> None:
        """After rollout step ``rollout_id`` finished, with that step's metrics."""
        if self._first_step is None:
            self._first_step, self._started = rollout_id, time.perf_counter()
            self._first_step_time = metrics.get("perf/step_time")
        summary = headline(metrics, self.supervised)
        if self.interactive:
            self._update_bar(rollout_id, summary)
            return
        done = rollout_id - self._first_step + 1
        last = self.total is not None and rollout_id + 1 >= self.total
        if done == 1 or last or (rollout_id + 1) % self._interval() == 0:
            self._print(f"{self._position(rollout_id)} | {self._timing(rollout_id, done)} | {summary}")

    def message(self, text: str) -> None:
        """A line that stays (evaluations): above the bar on a terminal."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self._print(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ------------------------------------------------------------------ internals

    def _position(self, rollout_id: int) -> str:
        if self.total:
            return f"step {rollout_id + 1}/{self.total} ({100 * (rollout_id + 1) // self.total}%)"
        return f"step {rollout_id + 1}"

    def _timing(self, rollout_id: int, done: int) -> str:
        # wall time since the first step ended (saves and evaluations included, as the time left will);
        # for the first step itself, its own step time
        if done > 1:
            per_step = (time.perf_counter() - self._started) / (done - 1)
        elif self._first_step_time is not None:
            per_step = self._first_step_time
        else:
            return "first step"
        text = f"{per_step:.2f} s/step"
        if self.total:
            text += f", {_duration(per_step * max(self.total - rollout_id - 1, 0))} left"
        return text

    def _update_bar(self, rollout_id: int, summary: str) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=rollout_id, desc="rollout steps", unit="step",
                             file=self.stream, dynamic_ncols=True)
        self._bar.set_postfix_str(summary, refresh=False)
        self._bar.update(rollout_id + 1 - self._bar.n)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
