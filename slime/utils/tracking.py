"""Where metrics go: ``metrics.jsonl`` in the run directory (every metric of every step),
TensorBoard (``--use-tensorboard``) and Weights & Biases (``--use-wandb``; offline mode needs no
network) see the same flat ``{"rollout/...": x, "train/...": y}`` dictionaries; the console shows a
progress bar or short step lines with the headline metrics (:mod:`slime.utils.progress`) and every
evaluation."""

from __future__ import annotations

import json
import logging
import math
import os
import time

from slime.utils.progress import StepProgress

logger = logging.getLogger(__name__)



def _scalar(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return value
    return None


class Tracker:
    def __init__(self, args):
        self.args = args
        self.run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self._file = open(self.metrics_path, "a")
        self._tb = None
        self._wandb = None
        self.progress = StepProgress(args)
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = args.tb_project_name or os.environ.get("TENSORBOARD_DIR") or os.path.join(self.run_dir, "tensorboard")
            self._tb = SummaryWriter(os.path.join(log_dir, args.tb_experiment_name or ""))
        if args.use_wandb:
            self._init_wandb()

    def _init_wandb(self) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError("--use-wandb needs wandb: `pip install -e '.[wandb]'`") from None
        args = self.args
        if args.wandb_key:
            wandb.login(key=args.wandb_key, host=args.wandb_host)
        name = args.wandb_group or "slime"
        if args.wandb_random_suffix:
            name = f"{name}-{os.urandom(3).hex()}"
        self._wandb = wandb.init(project=args.wandb_project or "slime", entity=args.wandb_team, group=args.wandb_group,
                                 name=name, dir=args.wandb_dir or self.run_dir, mode=args.wandb_mode,
                                 id=args.wandb_run_id, resume="allow" if args.wandb_run_id else None,
                                 config={k: v for k, v in vars(args).items() if _scalar(v) is not None or isinstance(v, str)})

    def log(self, metrics: dict, step: int, kind: str) -> None:
        clean = {k: _scalar(v) for k, v in metrics.items()}
        clean = {k: v for k, v in clean.items() if v is not None}
        record = {"kind": kind, "step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**clean, f"{kind}/step": step})

    def console(self, step: int, metrics: dict) -> None:
        """Rollout step ``step`` is done: advance the progress bar (or print its line)."""
        self.progress.step(step, {k: _scalar(v) for k, v in metrics.items() if _scalar(v) is not None})

    def console_eval(self, step: int, metrics: dict) -> None:
        """An evaluation's scores (``eval/<name>``, pass@k), as a line of its own:
        ``eval after step N | eval/<name>=x ...``; the other eval metrics are in metrics.jsonl."""
        parts = [f"eval after step {step}"]
        for key in sorted(metrics):
            name = key[len("eval/"):]
            if key.startswith("eval/") and "/" not in name and not name.endswith("-truncated_ratio") \
                    and _scalar(metrics[key]) is not None:
                parts.append(f"{key}={_scalar(metrics[key]):.4g}")
        self.progress.message(" | ".join(parts))

    def close(self) -> None:
        self.progress.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
