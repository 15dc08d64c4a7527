"""Every rule reward type on a table of known cases, plus dispatch, boxed_ prefix and remote_rm retries."""

import asyncio
import json
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.rm_hub import remote as remote_rm_module
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score, normalize_answer
from slime.rollout.rm_hub.gpqa import DEFAULT_VALID_LETTERS, compute_gpqa_reward
from slime.rollout.rm_hub.ifbench import INSTRUCTION_CHECKS, compute_ifbench_reward
from slime.rollout.rm_hub.math_dapo_utils import compute_score, normalize_final_answer
from slime.rollout.rm_hub.math_utils import (
    compute_math_reward,
    extract_boxed_answer,
    grade_answer_mathd,
    grade_answer_sympy,
    grade_answer_verl,
    last_boxed_only_string,
)
from slime.utils.types import Sample

MATH_CASES = [
    (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1),
    (r"first \boxed{2} then \boxed{3}", "3", 1),
    (r"first \boxed{3} then \boxed{2}", "3", 0),
    (r"\boxed{\boxed{7}}", "7", 1),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", 1),
    (r"\boxed{5 \text{ cm}}", "5", 1),
    (r"\boxed{12\text{ dollars}}", "12", 1),
    (r"\boxed{10\%}", "10", 1),
    (r"\boxed{90^\circ}", "90", 1),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1),
    (r"\boxed{(1,2)}", "(1, 2)", 1),
    (r"\boxed{1,000}", "1000", 1),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1),
    (r"\boxed{3}", "4", 0),
    ("no boxed answer 3", "3", 0),
    (r"\boxed{3}", "", 0),
    (r"\boxed{3}", r"\boxed{3}", 1),
]


@pytest.mark.parametrize("response,label,expected", MATH_CASES)
def test_math(response, label, expected):
    assert compute_math_reward(response, label) == expected


def test_boxed_helpers():
    assert last_boxed_only_string(r"a \boxed{\frac{1}{2}} b") == r"\boxed{\frac{1}{2}}"
    assert extract_boxed_answer(r"\boxed{\frac{1}{\boxed{2}}}") == "2"  # the last \boxed wins
    assert extract_boxed_answer(r"x \fbox{4}") == "4"
    assert extract_boxed_answer("none") is None
    assert grade_answer_mathd("0.5", r"\frac{1}{2}")
    assert grade_answer_sympy(r"\frac{2}{4}", "0.5")
    assert grade_answer_verl(r"so \boxed{6}", r"\boxed{6}")
    assert not grade_answer_verl(r"so \boxed{6}", "")


DAPO_CASES = [
    ("... so Answer: 42", "42", 1.0, "42"),
    ("Answer: 41\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 42 dollars", "42", 1.0, "42"),
    ("Answer: $1,000$", "1000", 1.0, "1000"),
    ("Answer: 41", "42", -1.0, "41"),
    ("no answer line", "42", -1.0, "[INVALID]"),
    ("Answer: 7", r"\boxed{7}", 1.0, "7"),
    ("Answer: 7", "7.0", 1.0, "7"),
]


@pytest.mark.parametrize("response,label,score,pred", DAPO_CASES)
def test_dapo(response, label, score, pred):
    out = compute_score(response, label)
    assert out == {"score": score, "acc": score > 0, "pred": pred}


def test_dapo_only_reads_last_300_chars():
    assert compute_score("Answer: 42" + "x" * 400, "42")["score"] == -1.0
    assert normalize_final_answer(r"\text{5 inches}") == "5"


DEEPSCALER_CASES = [
    (r"<think>hmm</think> the answer is \boxed{\frac{1}{2}}", "0.5", 1),
    (r"<think>\boxed{2}</think> \boxed{3}", "3", 1),
    (r"<think>\boxed{3}</think> nothing", "3", 0),
    (r"###Response \boxed{4}", r"\boxed{4}", 1),
    (r"no markers \boxed{4}", "4", 0),
    (r"</think> \boxed{4}", "", 0),
    (r"</think> \boxed{4}", "5", 0),
]


@pytest.mark.parametrize("response,label,expected", DEEPSCALER_CASES)
def test_deepscaler(response, label, expected):
    assert get_deepscaler_rule_based_reward(response, label) == expected


