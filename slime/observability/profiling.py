"""The torch profiler and CUDA memory history around chosen rollout steps, written into the run directory.

* ``--use-pytorch-profiler`` (or any ``--profile-target``) profiles the rollout steps
  ``--profile-step-start`` ≤ rollout_id < ``--profile-step-end``:

  - train targets — ``train_overall`` (a rank's whole ``train`` call; ``train`` is its short name),
    ``train_actor`` (the optimizer steps: forward, backward, optimizer), ``train_log_probs`` (the
    forward-only π_old / reference passes) — on the ranks in ``--profile-ranks``, one Chrome trace per
    step and target: ``<run-dir>/profile/<role>-<target>-rollout_<id>-rank<r>.trace.json``, beside it
    the operator table (``.ops.txt``). When an outer target is already being recorded, an inner one
    only labels its span (one torch profiler runs at a time);
  - ``rollout`` — every engine's ``/start_profile`` before the step's generation and
    ``/stop_profile`` after it (SGLang and the embedded engine both serve them), traces in
    ``<run-dir>/profile/rollout/``.

  Every phase is also labelled ``slime/<target>`` with ``record_function``, so a profile taken
  another way (nsys, an outer ``torch.profiler``) shows the same spans.
* ``--record-memory-history`` (CUDA only; refused at start-up without it) records the allocator's
  history from the trainer's start and dumps ``torch.cuda.memory._dump_snapshot`` pickles (open them
  at https://pytorch.org/memory_viz) into ``--memory-snapshot-dir`` (default ``<run-dir>/memory``):
  after each rollout step, or once after ``--memory-snapshot-num-steps`` steps, then recording stops.
"""

from __future__ import annotations

import contextlib
import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["TRAIN_TARGETS", "PROFILE_TARGETS", "TrainProfiler", "profile_rollout", "profile_dir",
           "memory_snapshot_dir"]

TRAIN_TARGETS = ("train_overall", "train_actor", "train_log_probs")
PROFILE_TARGETS = (*TRAIN_TARGETS, "train", "rollout")  # "train" = train_overall
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept (a ring buffer: older ones are dropped)


def profiled_targets(args) -> set[str]:
    """The targets the profiler records in this run (empty when profiling is off)."""
    if not args.use_pytorch_profiler:
        return set()
    return {"train_overall" if t == "train" else t for t in (args.profile_target or ["train_overall"])}


def profiles_step(args, rollout_id: int) -> bool:
    return args.profile_step_start <= rollout_id < args.profile_step_end


def _run_dir(args) -> str:
    if not args.run_dir:
        raise ValueError("profiles and memory snapshots are written into the run directory: set --run-dir")
    return args.run_dir


def profile_dir(args) -> str:
    return os.path.join(_run_dir(args), "profile")


def memory_snapshot_dir(args) -> str:
    return args.memory_snapshot_dir or os.path.join(_run_dir(args), "memory")


class TrainProfiler:
    """One training rank's profiler: ``with profiler.phase("train_actor"):`` around each phase."""

    def __init__(self, args, rank: int, role: str):
        self.args, self.rank, self.role = args, rank, role
        on_rank = rank in (args.profile_ranks or [0])
        self.targets = profiled_targets(args) & set(TRAIN_TARGETS) if on_rank else set()
        self.rollout_id: int | None = None  # the rollout step being trained (set by the worker)
        self.written: list[str] = []  # trace files of this rank, in order
        self._recording = False
        self._memory_steps = 0
        self._memory_on = bool(args.record_memory_history)
        if self._memory_on:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("--record-memory-history needs CUDA (torch.cuda.memory records the CUDA "
                                   "allocator); this training rank has no GPU")
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    @contextlib.contextmanager
    def phase(self, target: str):
        """Label the phase; record it with the torch profiler when it is a chosen target and step."""
        from torch.profiler import record_function

        record = (target in self.targets and not self._recording and self.rollout_id is not None
                  and profiles_step(self.args, self.rollout_id))
        if not record:
            with record_function(f"slime/{target}"):
                yield
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._recording = True
        try:
            with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
                with record_function(f"slime/{target}"):
                    yield
        finally:
            self._recording = False
        self._export(profile, target)

    def _export(self, profile, target: str) -> None:
        directory = profile_dir(self.args)
        os.makedirs(directory, exist_ok=True)
        stem = os.path.join(directory, f"{self.role}-{target}-rollout_{self.rollout_id}-rank{self.rank}")
        profile.export_chrome_trace(stem + ".trace.json")
        import torch

        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(stem + ".ops.txt", "w") as f:
            f.write(profile.key_averages().table(sort_by=sort_by, row_limit=40))
        self.written.append(stem + ".trace.json")
        logger.info("profile of %s, rollout step %d written to %s.trace.json", target, self.rollout_id, stem)

    def step_done(self, rollout_id: int) -> None:
        """After a rollout step's training: write the memory snapshot when one is due."""
        if not self._memory_on:
            return
        import torch

        self._memory_steps += 1
        every_step = self.args.memory_snapshot_num_steps is None
        if not every_step and self._memory_steps < self.args.memory_snapshot_num_steps:
            return
        directory = memory_snapshot_dir(self.args)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.role}-rollout_{rollout_id}-rank{self.rank}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        logger.info("CUDA memory snapshot written to %s", path)
        if not every_step:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory_on = False


@contextlib.contextmanager
def profile_rollout(args, rollout_id: int, engine_urls: list[str]):
    """Profile the engines during one rollout step's generation (target ``rollout``)."""
    if "rollout" not in profiled_targets(args) or not profiles_step(args, rollout_id) or not engine_urls:
        yield
        return
    import httpx

    output_dir = os.path.join(profile_dir(args), "rollout")
    for index, url in enumerate(engine_urls):
        body = {"output_dir": output_dir, "profile_prefix": f"rollout_{rollout_id}-engine{index}",
                "profile_id": "generate", "activities": ["CPU", "GPU"], "record_shapes": True}
        httpx.post(f"{url}/start_profile", json=body, timeout=60).raise_for_status()
    try:
        yield
    finally:
        for url in engine_urls:
            try:
                httpx.post(f"{url}/stop_profile", json={}, timeout=600).raise_for_status()
            except httpx.HTTPError as e:  # a profile lost must not lose the step
                logger.warning("engine %s: /stop_profile failed (%s); its rollout profile is missing", url, e)
