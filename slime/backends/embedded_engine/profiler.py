"""``/start_profile`` and ``/stop_profile`` of the embedded engine (docs/SGLANG_PROTOCOL.md §4.6), on torch.profiler.

The profiler lives on the engine thread (it starts, counts steps and exports between engine steps).
One engine step = admit + prefill + one batched decode (see :mod:`engine`). With ``num_steps`` the
profile stops by itself after that many steps; otherwise at ``/stop_profile``. The result is a
Chrome-trace JSON file per profile, ``<output_dir>/[<prefix>-]<profile_id>-TP-0[-<STAGE>].trace.json``,
which chrome://tracing or https://ui.perfetto.dev open.

``profile_by_stage``: prefill and decode are profiled one after the other, each for ``num_steps``
forwards of its own stage (collection is switched off while the other stage runs), giving one file
per stage (``-PREFILL``, ``-DECODE``). ``profile_stages`` narrows the stages.
"""


import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

from slime.backends.embedded_engine.io_struct import read_json

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "MEM", "RPD")
SUPPORTED_ACTIVITIES = ("CPU", "GPU")
STAGES = ("prefill", "decode")


class ProfileError(ValueError):
    """A profile request that cannot be served (answered 400 with this message)."""


@dataclass
class ProfileRequest:
    """SGLang's ``ProfileReq`` body (unknown keys are ignored, as SGLang does)."""

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] = field(default_factory=lambda: ["CPU", "GPU"])
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None

    @classmethod
    def from_body(cls, body: dict) -> "ProfileRequest":
        known = {name: body[name] for name in cls.__dataclass_fields__ if body.get(name) is not None}
        request = cls(**known)
        if isinstance(request.activities, str):
            request.activities = [request.activities]
        unknown = [a for a in request.activities if a not in ACTIVITIES]
        if unknown:
            raise ProfileError(f"activities: unknown {unknown}; choose from {list(ACTIVITIES)}")
        unsupported = [a for a in request.activities if a not in SUPPORTED_ACTIVITIES]
        if unsupported:
            raise ProfileError(f"activities: the embedded engine profiles only {list(SUPPORTED_ACTIVITIES)}, "
                               f"not {unsupported}")
        if request.num_steps is not None and int(request.num_steps) <= 0:
            raise ProfileError(f"num_steps must be a positive number of engine steps, got {request.num_steps}")
        stages = [s.lower() for s in (request.profile_stages or STAGES)]
        bad = [s for s in stages if s not in STAGES]
        if bad:
            raise ProfileError(f"profile_stages: unknown {bad}; choose from {list(STAGES)}")
        request.profile_stages = stages
        if request.profile_by_stage and request.num_steps is None:
            raise ProfileError("profile_by_stage needs num_steps (the number of forwards profiled per stage)")
        return request


