"""``--speculative-adaptive`` (speculative_adaptive.py): the drafts a step proposes follow the drafts
accepted, per batch size, by SGLang's rule and config format; in the engine the counts change what is
drafted and never what is emitted."""

from __future__ import annotations

import json

import pytest

from engine_test_utils import generate_in_engine
from slime.backends.embedded_engine.config import parse_args, speculative_config
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner
from slime.backends.embedded_engine.speculative.decoder import DraftModel, SpeculativeConfig, SpeculativeDecoder
from slime.backends.embedded_engine.speculative.adaptive import AdaptiveSteps, StepSlot, load_config

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(5)]


def slot(candidates, initial, **knobs):
    return StepSlot(initial, {**load_config(None)[1], "candidate_steps": candidates, **knobs})


# ---------------------------------------------------------------------- the rule
def test_full_acceptance_moves_up_only_after_the_warm_up_and_at_the_interval():
    s = slot([1, 3, 5, 7], 3)  # the average starts at 2.0 (one below the drafts proposed)
    for batch in range(14):
        assert not s.observe([3, 3]) and s.steps == 3, batch  # 10 warm-up steps, then 4 more of the interval
    expected = 2.0
    for _ in range(15):
        expected = 0.8 * expected + 0.2 * 3
    assert s.observe([3, 3]) and s.steps == 5  # 2.96 > 3 - 0.5: up one; not > 5 - 0.5
    assert s.accepted == pytest.approx(expected)


def test_nothing_accepted_drops_to_no_drafts_then_probes_one_up():
    s = slot([0, 1, 3], 3, down_hysteresis=0.0)
    for _ in range(15):
        s.observe([0, 0, 0])
    assert s.steps == 0 and s.accepted == pytest.approx(2.0 * 0.8**15)  # at or below 0.5 past both lower counts
    for _ in range(4):
        assert not s.observe([])  # plain steps: counted, no average
    assert s.observe([]) and s.steps == 1  # after an interval without drafts: the next count up
    for _ in range(5):
        s.observe([0])
    assert s.steps == 0  # still nothing accepted: back down


def test_hysteresis_and_the_ceiling():
    s = slot([1, 3, 5, 7], 5, down_hysteresis=-0.25, warmup_batches=0, update_interval=1)
    s.accepted = 2.4  # 2.4 > (3 - 0.5) - 0.25: stays at 5 (it would drop without the hysteresis)
    s._move()
    assert s.steps == 5
    s.accepted = 2.2
    s._move()
    assert s.steps == 3
    capped = slot([1, 3, 5, 7], 5, ceiling_coeff=1.0, warmup_batches=0, update_interval=1)
    capped.accepted = 4.4  # not up (4.4 <= 4.5), and the ceiling ceil(4.4 * 1.0) = 5 keeps 5
    capped._move()
    assert capped.steps == 5
    capped.accepted = 2.3  # the rule keeps 5 (2.3 > 2.5 - 0.25); the ceiling ceil(2.3) = 3 lowers it
    capped._move()
    assert capped.steps == 3
    low = slot([1, 3, 5, 7], 3, ceiling_coeff=0.5, warmup_batches=0, update_interval=1)
    low.accepted = 2.4  # the rule keeps 3, the ceiling ceil(1.2) = 2 lowers it to 1
    low._move()
    assert low.steps == 1


def test_batches_route_to_the_largest_size_at_or_below_them_after_rounding_to_a_graph_bucket():
    adaptive = AdaptiveSteps(3)  # SGLang's defaults: 1 -> 1/3/5/7, 8 -> 0/1/3, 32 -> 0/1, 64 -> 0
    # the starting count where a slot has it (3), else its middle candidate (32: 0/1 -> 1)
    assert [adaptive.steps(b) for b in (1, 7, 8, 31, 32, 64, 500)] == [3, 3, 3, 3, 1, 0, 0]
    assert adaptive.slot(7) is adaptive.slots[1] and adaptive.slot(8) is adaptive.slots[8]
    graphed = AdaptiveSteps(3, batch_buckets=[1, 2, 4, 8, 16, 24, 32])
    assert graphed.slot(5) is graphed.slots[8] and graphed.slot(25) is graphed.slots[32]
    assert adaptive.max_steps == 7


