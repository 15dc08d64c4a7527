"""Seeing a real rollout: the embedded engine behind the smg router, profiled with
``tools/profile_rollout.py`` while ``generate_rollout`` runs two steps (dynamic sampling, partial
rollout), the steps dumped as ``--save-debug-rollout-data`` does, and the dump rendered by
``tools/trace_timeline_viewer.py`` — checked as data, over HTTP, and in a real headless Chromium.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.router import running_router
from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from tests.observability.chromium_cdp import HeadlessChromium, find_chromium

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
VIEWER = ROOT / "tools" / "trace_timeline_viewer.py"
PROFILER = ROOT / "tools" / "profile_rollout.py"


def run_tool(script, *argv, check=True):
    result = subprocess.run([sys.executable, str(script), *map(str, argv)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with running_engine(tiny_model_dir, extra_args=["--context-length", "256"]) as engine:
        with running_router("round_robin", worker_urls=[engine.url]) as router:
            yield engine, router


@pytest.fixture(scope="module")
def rollout_run(served, tiny_model_dir, tmp_path_factory):
    """Start a 3-step profile through the router, then run two real rollout steps and dump them."""
    engine, router = served
    workdir = tmp_path_factory.mktemp("observability")
    profile_dir = workdir / "profile"
    started = run_tool(PROFILER, "--router-url", router.url, "--action", "start", "--num-steps", 3,
                       "--output-dir", profile_dir, "--activities", "CPU", "--profile-id", "rollout")
    assert f"{engine.url}: 200" in started.stdout

    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count to {i}."}], "label": str(i)})
                               + "\n" for i in range(16)))
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", tiny_model_dir,
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--over-sampling-batch-size", "3",
        "--num-rollout", "2", "--rollout-max-response-len", "24", "--rollout-temperature", "1.0",
        "--rm-type", "random", "--partial-rollout", "--sglang-server-concurrency", "2",
        "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port)])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    source = RolloutDataSourceWithBuffer(args)
    template = str(workdir / "dump" / "{rollout_id}.pt")
    dumps = []
    for rollout_id in range(2):
        output = generate_rollout(args, rollout_id, source)
        samples = [s for group in output.samples for s in group]
        dumps.append(Path(save_debug_rollout_data(template, samples, rollout_id=rollout_id, evaluation=False)))
    return {"profile_dir": profile_dir, "dumps": dumps, "workdir": workdir}


# ------------------------------------------------------------------------------------------ profiling
def read_chrome_trace(path):
    trace = json.loads(Path(path).read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def test_profile_rollout_writes_chrome_traces_during_a_rollout(rollout_run):
    files = sorted(rollout_run["profile_dir"].glob("*.trace.json"))
    assert [f.name for f in files] == ["engine0-rollout-TP-0.trace.json"]  # stopped by itself after 3 steps
    names = {e.get("name") for e in read_chrome_trace(files[0])}
    assert "engine_prefill" in names or "engine_decode" in names  # the engine's stages, as record_function ranges
    assert any(str(n).startswith("aten::") for n in names)  # and the torch operators under them


def test_profile_until_stop_and_by_stage(served, tmp_path):
    engine, router = served

    def generate(n=4):
        for i in range(n):
            response = httpx.post(router.url + "/generate", timeout=60, json={
                "input_ids": [5, 6, 7, 8 + i], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
            assert response.status_code == 200, response.text

    run_tool(PROFILER, "--engine-urls", engine.url, "--action", "start", "--output-dir", tmp_path / "manual",
             "--activities", "CPU", "--profile-id", "manual")
    generate()
    stopped = run_tool(PROFILER, "--router-url", router.url, "--action", "stop")
    assert "manual-TP-0.trace.json" in stopped.stdout
    assert read_chrome_trace(tmp_path / "manual" / "engine0-manual-TP-0.trace.json")
    again = run_tool(PROFILER, "--router-url", router.url, "--action", "stop", check=False)
    assert again.returncode == 1 and "not in progress" in again.stdout

    run_tool(PROFILER, "--router-url", router.url, "--action", "start", "--num-steps", 2, "--profile-by-stage",
             "--output-dir", tmp_path / "stages", "--activities", "CPU", "--profile-id", "staged")
    generate(6)
    files = sorted(p.name for p in (tmp_path / "stages").glob("*.json"))
    assert files == ["engine0-staged-TP-0-DECODE.trace.json", "engine0-staged-TP-0-PREFILL.trace.json"]
    decode_names = {e.get("name") for e in read_chrome_trace(tmp_path / "stages" / files[0])}
    assert "engine_decode" in decode_names and "engine_prefill" not in decode_names

    bad = httpx.post(engine.url + "/start_profile", json={"activities": ["RPD"]}, timeout=30)
    assert bad.status_code == 400 and "RPD" in bad.text


# ------------------------------------------------------------------------------------------ the viewer
def expected_rows_and_spans(dump):
    import torch

    samples = torch.load(dump, weights_only=False)["samples"]
    spans = sum(1 for s in samples for e in s["trace"]["events"] if e["type"] == "span_start")
    return len(samples), spans


def test_viewer_writes_cache_and_page_from_a_real_rollout(rollout_run):
    dump = rollout_run["dumps"][1]
    result = run_tool(VIEWER, dump, "--no-serve")
    rows, spans = expected_rows_and_spans(dump)
    cache = dump.with_name("1.trace_timeline_cache.json")
    page = dump.with_name("1.trace_timeline_viewer.html")
    assert f"wrote {cache}" in result.stdout and page.is_file()
    timeline = json.loads(cache.read_text())
    assert len(timeline["rows"]) == rows == 6 and sum(len(r["spans"]) for r in timeline["rows"]) == spans
    for row in timeline["rows"]:
        names = [s["name"] for s in row["spans"]]
        # a sample passes generate_and_rm once per step it is in; it generates in at least one of them
        assert names.count("generate_and_rm") >= row["attempts"] and names.count("sglang_generate") >= 1
        lanes = {s["lane"] for s in row["spans"]}
        assert {"prefill", "decode"} <= lanes  # the embedded engine reports its phases
    assert any(row["attempts"] > 1 for row in timeline["rows"])  # a partial sample continued in step 1
    html = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing loaded from elsewhere


def test_viewer_serves_on_localhost(rollout_run):
    dump = rollout_run["dumps"][0]
    process = subprocess.Popen([sys.executable, str(VIEWER), str(dump)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = None
        for line in process.stdout:
            match = re.search(r"serving (http://127\.0\.0\.1:\d+/\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "the viewer did not print where it serves"
        page = httpx.get(url, timeout=30)
        assert page.status_code == 200 and "timeline-data" in page.text
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.skipif(find_chromium() is None, reason="Chromium is not installed (Debian: apt-get install -y chromium; "
                                                     ".ci/run installs it)")
def test_viewer_in_headless_chromium(rollout_run, tmp_path):
    dump = rollout_run["dumps"][1]
    run_tool(VIEWER, dump, "--no-serve", "--out-dir", tmp_path)
    page = tmp_path / "1.trace_timeline_viewer.html"
    rows, spans = expected_rows_and_spans(dump)
    artifacts = Path(os.environ.get("SLIME_TEST_ARTIFACTS", tmp_path / "artifacts"))
    with HeadlessChromium(tmp_path) as browser:
        browser.navigate(page.as_uri())
        assert browser.evaluate("window.TIMELINE_READY === true")
        assert browser.evaluate("document.querySelectorAll('.row').length") == rows
        assert browser.evaluate("document.querySelectorAll('.span-bar').length") == spans
        assert browser.evaluate("document.querySelectorAll('.span-bar[data-span-name=sglang_prefill]').length") > 0
        assert browser.evaluate("document.querySelectorAll('.event-mark').length") > 0
        # click the first engine call with the mouse, as a user would
        box = browser.evaluate("""(() => {  // an engine call that ran (one aborted in the queue has no timings)
            const span = TIMELINE.rows.flatMap(r => r.spans).find(
                s => s.name === 'sglang_generate' && ['stop', 'length'].includes(s.attrs.finish_reason));
            const bar = document.querySelector(`.span-bar[data-span-id="${span.id}"]`);
            bar.scrollIntoView({block: 'center', inline: 'center'});
            const r = bar.getBoundingClientRect();
            return {x: r.left + Math.min(r.width / 2, 20), y: r.top + r.height / 2, w: r.width};
        })()""")
        browser.click(box["x"], box["y"])
        assert browser.evaluate("document.getElementById('details-name').textContent") == "sglang_generate"
        attrs = browser.evaluate("""Object.fromEntries([...document.querySelectorAll('#details-attrs tr')]
            .map(tr => [tr.dataset.key, tr.querySelector('td').textContent]))""")
        assert {"max_new_tokens", "prompt_tokens", "completion_tokens", "finish_reason", "sglang_request_id",
                "e2e_latency", "queue_time"} <= set(attrs), attrs
        assert attrs["max_new_tokens"].isdigit() and attrs["finish_reason"] in ("stop", "length")
        children = browser.evaluate("[...document.querySelectorAll('#details-children th')].map(th => th.textContent)")
        assert "sglang_prefill" in children and "sglang_decode" in children
        shot = browser.screenshot(artifacts / "trace_timeline_viewer.png")
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")