class EngineProfiler:
    """State machine driven by the engine thread: idle -> waiting for start_step -> recording -> idle."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.request: ProfileRequest | None = None
        self.steps_seen = 0  # engine steps since the engine started
        self.written: list[str] = []  # every trace file exported so far
        self._profile = None
        self._stage: str | None = None  # by-stage mode: the stage being recorded
        self._recorded = 0  # steps (or stage forwards) recorded in the current profile

    @property
    def active(self) -> bool:
        return self.request is not None

    # ------------------------------------------------------------------ control (engine thread)
    def start(self, request: ProfileRequest) -> str:
        if self.active:
            raise ProfileError("Profiling is already in progress. Call /stop_profile first.")
        request.output_dir = request.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        os.makedirs(request.output_dir, exist_ok=True)
        request.profile_id = request.profile_id or str(time.time())
        self.request = request
        if request.start_step is None or self.steps_seen >= int(request.start_step):
            self._begin()
        return "Start profiling.\n"

    def stop(self) -> list[str]:
        if not self.active:
            raise ProfileError("Profiling is not in progress. Call /start_profile first.")
        return self._finish()

    # ------------------------------------------------------------------ hooks (engine thread)
    @contextlib.contextmanager
    def stage(self, name: str):
        """Wrap one stage's forwards; in by-stage mode only the stage being recorded is collected."""
        recording = self._profile is not None
        this_stage = recording and self.request.profile_by_stage and name == self._stage
        if this_stage:
            self._toggle(True)
        try:
            if recording:
                from torch.profiler import record_function

                with record_function(f"engine_{name}"):
                    yield
            else:
                yield
        finally:
            if this_stage:
                self._toggle(False)
                self._recorded += 1
                if self._recorded >= int(self.request.num_steps):
                    self._next_stage()

    def step_done(self) -> None:
        self.steps_seen += 1
        request = self.request
        if request is None:
            return
        if self._profile is None:
            if request.start_step is not None and self.steps_seen >= int(request.start_step):
                self._begin()
            return
        if not request.profile_by_stage:
            self._recorded += 1
            if request.num_steps is not None and self._recorded >= int(request.num_steps):
                self._finish()

    # ------------------------------------------------------------------ internals
    def _activities(self):
        from torch.profiler import ProfilerActivity

        activities = [ProfilerActivity.CPU] if "CPU" in self.request.activities else []
        if "GPU" in self.request.activities and self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        return activities or [ProfilerActivity.CPU]  # GPU-only on a CPU engine: record the host side

    def _begin(self) -> None:
        import torch.profiler

        request = self.request
        self._recorded = 0
        self._profile = torch.profiler.profile(activities=self._activities(),
                                               record_shapes=bool(request.record_shapes),
                                               with_stack=bool(request.with_stack))
        self._profile.__enter__()
        if request.profile_by_stage:
            self._stage = request.profile_stages[0]
            self._toggle(False)  # collected only inside the stage being recorded
        logger.info("profiling started (%s)", self._path())

    def _toggle(self, enabled: bool) -> None:
        self._profile.toggle_collection_dynamic(enabled, self._activities())

    def _path(self) -> str:
        request = self.request
        prefix = f"{request.profile_prefix}-" if request.profile_prefix else ""
        stage = f"-{self._stage.upper()}" if request.profile_by_stage and self._stage else ""
        return os.path.join(request.output_dir, f"{prefix}{request.profile_id}-TP-0{stage}.trace.json")

    def _export(self) -> None:
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        path = self._path()
        profile.export_chrome_trace(path)
        self.written.append(path)
        logger.info("profile written to %s", path)

    def _next_stage(self) -> None:
        """By-stage mode: this stage has its forwards; write it and record the next stage, if any."""
        self._export()
        stages = self.request.profile_stages
        position = stages.index(self._stage)
        if position + 1 < len(stages):
            self._begin()
            self._stage = stages[position + 1]
        else:
            self.request, self._stage = None, None

    def _finish(self) -> list[str]:
        first = len(self.written)
        if self._profile is not None:
            self._export()
        self.request, self._stage = None, None
        return self.written[first:]


def add_profile_routes(app, state) -> None:
    """``POST|GET /start_profile`` (body ``ProfileReq``) and ``POST|GET /stop_profile``; plain-text
    answers as SGLang gives them (200, or 400 with the reason)."""
    import asyncio

    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    engine = state.engine

    async def on_engine(fn):
        return await asyncio.wrap_future(engine.call(fn))

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request):
        body = await read_json(request, required=False)
        try:
            profile_request = ProfileRequest.from_body(body)
            message = await on_engine(lambda: engine.profiler.start(profile_request))
        except (ProfileError, OSError, TypeError) as exc:
            return PlainTextResponse(f"{exc}\n", status_code=400)
        return PlainTextResponse(message)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        try:
            written = await on_engine(engine.profiler.stop)
        except ProfileError as exc:
            return PlainTextResponse(f"{exc}\n", status_code=400)
        files = "".join(f"{path}\n" for path in written)
        return PlainTextResponse(f"Stop profiling. This will take some time.\n{files}")
