"""``--speculative-adaptive``: how many drafts a speculative step proposes, chosen at run time from the
acceptance observed, per batch size — SGLang's adaptive speculative decoding, with its JSON config
(``--speculative-adaptive-config``) and defaults.

Why: a verify step costs more than a plain one, and what it returns depends on how many drafts are
accepted and on how weight-bound the step is. On the H200 NGRAM was 1.30x plain decoding at 1 row of
copy-heavy output but 0.89x at 32 rows (docs/embedded_engine.md), and an RL rollout runs both: many
rows at first, a long tail of few. So the draft count follows the batch: each batch-size slot has its
own candidate counts (0 = no speculation: plain decode steps) and moves among them by the drafts it
sees accepted.

The config (SGLang's format): integer-string keys are batch sizes, each slot serving batches from its
size up to the next key's (a batch is first rounded up to the decode graphs' batch bucket, as SGLang
rounds to its CUDA-graph sizes); each has ``candidate_steps`` (non-negative ints) and may override the
top-level knobs ``ema_alpha`` (0.2), ``update_interval`` (5), ``warmup_batches`` (10),
``down_hysteresis`` (-0.25), ``up_hysteresis`` (0.0), ``ceiling_coeff`` (0). A slot keeps an
exponential moving average of the drafts accepted per request (verify steps only); after its warm-up,
every ``update_interval`` steps it moves down while the average is at or below the next lower
candidate minus a half (or 0.5 to reach 0) plus ``down_hysteresis``, else up while it is above the
current candidate minus a half plus ``up_hysteresis``; from 0 drafts it probes the next candidate up.
``ceiling_coeff`` > 0 caps a step that is not up at ``ceil(average · ceiling_coeff)``. The slots'
state is in ``/get_server_info`` (``internal_states[0].speculative_adaptive``).
"""

from __future__ import annotations

import bisect
import json
import logging
import math

logger = logging.getLogger(__name__)

DEFAULT_CONFIG: dict[str, dict] = {  # SGLang's defaults: more drafts for few rows, none from 64 rows
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
KNOBS = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
         "up_hysteresis": 0.0, "ceiling_coeff": 0}


def load_config(path: str | None) -> dict[int, dict]:
    """Batch size -> that slot's settings (top-level knobs merged under its own), from ``path`` or the
    defaults; ValueError naming the file and key for anything malformed."""
    where = f"--speculative-adaptive-config {path}" if path else "the default adaptive config"
    if path is None:
        raw = DEFAULT_CONFIG
    else:
        try:
            with open(path) as f:
                raw = json.load(f)
        except OSError as exc:
            raise ValueError(f"{where}: cannot read it ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object of batch sizes, e.g. {{\"1\": {{\"candidate_steps\": [1, 3]}}}}")
    shared = {key: value for key, value in raw.items() if not key.isdigit()}
    for key, value in shared.items():
        if key not in KNOBS:
            raise ValueError(f"{where}: unknown key {key!r} (batch sizes are integer strings; knobs: {sorted(KNOBS)})")
    slots = {}
    for key, entry in raw.items():
        if not key.isdigit():
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: batch size {key} must map to an object with candidate_steps")
        steps = entry.get("candidate_steps")
        if not isinstance(steps, list) or not steps or not all(type(s) is int and s >= 0 for s in steps):
            raise ValueError(f"{where}: batch size {key}: candidate_steps must be a non-empty list of non-negative "
                             f"ints, got {steps!r}")
        unknown = set(entry) - set(KNOBS) - {"candidate_steps"}
        if unknown:
            raise ValueError(f"{where}: batch size {key}: unknown keys {sorted(unknown)}")
        settings = {**KNOBS, **shared, **entry}
        for knob in ("update_interval", "warmup_batches"):
            if type(settings[knob]) is not int or settings[knob] < (1 if knob == "update_interval" else 0):
                raise ValueError(f"{where}: batch size {key}: {knob} must be an int >= "
                                 f"{1 if knob == 'update_interval' else 0}, got {settings[knob]!r}")
        if not 0 < settings["ema_alpha"] <= 1:
            raise ValueError(f"{where}: batch size {key}: ema_alpha must be in (0, 1], got {settings['ema_alpha']!r}")
        slots[int(key)] = settings
    if not slots:
        raise ValueError(f"{where}: needs at least one batch size key, e.g. {{\"1\": {{\"candidate_steps\": [1, 3, 7]}}}}")
    return slots


