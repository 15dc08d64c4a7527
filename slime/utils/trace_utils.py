"""Per-sample traces: spans and events recorded on ``Sample.trace`` (docs/INTERFACES.md §3.6, §1.5).

Also importable as :mod:`slime.observability.trace_utils` (the same module object, so both paths see one state).

A trace is a plain dict carried by the sample itself, so it survives deep copies, Ray transfers,
partial-rollout recycling and the rollout debug dump without any collector process::

    {"version": 1, "trace_id": "…", "sample_id": index, "group_id": group_index, "attempt": 0,
     "events": [{"type": "span_start" | "span_end" | "event", "name", "ts" (epoch s), "trace_id",
                 "sample_id", "group_id", "attempt", "span_id"?, "parent_span_id"?, "attrs"?}, …]}

Spans nest through a context variable (one open span per trace id), so ``asyncio`` tasks started
inside a span inherit it as their parent. A span may attach synthetic children (engine phases
measured elsewhere) through the end attribute ``_trace_children``: a list of
``{"name", "start" (s after the span start), "duration", "attrs"?, "children"?}`` spans and
``{"name", "offset", "attrs"?}`` events; they become ordinary span/event records with
``attrs["synthetic"] = True``.

Tracing never breaks the traced code: any failure inside this module is logged at debug level
and swallowed. Errors of the traced code itself propagate unchanged (recorded on the span first).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

TRACE_VERSION = 1
TRACE_CHILDREN_KEY = "_trace_children"

SGLANG_META_TRACE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "queue_time", "e2e_latency",
                          "decode_throughput")
# Prefill/decode-disaggregated SGLang reports per-request phase durations (seconds) under these
# keys; each phase becomes a span whose children are its positive parts laid end to end.
PD_PREFILL_KEYS = ("pd_prefill_bootstrap_queue_duration", "pd_prefill_bootstrap_duration",
                   "pd_prefill_alloc_wait_duration", "pd_prefill_queue_duration", "pd_prefill_forward_duration",
                   "pd_prefill_transfer_queue_duration")
PD_DECODE_KEYS = ("pd_decode_prealloc_duration", "pd_decode_bootstrap_duration", "pd_decode_alloc_wait_duration",
                  "pd_decode_transfer_duration", "pd_decode_queue_duration", "pd_decode_forward_duration")
PD_SUMMARY_KEYS = ("pd_transfer_speed_gb_s", "pd_transfer_total_mb", "pd_prefill_retry_count",
                   "pd_bootstrap_duration", "pd_alloc_waiting_duration")
# A colocated engine (the embedded engine) reports where one request's time went on its server.
LOCAL_PHASE_KEYS = (("queue_time", "sglang_queue"), ("prefill_duration", "sglang_prefill"),
                    ("decode_duration", "sglang_decode"))


@dataclass
class TraceHandle:
    """Where events of one trace go: ``carrier`` is the trace dict (``Sample.trace`` or a remote copy)."""

    trace_id: str
    carrier: dict
    sample_id: Any = None
    group_id: Any = None
    attempt: int = 0
    parent_span_id: str | None = None


# trace_id -> span_id of the innermost open span, plus the targets of that span (for trace_function)
_open_spans: contextvars.ContextVar[dict] = contextvars.ContextVar("slime_trace_open_spans", default={})
_current_target: contextvars.ContextVar[Any] = contextvars.ContextVar("slime_trace_current_target", default=None)
_warned_inference: set[str] = set()


def _new_id() -> str:
    return uuid.uuid4().hex


def _is_sample_like(obj) -> bool:
    """A Sample (or any object carrying the Sample identity fields) that can hold ``.trace``."""
    return hasattr(obj, "index") and hasattr(obj, "group_index") and hasattr(obj, "tokens")


# ---------------------------------------------------------------------------------------- carriers
def bind_trace_carrier(carrier: dict, *, trace_id: str | None = None, sample_id=None, group_id=None, attempt: int = 0,
                       parent_span_id: str | None = None) -> TraceHandle:
    """Fill the missing identity keys of ``carrier`` (in place) and return a handle writing into it."""
    carrier.setdefault("version", TRACE_VERSION)
    carrier.setdefault("trace_id", trace_id or _new_id())
    carrier.setdefault("sample_id", sample_id)
    carrier.setdefault("group_id", group_id)
    carrier.setdefault("attempt", attempt)
    carrier.setdefault("events", [])
    return TraceHandle(trace_id=carrier["trace_id"], carrier=carrier, sample_id=carrier["sample_id"],
                       group_id=carrier["group_id"], attempt=int(carrier["attempt"]), parent_span_id=parent_span_id)


def bind_trace(sample) -> TraceHandle:
    """Ensure ``sample.trace`` exists (sample_id = ``index``, group_id = ``group_index``) and return its handle."""
    carrier = getattr(sample, "trace", None)
    if not isinstance(carrier, dict):
        carrier = {}
        sample.trace = carrier
    handle = bind_trace_carrier(carrier, sample_id=sample.index, group_id=sample.group_index)
    # the data source assigns indices after a sample may have been traced elsewhere: keep them current
    if carrier.get("sample_id") is None and sample.index is not None:
        carrier["sample_id"] = handle.sample_id = sample.index
    if carrier.get("group_id") is None and sample.group_index is not None:
        carrier["group_id"] = handle.group_id = sample.group_index
    return handle


def export_trace(handle: TraceHandle) -> dict:
    """What another process needs to continue this trace (send it in a request, e.g. over HTTP)."""
    handle = _as_handle(handle)
    if handle is None:
        return {}
    parent = _open_spans.get().get(handle.trace_id, handle.parent_span_id)
    return {"version": TRACE_VERSION, "trace_id": handle.trace_id, "sample_id": handle.sample_id,
            "group_id": handle.group_id, "attempt": int(handle.carrier.get("attempt", handle.attempt)),
            "parent_span_id": parent}


def import_trace(payload: dict, carrier: dict | None = None) -> TraceHandle:
    """Continue an exported trace: events go to ``carrier`` (a fresh one by default), parented under
    the exporter's open span. Send ``carrier["events"]`` back and merge them with :func:`merge_trace_events`."""
    if not isinstance(payload, dict) or not payload.get("trace_id"):
        raise ValueError(f"import_trace: payload must be a dict from export_trace with a trace_id, got {payload!r}")
    carrier = {} if carrier is None else carrier
    return bind_trace_carrier(carrier, trace_id=payload["trace_id"], sample_id=payload.get("sample_id"),
                              group_id=payload.get("group_id"), attempt=int(payload.get("attempt") or 0),
                              parent_span_id=payload.get("parent_span_id"))


