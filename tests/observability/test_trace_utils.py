"""Trace helpers (docs/INTERFACES.md §3.6): what a user reads back from ``Sample.trace``."""

import asyncio
import copy
import logging

import pytest

from slime.observability import trace_utils as tu
from slime.utils.types import Sample


def make_sample(index=3, group=1):
    return Sample(index=index, group_index=group, prompt="p", tokens=[1, 2])


def events(sample, kind=None):
    return [e for e in sample.trace["events"] if kind is None or e["type"] == kind]


def spans(sample):
    """{span name: (start event, end event)} of a trace."""
    starts = {e["span_id"]: e for e in events(sample, "span_start")}
    return {starts[e["span_id"]]["name"]: (starts[e["span_id"]], e) for e in events(sample, "span_end")}


def test_bind_trace_creates_carrier_once():
    sample = make_sample()
    handle = tu.bind_trace(sample)
    assert sample.trace == {"version": 1, "trace_id": handle.trace_id, "sample_id": 3, "group_id": 1, "attempt": 0,
                            "events": []}
    assert tu.bind_trace(sample).trace_id == handle.trace_id and handle.carrier is sample.trace
    assert tu.TRACE_VERSION == 1 and tu.TRACE_CHILDREN_KEY == "_trace_children"


def test_old_module_path_is_the_same_module():
    import slime.utils.trace_utils as old

    assert old is tu and old.trace_span is tu.trace_span


def test_nested_spans_events_and_end_attrs():
    sample = make_sample()
    with tu.trace_span(sample, "outer", attrs={"group_size": 4}) as outer:
        with tu.trace_span(sample, "inner") as inner:
            tu.trace_event(sample, "tick", attrs={"n": 1})
            inner.set("tokens", 7)
        outer.update({"reward": 1.0})
    found = spans(sample)
    outer_start, outer_end = found["outer"]
    inner_start, inner_end = found["inner"]
    assert outer_start["attrs"] == {"group_size": 4} and outer_end["attrs"] == {"reward": 1.0}
    assert "parent_span_id" not in outer_start
    assert inner_start["parent_span_id"] == outer_start["span_id"] and inner_end["attrs"] == {"tokens": 7}
    tick = events(sample, "event")[0]
    assert tick["name"] == "tick" and tick["parent_span_id"] == inner_start["span_id"] and tick["attrs"] == {"n": 1}
    ts = [e["ts"] for e in events(sample)]
    assert ts == sorted(ts) and outer_start["ts"] <= inner_start["ts"] <= inner_end["ts"] <= outer_end["ts"]
    for e in events(sample):
        assert (e["trace_id"], e["sample_id"], e["group_id"], e["attempt"]) == (sample.trace["trace_id"], 3, 1, 0)


def test_exception_is_recorded_and_reraised():
    sample = make_sample()
    with pytest.raises(ZeroDivisionError):
        with tu.trace_span(sample, "boom"):
            1 / 0
    _, end = spans(sample)["boom"]
    assert end["attrs"]["error_type"] == "ZeroDivisionError" and "division" in end["attrs"]["error_message"]
    quiet = make_sample()
    with pytest.raises(KeyError):
        with tu.trace_span(quiet, "boom", record_error=False):
            raise KeyError("x")
    assert "attrs" not in spans(quiet)["boom"][1]


def test_list_target_traces_every_sample_and_no_handle_yields_target():
    group = [make_sample(i, 0) for i in range(3)]
    with tu.trace_span(group, "generate_and_rm_group", attrs={"group_size": 3}) as span:
        span.set("kept", True)
    for sample in group:
        start, end = spans(sample)["generate_and_rm_group"]
        assert start["attrs"] == {"group_size": 3} and end["attrs"] == {"kept": True}
    assert len({s.trace["trace_id"] for s in group}) == 3
    with tu.trace_span(None, "nothing") as value:
        assert value is None
    with tu.trace_span("not a sample", "nothing") as value:
        assert value == "not a sample"