class StepSlot:
    """One batch-size slot: the drafts a step proposes now, and the average accepted that moves it."""

    def __init__(self, initial_steps: int, settings: dict):
        self.candidates = sorted(set(settings["candidate_steps"]))
        self.alpha = settings["ema_alpha"]
        self.update_interval = settings["update_interval"]
        self.warmup = settings["warmup_batches"]
        self.down = settings["down_hysteresis"]
        self.up = settings["up_hysteresis"]
        self.ceiling_coeff = settings["ceiling_coeff"]
        self.steps = initial_steps if initial_steps in self.candidates else self.candidates[len(self.candidates) // 2]
        self.accepted = float(self.steps - 1)  # the average starts neutral: one below the drafts proposed
        self.batches = 0
        self.changes = 0

    def observe(self, accepted: list[int]) -> bool:
        """A step of this slot: the drafts accepted per request of a verify step (none for a step without
        drafts); True when the draft count changed."""
        if self.steps > 0 and accepted:
            self.accepted = (1 - self.alpha) * self.accepted + self.alpha * sum(accepted) / len(accepted)
        self.batches += 1
        if self.batches <= self.warmup or (self.batches - self.warmup) % self.update_interval:
            return False
        return self._move()

    def _move(self) -> bool:
        old = index = self.candidates.index(self.steps)
        if self.steps == 0:  # after an interval without drafts, try the next count up
            index = min(index + 1, len(self.candidates) - 1)
            if self.candidates[index] > 0 and self.accepted < 0:
                self.accepted = float(self.candidates[index] - 1)
            return self._set(index)
        while index > 0:
            lower = self.candidates[index - 1]
            if self.accepted <= (0.5 if lower == 0 else lower - 0.5) + self.down:
                index -= 1
            else:
                break
        if index == old:
            while index < len(self.candidates) - 1 and self.accepted > self.candidates[index] - 0.5 + self.up:
                index += 1
        if self.ceiling_coeff > 0 and self.candidates[index] <= self.steps:  # caps only a step that is not up
            ceiling = max(1, math.ceil(self.accepted * self.ceiling_coeff))
            while index > 0 and self.candidates[index] > ceiling:
                index -= 1
        return self._set(index)

    def _set(self, index: int) -> bool:
        target = self.candidates[index]
        if target == self.steps:
            return False
        # debug: a slot whose drafts are rarely accepted probes 0 -> 1 -> 0 every few intervals, hundreds of
        # steps a second on a GPU (/get_server_info's speculative_adaptive shows the counts now)
        logger.debug("adaptive speculation: %d -> %d drafts a step (average accepted %.2f)", self.steps, target,
                     self.accepted)
        self.changes += 1
        self.steps = target
        return True


class AdaptiveSteps:
    """The slots of a config, routed by batch size (rounded up to ``batch_buckets`` where given: the
    decode graphs' sizes, as SGLang rounds to its CUDA-graph batch sizes)."""

    def __init__(self, initial_steps: int, path: str | None = None, batch_buckets: list[int] | None = None):
        slots = load_config(path)
        self.sizes = sorted(slots)
        self.slots = {size: StepSlot(initial_steps, slots[size]) for size in self.sizes}
        self.batch_buckets = sorted(batch_buckets) if batch_buckets else None

    @property
    def max_steps(self) -> int:
        return max(max(slot.candidates) for slot in self.slots.values())

    def slot(self, batch: int) -> StepSlot:
        if self.batch_buckets:
            i = bisect.bisect_left(self.batch_buckets, batch)
            batch = self.batch_buckets[i] if i < len(self.batch_buckets) else batch
        return self.slots[self.sizes[max(0, bisect.bisect_right(self.sizes, batch) - 1)]]

    def steps(self, batch: int) -> int:
        return self.slot(batch).steps

    def observe(self, batch: int, accepted: list[int]) -> bool:
        return self.slot(batch).observe(accepted)

    def state(self) -> dict:
        """Per slot (its batch size): the drafts a step now, the average accepted, steps seen, changes."""
        return {str(size): {"steps": slot.steps, "accepted_ema": round(slot.accepted, 4), "batches": slot.batches,
                            "changes": slot.changes} for size, slot in self.slots.items()}