def test_f1():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert f1_score("the cat sat", "cat sat")[0] == 1.0
    f1, precision, recall = f1_score("cat sat down", "cat sat")
    assert (precision, recall) == (2 / 3, 1.0) and f1 == pytest.approx(0.8)
    assert f1_score("yes", "no")[0] == 0.0
    assert f1_score("no answer here", "noanswer")[0] == 0.0
    assert f1_score(None, "x") == (0.0, 0.0, 0.0)
    assert f1_score("dog", "cat")[0] == 0.0


GPQA_CASES = [
    ("The answer is B", "B", {"choices": ["w", "x", "y", "z"]}, 1.0),
    ("<think>A looks right</think> Final answer: C", "C", {}, 1.0),
    ("I think (D) is correct.", 3, {"choices": ["a", "b", "c", "d"]}, 1.0),
    ("The answer is A", "paris", {"choices": ["Paris", "Rome"]}, 1.0),
    ("The answer is B", "paris", {"choices": ["Paris", "Rome"]}, 0.0),
    ("Option E", "E", {"valid_letters": ["A", "B", "C", "D", "E"]}, 1.0),
    ("answer: B", None, {"correct_letter": "B"}, 1.0),
    ("it must be Paris", "Paris", {}, 1.0),
]


@pytest.mark.parametrize("response,label,metadata,expected", GPQA_CASES)
def test_gpqa(response, label, metadata, expected):
    assert compute_gpqa_reward(response, label, metadata) == expected
    assert DEFAULT_VALID_LETTERS == list("ABCDEFGHIJ")


IFBENCH_CASES = [
    ("hello world", ["punctuation:no_comma"], [{}], 1.0),
    ("hello, world", ["punctuation:no_comma"], [{}], 0.0),
    ("all lower", ["change_case:english_lowercase"], [{}], 1.0),
    ("ALL UPPER", ["change_case:english_capital"], [{}], 1.0),
    ("one two three", ["length_constraints:number_words"], [{"num_words": 3, "relation": "at least"}], 1.0),
    ("one two three", ["length_constraints:number_words"], [{"num_words": 3, "relation": "less than"}], 0.0),
    ("A. B! C?", ["length_constraints:number_sentences"], [{"num_sentences": 3, "relation": "at least"}], 1.0),
    ("p1 *** p2", ["length_constraints:number_paragraphs"], [{"num_paragraphs": 2}], 1.0),
    ("* a\n* b\n- c", ["detectable_format:number_bullet_lists"], [{"num_bullets": 3}], 1.0),
    ("<<Title>> text", ["detectable_format:title"], [{}], 1.0),
    ('```json\n{"a": 1}\n```', ["detectable_format:json_format"], [{}], 1.0),
    ("SECTION 1 a SECTION 2 b", ["detectable_format:multiple_sections"],
     [{"section_spliter": "SECTION", "num_sections": 2}], 1.0),
    ("*one* and *two*", ["detectable_format:number_highlighted_sections"], [{"num_highlights": 2}], 1.0),
    ("My answer is yes.", ["detectable_format:constrained_response"], [{}], 1.0),
    ("blah. Any other questions?", ["startend:end_checker"], [{"end_phrase": "Any other questions?"}], 1.0),
    ('"quoted"', ["startend:quotation"], [{}], 1.0),
    ("I like cats", ["keywords:existence"], [{"keywords": ["cats"]}], 1.0),
    ("I like cats", ["keywords:forbidden_words"], [{"forbidden_words": ["cats"]}], 0.0),
    ("cat cat cat", ["keywords:frequency"], [{"keyword": "cat", "frequency": 3, "relation": "at least"}], 1.0),
    ("aaa", ["keywords:letter_frequency"], [{"letter": "a", "let_frequency": 2, "let_relation": "less than"}], 0.0),
    ("body\nP.S. bye", ["detectable_content:postscript"], [{"postscript_marker": "P.S."}], 1.0),
    ("[name] at [address]", ["detectable_content:number_placeholders"], [{"num_placeholders": 2}], 1.0),
    ("Repeat me. ok", ["combination:repeat_prompt"], [{"prompt_to_repeat": "Repeat me."}], 1.0),
    ("one ****** two", ["combination:two_responses"], [{}], 1.0),
    ("hello world", ["punctuation:no_comma", "change_case:english_capital"], [{}, {}], 0.0),
    ("hello", ["count:unknown_instruction"], [{}], 0.0),
]  # fmt: skip


@pytest.mark.parametrize("response,ids,kwargs,expected", IFBENCH_CASES)
def test_ifbench(response, ids, kwargs, expected):
    assert compute_ifbench_reward(response, None, {"instruction_id_list": ids, "kwargs": kwargs}) == expected