def test_async_spans_nest_across_tasks():
    sample = make_sample()

    async def child(name):
        async with tu.trace_span(sample, name):
            await asyncio.sleep(0.01)

    async def main():
        async with tu.trace_span(sample, "parent") as span:
            await asyncio.gather(child("a"), child("b"))
            span.set("done", True)

    asyncio.run(main())
    found = spans(sample)
    parent_id = found["parent"][0]["span_id"]
    assert found["a"][0]["parent_span_id"] == parent_id == found["b"][0]["parent_span_id"]
    assert found["parent"][1]["attrs"] == {"done": True}


def test_trace_function_sync_async_target_getter_and_errors(caplog):
    @tu.trace_function("by_name", target="sample", attrs_getter=lambda args, sample, n: {"n": n})
    def by_name(args, sample, n):
        return n * 2

    @tu.trace_function("by_getter", target_getter=lambda payload: payload["s"])
    async def by_getter(payload):
        raise RuntimeError("engine down")

    @tu.trace_function("inferred")
    def inferred(x, sample):
        return x

    @tu.trace_function("from_open_span")
    def no_sample_argument(x):
        return x

    sample = make_sample()
    assert by_name(None, sample, 4) == 8
    with pytest.raises(RuntimeError):
        asyncio.run(by_getter({"s": sample}))
    with caplog.at_level(logging.WARNING):
        assert inferred(1, sample) == 1 and inferred(2, sample) == 2
    assert sum("first Sample-like argument" in r.message for r in caplog.records) == 1  # warned once
    with tu.trace_span(sample, "outer"):
        no_sample_argument(5)
    found = spans(sample)
    assert found["by_name"][0]["attrs"] == {"n": 4}
    assert found["by_getter"][1]["attrs"]["error_type"] == "RuntimeError"
    assert found["from_open_span"][0]["parent_span_id"] == found["outer"][0]["span_id"]
    assert len([e for e in events(sample, "span_start") if e["name"] == "inferred"]) == 2


def test_fan_out_children_inherit_and_diverge():
    parent = make_sample(index=10, group=2)
    children = []
    with tu.trace_span(parent, "generate_and_rm") as span:
        tu.trace_event(parent, "generated")
        children = [parent, Sample(index=11, group_index=2), copy.copy(parent)]
        children[2].index = 12
        tu.inherit_trace(parent, children)
        span.retarget(children)
        tu.trace_event(children[1], "only_child_1")
    trace_ids = {c.trace["trace_id"] for c in children}
    assert trace_ids == {parent.trace["trace_id"]}  # one rollout, one trace
    assert len({id(c.trace) for c in children}) == 3  # but separate carriers
    for child in children:
        assert "generate_and_rm" in spans(child)  # the span opened on the parent ends on every child
        assert [e["name"] for e in events(child, "event")][0] == "generated"
    assert [c.trace["sample_id"] for c in children] == [10, 11, 12]
    assert [e["name"] for e in events(children[1], "event")] == ["generated", "only_child_1"]
    assert [e["name"] for e in events(children[2], "event")] == ["generated"]


def test_next_attempt_bumps_and_later_events_carry_it():
    sample = make_sample()
    with tu.trace_span(sample, "generate"):
        pass
    tu.trace_next_attempt(sample, attrs={"reason": "partial_rollout"})
    with tu.trace_span(sample, "generate"):
        pass
    assert sample.trace["attempt"] == 1
    attempt_event = [e for e in events(sample) if e["name"] == "attempt_start"][0]
    assert attempt_event["attempt"] == 1 and attempt_event["attrs"] == {"reason": "partial_rollout"}
    assert [e["attempt"] for e in events(sample, "span_start")] == [0, 1]


def test_export_import_across_a_process_boundary():
    sample = make_sample()
    with tu.trace_span(sample, "client_call"):
        payload = tu.export_trace(tu.bind_trace(sample))
    assert payload["trace_id"] == sample.trace["trace_id"] and payload["parent_span_id"]
    remote = tu.import_trace(dict(payload))  # e.g. after JSON over HTTP
    with tu.trace_span(remote, "server_work"):
        pass
    assert remote.carrier["events"][0]["parent_span_id"] == payload["parent_span_id"]
    tu.merge_trace_events(sample, remote.carrier["events"])
    found = spans(sample)
    assert found["server_work"][0]["parent_span_id"] == found["client_call"][0]["span_id"]
    with pytest.raises(ValueError, match="trace_id"):
        tu.import_trace({"nope": 1})