def merge_trace_events(target, events: Iterable[dict]) -> None:
    """Append events recorded elsewhere (an imported trace) to ``target``'s trace, in time order."""
    try:
        for handle in _handles(target):
            handle.carrier["events"].extend(e for e in events if e.get("trace_id") == handle.trace_id)
            handle.carrier["events"].sort(key=lambda e: e.get("ts", 0.0))
    except Exception:
        logger.debug("merge_trace_events failed", exc_info=True)


def inherit_trace(parent, children: Iterable) -> None:
    """Fan-out: every child sample gets its own copy of the parent's trace (same trace id, the events
    so far), so spans recorded later on one child do not appear on its siblings."""
    try:
        source = getattr(parent, "trace", None)
        if not isinstance(source, dict):
            return
        seen: set[int] = set()
        for child in children:
            if child is parent:
                seen.add(id(source))
                continue
            carrier = getattr(child, "trace", None)
            if not isinstance(carrier, dict) or carrier is source or id(carrier) in seen:
                child.trace = copy.deepcopy(source)
                child.trace["sample_id"] = child.index if child.index is not None else source.get("sample_id")
            seen.add(id(child.trace))
    except Exception:
        logger.debug("inherit_trace failed", exc_info=True)


def _as_handle(target) -> TraceHandle | None:
    if isinstance(target, TraceHandle):
        return target
    if _is_sample_like(target):
        return bind_trace(target)
    return None