def test_config_errors_name_the_file_and_the_key(tmp_path, tiny_model_dir):
    cases = {"{": "not JSON \\(line 1", '[1]': "must be a JSON object",
             '{"1": {"candidate_steps": [1, -2]}}': "batch size 1: candidate_steps must be",
             '{"1": {"candidate_steps": []}}': "candidate_steps must be", '{"ema": 1, "1": {"candidate_steps": [1]}}':
             "unknown key 'ema'", '{"ema_alpha": 0.5}': "needs at least one batch size",
             '{"8": {"candidate_steps": [1], "ema_alpha": 0}}': "batch size 8: ema_alpha must be in",
             '{"8": {"candidate_steps": [1], "update_interval": 0}}': "update_interval must be an int >= 1",
             '{"8": {"candidate_steps": [1], "speed": 2}}': "unknown keys \\['speed'\\]"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"c{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as error:
            load_config(str(path))
        assert str(path) in str(error.value)
    with pytest.raises(ValueError, match="cannot read it"):
        load_config(str(tmp_path / "missing.json"))
    base = ["--model-path", tiny_model_dir]
    with pytest.raises(SystemExit, match="--speculative-adaptive-config .* needs --speculative-adaptive"):
        parse_args(base + ["--speculative-algorithm", "NGRAM", "--speculative-adaptive-config", str(path)])
    with pytest.raises(SystemExit, match="--speculative-adaptive needs --speculative-algorithm"):
        parse_args(base + ["--speculative-adaptive"])
    with pytest.raises(SystemExit, match="unknown keys"):  # refused at start, not at the first step
        parse_args(base + ["--speculative-algorithm", "NGRAM", "--speculative-adaptive",
                           "--speculative-adaptive-config", str(path)])
    config = speculative_config(parse_args(base + ["--speculative-algorithm", "NGRAM", "--speculative-adaptive"]))
    assert config.adaptive and config.adaptive_config is None


# ---------------------------------------------------------------------- the engine
def write_config(tmp_path, config: dict) -> str:
    path = tmp_path / f"adaptive{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(config))
    return str(path)


def generate(model_dir, params, algorithm=None, num_draft_tokens=4, adaptive=None, draft_dir=None, prompts=PROMPTS):
    """Outputs, the engine's counters (with ``adaptive``: the slots' state at the end, as /get_server_info
    shows it) and each verify step's (rows, drafts proposed)."""
    runner = ModelRunner(model_dir, device="cpu", num_slots=8)
    speculative = None
    if algorithm is not None:
        config = SpeculativeConfig(algorithm, num_draft_tokens, draft_dir, adaptive=adaptive is not None,
                                   adaptive_config=adaptive)
        draft = DraftModel(ModelRunner(draft_dir, device="cpu", num_slots=8), runner, 256) if draft_dir else None
        speculative = SpeculativeDecoder(config, draft)
    steps = []
    if speculative is not None:
        verify = speculative._verify

        def recorded(engine, running, drafts, *rest):
            steps.append((len(running), sum(len(d) for d in drafts)))
            return verify(engine, running, drafts, *rest)

        speculative._verify = recorded
    engine = Engine(runner, speculative=speculative, seed=1)
    engine.start()
    try:
        seqs = generate_in_engine(engine, prompts, params)
        stats = dict(vars(engine.scheduler.stats))
        if speculative is not None and speculative.adaptive is not None:
            stats["adaptive"] = speculative.adaptive.state()
        return [s.output_ids for s in seqs], stats, steps
    finally:
        engine.stop()


def greedy(max_new_tokens):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def test_no_drafts_for_a_batch_size_whose_only_count_is_zero(tiny_model_dir, tmp_path):
    """NGRAM on looping prompts drafts without the flag; with ``{"1": [0]}`` it never drafts, and the
    outputs are plain decoding's either way."""
    params = [greedy(10 + 3 * i) for i in range(5)]
    plain, _, _ = generate(tiny_model_dir, params)
    fixed, fixed_stats, _ = generate(tiny_model_dir, params, "NGRAM")
    off, off_stats, off_steps = generate(tiny_model_dir, params, "NGRAM",
                                         adaptive=write_config(tmp_path, {"1": {"candidate_steps": [0]}}))
    assert fixed == off == plain
    assert fixed_stats["spec_proposed_drafts"] > 0
    assert off_stats["spec_proposed_drafts"] == 0 and off_steps == []


def test_large_batches_decode_plainly_and_the_tail_drafts(tiny_model_dir, tmp_path):
    """``{"1": [3], "4": [0]}``: no drafts while 4 or 5 rows decode, drafts once the batch has shrunk
    below 4 (rows of different lengths finish one by one) — the rollout tail."""
    params = [greedy(6 + 6 * i) for i in range(5)]
    plain, _, _ = generate(tiny_model_dir, params)
    config = write_config(tmp_path, {"1": {"candidate_steps": [3]}, "4": {"candidate_steps": [0]}})
    outputs, stats, steps = generate(tiny_model_dir, params, "NGRAM", adaptive=config)
    assert outputs == plain
    assert all(drafts == 0 for rows, drafts in steps if rows >= 4)
    assert any(drafts > 0 for rows, drafts in steps if rows < 4) and stats["spec_proposed_drafts"] > 0


def test_accepted_drafts_raise_the_count(tiny_model_dir, tmp_path):
    """Draft model = target (greedy: every draft accepted), starting at 1 draft a step with candidates
    1 and 3, no warm-up and the average = the last step's: after the first verify step it proposes 3,
    so the 25 tokens take fewer target forwards than at a fixed 1 draft, with the same output."""
    params = [greedy(25)]
    config = write_config(tmp_path, {"ema_alpha": 1.0, "1": {"candidate_steps": [1, 3], "warmup_batches": 0,
                                                               "update_interval": 1}})
    fixed, fixed_stats, fixed_steps = generate(tiny_model_dir, params, "STANDALONE", 2, draft_dir=tiny_model_dir,
                                               prompts=PROMPTS[:1])
    adaptive, stats, steps = generate(tiny_model_dir, params, "STANDALONE", 2, config, tiny_model_dir,
                                      prompts=PROMPTS[:1])
    assert adaptive == fixed
    assert [d for _, d in fixed_steps] == [1] * 12  # 1 + 12 x 2 tokens
    assert [d for _, d in steps][:3] == [1, 3, 3]
    assert stats["spec_accepted_drafts"] == stats["spec_proposed_drafts"]
    assert stats["spec_verify_forwards"] < fixed_stats["spec_verify_forwards"]
    state = stats["adaptive"]["1"]  # what /get_server_info shows
    assert state["steps"] == 3 and state["changes"] == 1 and state["batches"] == stats["spec_verify_forwards"]


def test_the_server_reports_each_slots_count(tiny_model_dir, tmp_path):
    """A served engine with the flags: its outputs and ``/get_server_info``'s per-slot state after a
    copy-heavy request (the 1-row slot starts at 1 draft and climbs with every draft accepted)."""
    import httpx

    from slime.backends.embedded_engine.serving.launch import running_engine

    config = write_config(tmp_path, {"ema_alpha": 1.0, "1": {"candidate_steps": [1, 3], "warmup_batches": 0,
                                                               "update_interval": 1}, "4": {"candidate_steps": [0]}})
    args = ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "1", "--speculative-adaptive",
            "--speculative-adaptive-config", config]
    with running_engine(tiny_model_dir, extra_args=args) as server:
        body = {"input_ids": PROMPTS[4], "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
        out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        state = httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]["speculative_adaptive"]
    plain, _, _ = generate(tiny_model_dir, [greedy(24)], prompts=PROMPTS[4:])
    assert out["output_ids"] == plain[0]
    assert out["meta_info"]["spec_num_proposed_drafts"] > 0
    assert state["4"] == {"steps": 0, "accepted_ema": -1.0, "batches": 0, "changes": 0}
    assert state["1"]["batches"] == out["meta_info"]["spec_verify_ct"] and state["1"]["changes"] >= 1  # it climbed


def test_counts_above_the_flags_verify_in_windows_of_their_own_width(tiny_model_dir, tmp_path):
    """``--speculative-num-draft-tokens 2`` with an adaptive count of 3: rows of 0-3 drafts verify together
    in windows of 1 + 3 tokens (the T-token decode step), with plain decoding's outputs."""
    params = [greedy(16 + 2 * i) for i in range(4)]
    plain, _, _ = generate(tiny_model_dir, params, prompts=PROMPTS[1:])
    config = write_config(tmp_path, {"1": {"candidate_steps": [3]}})
    outputs, stats, steps = generate(tiny_model_dir, params, "NGRAM", 2, config, prompts=PROMPTS[1:])
    assert outputs == plain
    assert any(drafts > rows for rows, drafts in steps)  # some row proposed more than the flags' 1 draft
    assert stats["spec_verify_decode_steps"] == stats["spec_verify_forwards"] > 0