def test_ifbench_missing_metadata_and_coverage():
    assert compute_ifbench_reward("x", None, {}) == 0.0
    assert len(INSTRUCTION_CHECKS) == 24
    with pytest.raises(ValueError, match="2 instruction ids but 1 kwargs"):
        compute_ifbench_reward("x", None, {"instruction_id_list": ["a", "b"], "kwargs": [{}]})


def _args(**kw):
    base = dict(custom_rm_path=None, rm_type=None, rm_url=None, reward_key=None)
    base.update(kw)
    return Namespace(**base)


def test_dispatch_order_and_boxed_prefix():
    sample = Sample(response=r"blah \boxed{Paris is nice}", label="paris is nice", metadata={})
    assert asyncio.run(async_rm(_args(rm_type="boxed_f1"), sample)) == 1.0
    sample.metadata["rm_type"] = " math "  # metadata beats --rm-type, whitespace stripped
    sample.response, sample.label = r"\boxed{4}", "4"
    assert asyncio.run(async_rm(_args(rm_type="f1"), sample)) == 1
    sample.custom_rm_path = "tests.plugin_contracts.sample_plugins.reward.reward"
    sample.response = "aaxx"
    assert asyncio.run(async_rm(_args(rm_type="f1"), sample)) == 0.5  # per-sample custom RM wins
    assert asyncio.run(async_rm(_args(rm_type="random"), Sample(response="x"))) in (0, 1)


def test_dispatch_errors():
    with pytest.raises(NotImplementedError, match="not specified"):
        asyncio.run(async_rm(_args(), Sample()))
    with pytest.raises(NotImplementedError, match="'nope' is not implemented"):
        asyncio.run(async_rm(_args(rm_type="nope"), Sample()))
    with pytest.raises(ValueError, match="needs --rm-url"):
        asyncio.run(async_rm(_args(rm_type="remote_rm"), Sample()))


async def wrong_length_batched_reward(args, samples, **kwargs):
    return [1.0]


def test_batched_rm_uses_custom_batch_function():
    samples = [Sample(response="a"), Sample(response="bb")]
    args = _args(custom_rm_path="tests.plugin_contracts.sample_plugins.reward.batched_reward")
    assert asyncio.run(batched_async_rm(args, samples)) == [1.0, 2.0]
    args = _args(custom_rm_path="tests.rollout.test_rm_hub.wrong_length_batched_reward")
    with pytest.raises(TypeError, match="must return a list of 2 rewards"):
        asyncio.run(batched_async_rm(args, samples))


class _FlakyRM(BaseHTTPRequestHandler):
    failures_left = 2
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        payload = json.dumps({"score": len(body["response"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *a):
        pass


def test_remote_rm_retries_then_succeeds_and_errors_clearly(monkeypatch):
    monkeypatch.setattr(remote_rm_module, "BACKOFF_BASE_S", 0.01)
    server = HTTPServer(("127.0.0.1", 0), _FlakyRM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/rm"
        sample = Sample(prompt="p", response="abc", label="l")
        assert asyncio.run(async_rm(_args(rm_type="remote_rm", rm_url=url), sample)) == {"score": 3}
        assert _FlakyRM.requests[-1] == {"prompt": "p", "response": "abc", "label": "l"}
        assert len(_FlakyRM.requests) == 3
        _FlakyRM.failures_left = 100
        with pytest.raises(remote_rm_module.RemoteRewardError, match=r"failed after 3 attempts; last error: HTTP 503"):
            asyncio.run(remote_rm_module.remote_rm(_args(rm_url=url), sample, max_retries=3))
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("end", ["", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>", "\n<|im_end|>\n"])
def test_dapo_answer_line_ignores_a_trailing_end_token(end):
    from slime.rollout.rm_hub.math_dapo_utils import compute_score

    assert compute_score("Let me think.\nAnswer: 2" + end, "2") == {"score": 1.0, "acc": True, "pred": "2"}


@pytest.mark.parametrize("response", [None, "", "\\boxed{", "\\boxed{}", "Answer:", "</think>", "<|im_end|>"])
def test_malformed_answers_score_zero_without_raising(response):
    from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
    from slime.rollout.rm_hub.math_dapo_utils import compute_score
    from slime.rollout.rm_hub.math_utils import compute_math_reward

    assert compute_math_reward(response, "2") == 0
    assert compute_score(response, "2")["acc"] is False
    assert get_deepscaler_rule_based_reward(response, "2") == 0