def _handles(target) -> list[TraceHandle]:
    """Handles of a Sample, a TraceHandle, or a (nested) list of them; anything else has none."""
    if isinstance(target, (list, tuple)):
        return [h for item in target for h in _handles(item)]
    handle = _as_handle(target)
    return [handle] if handle is not None else []


# ---------------------------------------------------------------------------------------- recording
def _record(handle: TraceHandle, kind: str, name: str, ts: float, *, span_id=None, parent_span_id=None,
            attrs: dict | None = None) -> None:
    carrier = handle.carrier
    event = {"type": kind, "name": name, "ts": ts, "trace_id": handle.trace_id, "sample_id": carrier.get("sample_id"),
             "group_id": carrier.get("group_id"), "attempt": int(carrier.get("attempt", handle.attempt) or 0)}
    if span_id is not None:
        event["span_id"] = span_id
    if parent_span_id is not None:
        event["parent_span_id"] = parent_span_id
    if attrs:
        event["attrs"] = _plain(attrs)
    carrier["events"].append(event)


def _plain(value):
    """Attributes as JSON-friendly values (tensors and odd objects become numbers or strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):  # enums such as Sample.Status
        return value.value
    return str(value)


def _parent_for(handle: TraceHandle) -> str | None:
    return _open_spans.get().get(handle.trace_id, handle.parent_span_id)


def trace_event(target, name: str, *, attrs: dict | None = None) -> None:
    """Record an instant event on every trace of ``target``."""
    try:
        now = time.time()
        for handle in _handles(target):
            _record(handle, "event", name, now, parent_span_id=_parent_for(handle), attrs=attrs)
    except Exception:
        logger.debug("trace_event %s failed", name, exc_info=True)


def trace_next_attempt(target, *, attrs: dict | None = None) -> None:
    """A retried sample (e.g. aborted, then continued by partial rollout): bump ``attempt``, record ``attempt_start``."""
    try:
        now = time.time()
        for handle in _handles(target):
            handle.carrier["attempt"] = int(handle.carrier.get("attempt", 0)) + 1
            handle.attempt = handle.carrier["attempt"]
            _record(handle, "event", "attempt_start", now, parent_span_id=_parent_for(handle), attrs=attrs)
    except Exception:
        logger.debug("trace_next_attempt failed", exc_info=True)


class TraceSpan:
    """The object ``trace_span`` yields: set end attributes while the span is open."""

    def __init__(self, target, name: str, attrs: dict | None, record_error: bool):
        self.target = target
        self.name = name
        self.start_attrs = dict(attrs or {})
        self.end_attrs: dict = {}
        self.record_error = record_error
        self._spans: list[tuple[TraceHandle, str]] = []
        self._start = 0.0
        self._token = None
        self._target_token = None

    # attributes recorded with span_end
    def set(self, key: str, value) -> None:
        self.end_attrs[key] = value

    set_attr = set

    def update(self, attrs: dict | None) -> None:
        self.end_attrs.update(attrs or {})

    update_attrs = update

    def retarget(self, target) -> None:
        """End the span on ``target`` instead (fan-out: the children inherited the open span)."""
        try:
            span_ids = {handle.trace_id: span_id for handle, span_id in self._spans}
            self._spans = [(handle, span_ids[handle.trace_id]) for handle in _handles(target)
                           if handle.trace_id in span_ids]
        except Exception:
            logger.debug("retarget of span %s failed", self.name, exc_info=True)

    def _enter(self) -> bool:
        """Record the start on every trace; False when the target has no trace to record on."""
        try:
            self._start = time.time()
            handles = _handles(self.target)
        except Exception:
            logger.debug("span %s: no trace handle for %r", self.name, type(self.target), exc_info=True)
            return False
        if not handles:
            return False
        try:
            open_spans = dict(_open_spans.get())
            for handle in handles:
                span_id = _new_id()[:16]
                self._spans.append((handle, span_id))
                open_spans[handle.trace_id] = span_id
                _record(handle, "span_start", self.name, self._start, span_id=span_id,
                        parent_span_id=_parent_for(handle), attrs=self.start_attrs)
        except Exception:
            logger.debug("span %s could not start", self.name, exc_info=True)
        self._token = _open_spans.set(open_spans)
        self._target_token = _current_target.set(self.target)
        return True

    def _exit(self, exc: BaseException | None) -> None:
        try:
            if self._token is not None:
                _open_spans.reset(self._token)
                _current_target.reset(self._target_token)
        except ValueError:  # exited in another context (a generator or task hand-off): drop our entries
            _open_spans.set({k: v for k, v in _open_spans.get().items()
                             if v not in {span_id for _, span_id in self._spans}})
        try:
            now = time.time()
            attrs = dict(self.end_attrs)
            children = attrs.pop(TRACE_CHILDREN_KEY, None)
            if exc is not None and self.record_error:
                attrs["error_type"] = type(exc).__name__
                attrs["error_message"] = str(exc)[:2000]
            for handle, span_id in self._spans:
                if children:
                    _record_children(handle, span_id, self._start, children)
                _record(handle, "span_end", self.name, now, span_id=span_id, attrs=attrs)
        except Exception:
            logger.debug("span %s could not end", self.name, exc_info=True)


def _record_children(handle: TraceHandle, parent_id: str, origin: float, children: list) -> None:
    for child in children:
        if not isinstance(child, dict) or "name" not in child:
            continue
        attrs = {**(child.get("attrs") or {}), "synthetic": True}
        if "duration" in child:
            start = origin + float(child.get("start", 0.0))
            span_id = _new_id()[:16]
            _record(handle, "span_start", child["name"], start, span_id=span_id, parent_span_id=parent_id, attrs=attrs)
            if child.get("children"):
                _record_children(handle, span_id, start, child["children"])
            _record(handle, "span_end", child["name"], start + float(child["duration"]), span_id=span_id)
        else:
            _record(handle, "event", child["name"], origin + float(child.get("offset", 0.0)),
                    parent_span_id=parent_id, attrs=attrs)


class trace_span:  # noqa: N801 - used like a function: ``with trace_span(sample, "name") as span``
    """Context manager (sync and async) recording one span on every trace of ``target``.

    ``target`` is a Sample, a TraceHandle or a list of them. Yields a :class:`TraceSpan` (``set``,
    ``update``, ``retarget``), or ``target`` unchanged when no trace can be derived from it. An
    exception escaping the block is recorded on ``span_end`` (``error_type``, ``error_message``)
    when ``record_error`` and then re-raised.
    """

    def __init__(self, target, name: str, *, attrs: dict | None = None, record_error: bool = True):
        self._span = TraceSpan(target, name, attrs, record_error)
        self._active = False

    def __enter__(self):
        self._active = self._span._enter()
        return self._span if self._active else self._span.target

    def __exit__(self, exc_type, exc, tb):
        if self._active:
            self._span._exit(exc)
        return False

    async def __aenter__(self):
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb):
        return self.__exit__(exc_type, exc, tb)


# ---------------------------------------------------------------------------------------- decorator
def _infer_target(fn_name: str, args: tuple, kwargs: dict):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, TraceHandle) or _is_sample_like(value) or (
                isinstance(value, list) and value and all(_is_sample_like(v) for v in value)):
            if fn_name not in _warned_inference:
                _warned_inference.add(fn_name)
                logger.warning("trace_function(%s): no target given, tracing its first Sample-like argument; pass "
                               "target='param_name' or target_getter to be explicit", fn_name)
            return value
    return _current_target.get()


def trace_function(name: str, *, target: str | None = None, target_getter: Callable | None = None,
                   attrs_getter: Callable | None = None, record_error: bool = True):
    """Decorator: run the (sync or async) function inside ``trace_span(<target>, name)``.

    The target is the parameter named ``target``, else ``target_getter(*args, **kwargs)``, else the
    first Sample-like argument (warned once), else the target of the span open around the call.
    ``attrs_getter(*args, **kwargs)`` supplies the start attributes.
    """

    def decorate(fn):
        signature = inspect.signature(fn)

        def resolve(args, kwargs):
            try:
                if target is not None:
                    bound = signature.bind_partial(*args, **kwargs)
                    if target not in bound.arguments:
                        raise TypeError(f"trace_function({name!r}): {fn.__qualname__} was called without "
                                        f"its '{target}' argument")
                    span_target = bound.arguments[target]
                elif target_getter is not None:
                    span_target = target_getter(*args, **kwargs)
                else:
                    span_target = _infer_target(fn.__qualname__, args, kwargs)
                attrs = attrs_getter(*args, **kwargs) if attrs_getter is not None else None
                return span_target, attrs
            except Exception:
                logger.debug("trace_function(%s) could not resolve its target", name, exc_info=True)
                return None, None

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                span_target, attrs = resolve(args, kwargs)
                async with trace_span(span_target, name, attrs=attrs, record_error=record_error):
                    return await fn(*args, **kwargs)
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            span_target, attrs = resolve(args, kwargs)
            with trace_span(span_target, name, attrs=attrs, record_error=record_error):
                return fn(*args, **kwargs)
        return wrapper

    return decorate


# ---------------------------------------------------------------------------------------- engine meta
def _positive(meta: dict, key: str) -> float | None:
    value = meta.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _phase(name: str, meta: dict, keys: tuple[str, ...], prefix: str) -> dict | None:
    children, offset = [], 0.0
    extra = sorted(k for k in meta if k.startswith(prefix) and k.endswith("_duration") and k not in keys)
    for key in (*keys, *extra):
        duration = _positive(meta, key)
        if duration is None:
            continue
        children.append({"name": key.removesuffix("_duration"), "start": offset, "duration": duration,
                         "attrs": {key: duration}})
        offset += duration
    if not children:
        return None
    return {"name": name, "start": 0.0, "duration": offset, "children": children}


def build_sglang_meta_trace_attrs(meta_info: dict | None) -> dict:
    """Span attributes from an engine's ``meta_info``: token counts, latency, finish reason, request id,
    and (under ``_trace_children``) the request's phases when the engine reports them: prefill/decode
    disaggregated phases (``sglang_pd_prefill``, ``sglang_pd_decode``, ``sglang_pd_summary``) or the
    queue/prefill/decode split of a colocated engine (``sglang_queue``, ``sglang_prefill``, ``sglang_decode``)."""
    if not isinstance(meta_info, dict):
        return {}
    attrs = {key: meta_info[key] for key in SGLANG_META_TRACE_KEYS if meta_info.get(key) is not None}
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type"):
        attrs["finish_reason"] = reason["type"]
    elif isinstance(reason, str):
        attrs["finish_reason"] = reason
    if meta_info.get("id") is not None:
        attrs["sglang_request_id"] = meta_info["id"]

    children = []
    for phase in (_phase("sglang_pd_prefill", meta_info, PD_PREFILL_KEYS, "pd_prefill_"),
                  _phase("sglang_pd_decode", meta_info, PD_DECODE_KEYS, "pd_decode_")):
        if phase is not None:
            children.append(phase)
    summary = {key: meta_info[key] for key in PD_SUMMARY_KEYS if meta_info.get(key) is not None}
    if summary:
        children.append({"name": "sglang_pd_summary", "offset": 0.0, "attrs": summary})
    if not children and _positive(meta_info, "prefill_duration") is not None:
        offset = 0.0
        for key, phase_name in LOCAL_PHASE_KEYS:
            duration = _positive(meta_info, key)
            if duration is not None:
                children.append({"name": phase_name, "start": offset, "duration": duration, "attrs": {key: duration}})
                offset += duration
    if children:
        attrs[TRACE_CHILDREN_KEY] = children
    return attrs


__all__ = [
    "TRACE_CHILDREN_KEY",
    "TRACE_VERSION",
    "TraceHandle",
    "TraceSpan",
    "bind_trace",
    "bind_trace_carrier",
    "build_sglang_meta_trace_attrs",
    "export_trace",
    "import_trace",
    "inherit_trace",
    "merge_trace_events",
    "trace_event",
    "trace_function",
    "trace_next_attempt",
    "trace_span",
]