def test_sglang_meta_attrs_and_pd_children():
    meta = {"id": "rid-1", "prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 0, "queue_time": None,
            "e2e_latency": 0.5, "finish_reason": {"type": "length", "length": 3}, "weight_version": "2",
            "pd_prefill_bootstrap_queue_duration": 0.01, "pd_prefill_forward_duration": 0.02,
            "pd_prefill_transfer_queue_duration": 0.0, "pd_decode_prealloc_duration": 0.005,
            "pd_decode_transfer_duration": 0.03, "pd_decode_forward_duration": 0.2, "pd_transfer_speed_gb_s": 1.5,
            "pd_prefill_retry_count": 0}
    attrs = tu.build_sglang_meta_trace_attrs(meta)
    children = attrs.pop(tu.TRACE_CHILDREN_KEY)
    assert attrs == {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 0, "e2e_latency": 0.5,
                     "finish_reason": "length", "sglang_request_id": "rid-1"}
    prefill, decode, summary = children
    assert prefill["name"] == "sglang_pd_prefill" and prefill["duration"] == pytest.approx(0.03)
    assert [(c["name"], c["start"]) for c in prefill["children"]] == [
        ("pd_prefill_bootstrap_queue", 0.0), ("pd_prefill_forward", 0.01)]  # zero durations dropped
    assert [c["name"] for c in decode["children"]] == ["pd_decode_prealloc", "pd_decode_transfer", "pd_decode_forward"]
    assert summary == {"name": "sglang_pd_summary", "offset": 0.0,
                       "attrs": {"pd_transfer_speed_gb_s": 1.5, "pd_prefill_retry_count": 0}}
    assert tu.build_sglang_meta_trace_attrs(None) == {}

    sample = make_sample()
    with tu.trace_span(sample, "sglang_generate") as span:
        span.update(tu.build_sglang_meta_trace_attrs(meta))
    found = spans(sample)
    outer_start, outer_end = found["sglang_generate"]
    assert tu.TRACE_CHILDREN_KEY not in outer_end["attrs"] and outer_end["attrs"]["finish_reason"] == "length"
    pd_start, pd_end = found["sglang_pd_prefill"]
    assert pd_start["parent_span_id"] == outer_start["span_id"] and pd_start["attrs"]["synthetic"] is True
    assert pd_end["ts"] - pd_start["ts"] == pytest.approx(0.03)
    forward_start, forward_end = found["pd_prefill_forward"]
    assert forward_start["parent_span_id"] == pd_start["span_id"]
    assert forward_start["ts"] - outer_start["ts"] == pytest.approx(0.01)


def test_colocated_engine_phases():
    meta = {"queue_time": 0.1, "prefill_duration": 0.2, "decode_duration": 0.3, "decode_throughput": 10.0}
    attrs = tu.build_sglang_meta_trace_attrs(meta)
    assert attrs["queue_time"] == 0.1 and attrs["decode_throughput"] == 10.0
    assert [(c["name"], c["start"]) for c in attrs[tu.TRACE_CHILDREN_KEY]] == [
        ("sglang_queue", 0.0), ("sglang_prefill", 0.1), ("sglang_decode", pytest.approx(0.3))]


def test_trace_survives_to_dict_and_deepcopy():
    sample = make_sample()
    with tu.trace_span(sample, "s", attrs={"status": Sample.Status.COMPLETED}):
        pass
    restored = Sample.from_dict(copy.deepcopy(sample.to_dict()))
    assert restored.trace == sample.trace
    assert spans(restored)["s"][0]["attrs"] == {"status": "completed"}  # enums stored as their value


def test_tracing_failures_never_break_the_caller():
    sample = make_sample()
    sample.trace = {"trace_id": "t", "events": None}  # corrupt carrier: appends fail inside the helpers
    with tu.trace_span(sample, "x") as span:
        span.set("a", 1)
        tu.trace_event(sample, "e")
    tu.trace_next_attempt(sample)
