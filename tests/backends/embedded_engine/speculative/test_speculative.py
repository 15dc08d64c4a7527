"""Speculative decoding in the embedded engine (speculative.py): the flags, the acceptance rule's
output distribution, and the engine with n-gram and draft-model drafters against the plain engine
and HF (greedy tokens, sampled distributions, log-probs, stops inside accepted runs, counters)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_test_utils import (assert_sequences_follow, copy_with_weights, exact_sequence_probs, generate_in_engine,
                               hf_logprobs, load_hf)
from slime.backends.embedded_engine.config import parse_args
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner
from slime.backends.embedded_engine.sampler import (RowSampling, _exponential_noise, greedy_distribution,
                                                    sampling_distribution)
from slime.backends.embedded_engine.speculative.acceptance import _uniforms, accept_drafts, accept_greedy
from slime.backends.embedded_engine.speculative.decoder import (DraftModel, SpeculativeConfig, SpeculativeDecoder,
                                                        ngram_propose, SpecState, spec_meta_info)

pytestmark = pytest.mark.timeout(180)

# mixed prompt lengths; repeated text so that prompt lookup has something to find
DRAFT_NOISE = 0.01  # weight noise of the draft model: it agrees with the target on some tokens, not all
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(5)]


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    """A draft model near the target (its weights perturbed): some drafts accepted, some rejected."""
    gen = torch.Generator().manual_seed(3)
    weights = {k: v + DRAFT_NOISE * torch.randn(v.shape, generator=gen) for k, v in load_hf(tiny_model_dir).state_dict().items()}
    return str(copy_with_weights(tiny_model_dir, tmp_path_factory.mktemp("spec") / "draft", weights))


def make_engine(model_dir, spec: str | None = None, draft_dir=None, num_draft_tokens: int = 4, slots: int = 8):
    runner = ModelRunner(model_dir, device="cpu", num_slots=slots)
    speculative = None
    if spec == "NGRAM":
        speculative = SpeculativeDecoder(SpeculativeConfig("NGRAM", num_draft_tokens))
    elif spec == "STANDALONE":
        draft = DraftModel(ModelRunner(draft_dir, device="cpu", num_slots=slots), runner, 256)
        speculative = SpeculativeDecoder(SpeculativeConfig("STANDALONE", num_draft_tokens, draft_dir), draft)
    engine = Engine(runner, speculative=speculative, seed=1)
    engine.start()
    return engine


def run(model_dir, prompts, params_list, spec=None, draft_dir=None, num_draft_tokens=4):
    engine = make_engine(model_dir, spec, draft_dir, num_draft_tokens)
    try:
        seqs = generate_in_engine(engine, prompts, params_list)
        return seqs, dict(vars(engine.scheduler.stats))
    finally:
        engine.stop()


def greedy(max_new_tokens, **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---------------------------------------------------------------------- flags
def test_flags_use_sglang_names_and_refuse_what_the_engine_does_not_run(tiny_model_dir):
    args = parse_args(["--model-path", tiny_model_dir, "--speculative-algorithm", "ngram"])
    from slime.backends.embedded_engine.config import speculative_config

    config = speculative_config(args)
    assert (config.algorithm, config.num_draft_tokens, config.ngram_max_match) == ("NGRAM", 12, 18)  # SGLang's defaults
    args = parse_args(["--model-path", tiny_model_dir, "--speculative-algorithm", "STANDALONE",
                       "--speculative-draft-model", tiny_model_dir, "--speculative-num-steps", "2"])
    assert speculative_config(args).max_drafts == 2
    refused = {("--speculative-algorithm", "EAGLE3"): "EAGLE3 needs",
               ("--speculative-algorithm", "DFLASH"): "DFlash block-diffusion draft",
               ("--speculative-algorithm", "STANDALONE"): "--speculative-draft-model-path",
               ("--speculative-num-steps", "3"): "needs --speculative-algorithm"}
    for (flag, value), message in refused.items():
        with pytest.raises(SystemExit, match=message):
            parse_args(["--model-path", tiny_model_dir, flag, value])
    with pytest.raises(SystemExit, match="--speculative-eagle-topk 4"):
        parse_args(["--model-path", tiny_model_dir, "--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"])
    with pytest.raises(SystemExit, match="--speculative-num-draft-tokens 5 must be --speculative-num-steps"):
        parse_args(["--model-path", tiny_model_dir, "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3",
                    "--speculative-num-draft-tokens", "5"])


def test_server_builds_the_decoder_of_its_flags(tiny_model_dir):
    from slime.backends.embedded_engine.__main__ import build_speculative

    target = ModelRunner(tiny_model_dir, device="cpu", num_slots=4)
    args = parse_args(["--model-path", tiny_model_dir, "--speculative-algorithm", "STANDALONE",
                       "--speculative-draft-model-path", tiny_model_dir, "--max-running-requests", "4"])
    decoder = build_speculative(args, target, 256)
    assert decoder.config.max_drafts == 3 and decoder.draft.runner.kv_cache.shape.num_slots == 4
    assert build_speculative(parse_args(["--model-path", tiny_model_dir]), target, 256) is None


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 7, 2, 3]  # suffix [2, 3]: at 1..2 (then 9) and 5..6 (then 4)
    assert ngram_propose(SpecState(), tokens, max_match=4, k=3) == [4, 5, 6]  # the most recent of equal matches
    tokens = [8, 2, 3, 1, 7, 2, 3, 5, 8, 2, 3]  # [8, 2, 3] occurs once, earlier: the longer match wins
    assert ngram_propose(SpecState(), tokens, max_match=4, k=2) == [1, 7]
    assert ngram_propose(SpecState(), tokens, max_match=1, k=2) == [5, 8]  # only the last token is matched
    assert ngram_propose(SpecState(), [1, 2, 3], max_match=4, k=2) == []


def test_ngram_continues_a_loop_shorter_than_its_drafts():
    # the text loops with period 3: the match 3 tokens back has 3 tokens after it, the 4th repeats the loop
    assert ngram_propose(SpecState(), [9, 1, 2, 3, 1, 2, 3, 1, 2], max_match=4, k=4) == [3, 1, 2, 3]
    assert ngram_propose(SpecState(), [4, 7, 7], max_match=4, k=5) == [7, 7, 7, 7, 7]  # period 1
    # a loop of period 2 inside a longer text, and a far match that has k tokens after it (no loop)
    assert ngram_propose(SpecState(), [5, 8, 6, 8, 6, 8], max_match=2, k=3) == [6, 8, 6]
    assert ngram_propose(SpecState(), [1, 2, 3, 4, 5, 6, 1, 2], max_match=4, k=3) == [3, 4, 5]


# ---------------------------------------------------------------------- the acceptance rule
CHI2_LIMIT = {5: 25.7, 4: 23.5}  # chi-square quantile at p = 1e-4 for 5 and 4 degrees of freedom


def chi2(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(v, 0) - n * float(p)) ** 2 / (n * float(p)) for v, p in enumerate(probs) if p > 0)


def spec_outputs(p, q, rule, rows=20000, seed=0):
    """``rows`` independent verify steps of two drafts (drawn from q, or a fixed n-gram proposal) against
    target distributions p[0..2]; returns the emitted token lists."""
    gen = torch.Generator().manual_seed(seed)
    settings = [[RowSampling(temperature=1.0)] * 3 for _ in range(rows)]
    if q is None:  # n-gram: the same deterministic proposal for every row
        drafts = [[1, 2]] * rows
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(2)], 1).tolist()
        draft_probs = [q] * rows
    probs = p.repeat(rows, 1)
    offsets = list(range(0, 3 * rows, 3))
    return rule(probs, probs.log(), offsets, drafts, draft_probs, settings, gen).tokens


def wrong_rule(probs, logprobs, offsets, drafts, draft_probs, settings, gen):
    """A tempting mistake: on rejection, sample from p instead of the residual norm(max(p - q, 0))."""
    out = accept_drafts(probs, logprobs, offsets, drafts, draft_probs, settings, gen)
    for i, emitted in enumerate(out.tokens):
        if out.accepted[i] < len(drafts[i]):
            emitted[-1] = int(torch.multinomial(probs[offsets[i] + out.accepted[i]], 1, generator=gen))
    return out


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(drafter):
    p = torch.tensor([[0.30, 0.25, 0.05, 0.20, 0.10, 0.10],
                      [0.05, 0.10, 0.40, 0.15, 0.20, 0.10],
                      [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])
    q = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
                      [0.25, 0.05, 0.30, 0.05, 0.05, 0.30]]) if drafter == "draft_model" else None
    for rule, should_pass in ((accept_drafts, True), (wrong_rule, False)):
        emitted = spec_outputs(p, q, rule)
        first = Counter(e[0] for e in emitted)
        second = [e[1] for e in emitted if len(e) > 1]  # rows that accepted the first draft
        stats = [chi2(first, p[0], len(emitted)), chi2(Counter(second), p[1], len(second))]
        if should_pass:
            assert max(stats) < CHI2_LIMIT[5], stats
            assert 0.1 * len(emitted) < len(second) < 0.9 * len(emitted)  # both outcomes happen often
        else:  # the test has the power to see a wrong rule
            assert max(stats) > 10 * CHI2_LIMIT[5], stats


def reference_accept(probs, logprobs, offsets, drafts, draft_probs, settings, gen):
    """The acceptance rule row by row, draft by draft: the slow, obvious form of ``accept_drafts``, with
    the same random draws in the same order (a uniform for every draft, then a noise row per row)."""
    flat = [settings[i][j] for i, d in enumerate(drafts) for j in range(len(d))]
    u = _uniforms(flat, gen, probs.device) if flat else None
    accepted, finals, n = [], [], 0
    for i, d in enumerate(drafts):
        a = 0
        while a < len(d):
            ratio = probs[offsets[i] + a, d[a]]
            if draft_probs is not None:
                ratio = ratio / draft_probs[i][a, d[a]].clamp_min(1e-30)
            if not u[n + a] < ratio:
                break
            a += 1
        n += len(d)
        final = probs[offsets[i] + a]
        if a < len(d):  # rejected: the residual norm(max(p - q, 0)), unless p == q to rounding
            q = torch.zeros_like(final) if draft_probs is None else draft_probs[i][a]
            if draft_probs is None:
                q[d[a]] = 1.0
            residual = (final - q).clamp_min(0.0)
            if residual.sum() > 1e-12:
                final = residual / residual.sum()
        accepted.append(a)
        finals.append(final)
    noise = _exponential_noise((len(drafts), probs.shape[1]), [settings[i][a] for i, a in enumerate(accepted)],
                               gen, probs.device)
    tokens, lps = [], []
    for i, (d, a) in enumerate(zip(drafts, accepted)):
        emitted = d[:a] + [int((finals[i] / noise[i]).argmax())]
        tokens.append(emitted)
        lps.append([float(logprobs[offsets[i] + j, t]) for j, t in enumerate(emitted)])
    return tokens, lps, accepted


def random_verify_step(seed, rows=40, vocab=50, max_drafts=4, with_q=True, greedy=False):
    """Target logits at every verified position, drafts (0..max_drafts a row: half of them the target's
    likely tokens, so that runs of accepted drafts happen) and their q; seeded rows among them."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_drafts + 1, (rows,), generator=gen).tolist()
    offsets = [sum(k + 1 for k in counts[:i]) for i in range(rows)]
    logits = 3 * torch.randn(sum(counts) + rows, vocab, generator=gen)
    settings = []
    for i, k in enumerate(counts):
        seed_i = 100 + i if i % 5 == 0 else None
        row = RowSampling(temperature=0.0 if greedy else 0.9, top_k=-1 if i % 3 else 8, seed=seed_i)
        settings.append([RowSampling(**{**vars(row), "position": 7 + j}) for j in range(k + 1)])
    flat = [s for row in settings for s in row]
    logprobs, probs = sampling_distribution(logits, flat)
    q = [torch.softmax(2 * torch.randn(k, vocab, generator=gen), -1) for k in counts] if with_q else None
    drafts = []
    for i, k in enumerate(counts):
        likely = probs[offsets[i]: offsets[i] + k].argmax(-1).tolist()
        drafts.append([t if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(vocab, (1,), generator=gen))
                       for t in likely])
    return logits, logprobs, probs, offsets, drafts, q, settings


@pytest.mark.parametrize("with_q", [False, True])
def test_batched_acceptance_equals_the_row_by_row_rule(with_q):
    """accept_drafts (all rows at once on the device, one host copy) gives the reference's tokens,
    log-probs and accepted counts exactly, with point-mass and sampled drafts, rows without drafts,
    truncated and seeded rows."""
    seen = Counter()
    for seed in range(6):
        _, logprobs, probs, offsets, drafts, q, settings = random_verify_step(seed, with_q=with_q)
        out = accept_drafts(probs, logprobs, offsets, drafts, q, settings, torch.Generator().manual_seed(seed))
        tokens, lps, accepted = reference_accept(probs, logprobs, offsets, drafts, q, settings,
                                                 torch.Generator().manual_seed(seed))
        assert (out.tokens, out.accepted) == (tokens, accepted)
        assert out.logprobs == lps
        seen.update("full" if a == len(d) else "rejected" for a, d in zip(accepted, drafts) if d)
        seen.update("none" for d in drafts if not d)
    assert min(seen.values()) > 10, seen  # every kind of row occurred
    _, logprobs, probs, offsets, drafts, q, settings = random_verify_step(0, with_q=with_q, max_drafts=0)
    out = accept_drafts(probs, logprobs, offsets, drafts, q, settings, torch.Generator().manual_seed(0))
    assert out.tokens == reference_accept(probs, logprobs, offsets, drafts, q, settings, torch.Generator().manual_seed(0))[0]
    assert out.accepted == [0] * len(drafts)  # a step where no row drafts (NEXTN verifies it anyway)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_acceptance_equals_the_general_rule_on_one_hot_targets(with_q):
    """accept_greedy (argmax comparisons, no distributions, no draws) == accept_drafts on the one-hot p of
    greedy rows, whatever q the drafts came from; top-p replay's kept sets are the argmax alone."""
    for seed in range(4):
        logits, logprobs, probs, offsets, drafts, q, settings = random_verify_step(seed, with_q=with_q, greedy=True)
        flat = [s for row in settings for s in row]
        greedy_logprobs, argmax = greedy_distribution(logits, flat)
        assert torch.equal(greedy_logprobs, logprobs) and torch.equal(probs.argmax(-1), argmax)
        wants = [i % 2 == 0 for i in range(len(drafts))]
        fast = accept_greedy(argmax, logprobs, offsets, drafts, wants)
        general = accept_drafts(probs, logprobs, offsets, drafts, q, settings, torch.Generator().manual_seed(seed), wants)
        assert (fast.tokens, fast.logprobs, fast.accepted) == (general.tokens, general.logprobs, general.accepted)
        assert 0 < sum(fast.accepted) < sum(len(d) for d in drafts)
        for a, b in zip(fast.kept, general.kept):
            assert (a is None and b is None) or [x.tolist() for x in a] == [x.tolist() for x in b]


def test_run_settings_are_the_per_position_ones_where_a_draw_can_tell(tiny_model_dir):
    """A verified run's settings: one object for every position when nothing position-dependent applies,
    else each position's own (its seeded streams, the stop ids banned before min_new_tokens)."""
    from slime.backends.embedded_engine.io_struct import GenerateRequest
    from slime.backends.embedded_engine.scheduler import Sequence

    engine = Engine(ModelRunner(tiny_model_dir, device="cpu", num_slots=2))
    stop = next(iter(engine.eos_token_ids))
    cases = {"plain": dict(ignore_eos=True), "seeded": dict(ignore_eos=True, sampling_seed=3),
             "banned then not": dict(min_new_tokens=4), "banned throughout": dict(min_new_tokens=9),
             "past min_new_tokens": dict(min_new_tokens=1)}
    for name, extra in cases.items():
        params = SamplingParams(max_new_tokens=20, temperature=1.0, **extra)
        seq = Sequence(GenerateRequest(rid=name, input_ids=[5, 6], params=params), max_new_tokens=20)
        seq.output_ids = [7, 8]
        run = SpeculativeDecoder._run_settings(engine, seq, 4)
        per_position = [engine.row_sampling(seq, ahead=j) for j in range(5)]
        assert [s.banned_token_ids for s in run] == [s.banned_token_ids for s in per_position], name
        if params.sampling_seed is not None:
            assert run == per_position
        assert (len({id(s) for s in run}) == 1) == (name in ("plain", "banned throughout", "past min_new_tokens")), name
        assert (stop in run[0].banned_token_ids) == name.startswith("banned")


def test_sampling_distribution_is_what_the_sampler_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(2, 1)
    rows = [RowSampling(temperature=0.7, top_k=4, top_p=0.9), RowSampling(temperature=0.0)]
    _, probs = sampling_distribution(logits, rows)
    assert torch.allclose(probs.sum(1), torch.ones(2))
    assert probs[0, 4:].sum() == 0 and probs[1].tolist() == [1, 0, 0, 0, 0, 0]
    from slime.backends.embedded_engine.sampler import sample

    gen = torch.Generator().manual_seed(0)
    draws = Counter(sample(logits[:1].repeat(20000, 1), rows[:1] * 20000, gen)[0])
    assert chi2(draws, probs[0], 20000) < CHI2_LIMIT[5]


# ---------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def plain_greedy(tiny_model_dir):
    seqs, _ = run(tiny_model_dir, PROMPTS, [greedy(10 + 3 * i) for i in range(5)])
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("spec", ["NGRAM", "STANDALONE"])
def test_greedy_equals_plain_greedy_and_logprobs_are_the_targets(spec, tiny_model_dir, draft_dir, plain_greedy):
    seqs, stats = run(tiny_model_dir, PROMPTS, [greedy(10 + 3 * i) for i in range(5)], spec, draft_dir)
    assert [s.output_ids for s in seqs] == plain_greedy
    model = load_hf(tiny_model_dir)
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_logprobs == pytest.approx(hf_logprobs(model, prompt, seq.output_ids, 0.0), abs=1e-4)
    assert stats["spec_verify_forwards"] > 0
    assert stats["spec_verify_decode_steps"] == stats["spec_verify_forwards"]  # all as T-token decode steps
    assert 0 < stats["spec_accepted_drafts"] < stats["spec_proposed_drafts"]  # accepted and rejected drafts both seen
    assert stats["decode_steps"] < sum(len(s.output_ids) - 1 for s in seqs) / 5 + 5  # fewer target forwards


def test_stop_tokens_inside_an_accepted_run(tiny_model_dir, plain_greedy):
    """Each row stops at a token of its greedy output; with the draft equal to the target every draft is
    accepted, so the stop token lies inside an accepted run and the tokens after it must be dropped."""
    stops = [[out[3]] for out in plain_greedy]
    params = [SamplingParams(max_new_tokens=10 + 3 * i, temperature=0.0, stop_token_ids=stops[i]) for i in range(5)]
    plain, _ = run(tiny_model_dir, PROMPTS, params)
    spec, stats = run(tiny_model_dir, PROMPTS, params, "STANDALONE", tiny_model_dir)
    for p, s, stop in zip(plain, spec, stops):
        assert s.output_ids == p.output_ids and s.output_ids[-1] == stop[0]
        assert s.finish_reason == p.finish_reason == {"type": "stop", "matched": stop[0]}
        assert s.output_logprobs == pytest.approx(p.output_logprobs, abs=1e-5)
    assert stats["spec_accepted_drafts"] == stats["spec_proposed_drafts"] > 0


def test_counters_when_every_draft_is_accepted(tiny_model_dir):
    """Draft model = target, greedy: 13 tokens = 1 from prefill + 3 verify steps of 3 drafts + 1 bonus."""
    seqs, _ = run(tiny_model_dir, PROMPTS[:1], [greedy(13)], "STANDALONE", tiny_model_dir)
    meta = spec_meta_info(seqs[0])
    assert meta["spec_verify_ct"] == 3 and meta["spec_num_proposed_drafts"] == meta["spec_num_correct_drafts"] == 9
    assert meta["spec_accept_rate"] == 1.0 and meta["spec_accept_length"] == pytest.approx(13 / 3)
    assert meta["spec_correct_drafts_histogram"] == [0, 0, 0, 3]
    from slime.backends.embedded_engine.serving.async_engine import AsyncEngine
    from slime.utils.types import Sample

    engine = make_engine(tiny_model_dir)  # the /generate meta_info carries them; slime's Sample reads them
    try:
        sent = AsyncEngine(engine).meta_info(seqs[0], latency=0.1)
    finally:
        engine.stop()
    assert sent["spec_num_correct_drafts"] == 9 and sent["spec_verify_ct"] == 3
    info = Sample.SpecInfo()
    info.add(sent)
    assert (info.spec_accept_rate, info.spec_accept_length) == (1.0, pytest.approx(13 / 3))


@pytest.mark.parametrize("spec", ["NGRAM", "STANDALONE"])
def test_sampled_sequences_follow_the_target_distribution(spec, tiny_model_dir, draft_dir):
    """400 samples of 4 tokens (top-k 2: 16 possible sequences, 2 verify positions per step): chi-square
    against the exact probabilities of the target."""
    prompt, n = [5, 6, 7, 5, 6, 7], 400
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    seqs, stats = run(tiny_model_dir, [prompt] * n, [params] * n, spec, draft_dir, num_draft_tokens=3)
    assert stats["spec_verify_forwards"] > 0 and stats["spec_accepted_drafts"] > 0
    assert stats["spec_verify_decode_steps"] == stats["spec_verify_forwards"]
    exact = exact_sequence_probs(load_hf(tiny_model_dir), prompt, 4, top_k=2)
    assert_sequences_follow(exact, Counter(tuple(s.output_ids) for s in seqs), n)


def test_sampled_logprobs_are_the_targets(tiny_model_dir, draft_dir):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)
    seqs, stats = run(tiny_model_dir, PROMPTS, [params] * 5, "STANDALONE", draft_dir)
    assert stats["spec_accepted_drafts"] > 0
    model = load_hf(tiny_model_dir)
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_logprobs == pytest.approx(hf_logprobs(model, prompt, seq.output_ids, 0.8), abs=1e-4)


def test_seeded_request_is_reproducible_whatever_its_batch(tiny_model_dir, draft_dir):
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, sampling_seed=7)
    alone, _ = run(tiny_model_dir, PROMPTS[:1], [seeded], "STANDALONE", draft_dir)
    others = [SamplingParams(max_new_tokens=8 + i, temperature=1.0, ignore_eos=True) for i in range(4)]
    batched, stats = run(tiny_model_dir, PROMPTS, [seeded] + others, "STANDALONE", draft_dir)
    assert batched[0].output_ids == alone[0].output_ids
    assert stats["spec_accepted_drafts"] > 0


def test_ngram_rows_pause_lookups_that_find_or_win_nothing(tiny_model_dir, monkeypatch):
    """NGRAM back-off: a row whose lookup found nothing, or whose drafts were all rejected, stops looking
    up for 1, 2, 4, .. up to 16 output tokens (an accepted draft ends the pause), and a step where every
    row pauses is the engine's ordinary step — for prompts without repeats, most of a long output;
    the outputs stay the plain engine's (greedy) and every step is counted for the spec metrics."""
    from slime.backends.embedded_engine.speculative import decoder as speculative

    state = SpecState()
    for length, pause in [(10, 1), (11, 2), (13, 4), (17, 8), (25, 16), (41, 16)]:
        state.back_off(length)
        assert (state.backoff, state.resume_at) == (pause, length + pause)

    calls = []
    original = speculative.ngram_propose
    monkeypatch.setattr(speculative, "ngram_propose", lambda *a: calls.append(1) or original(*a))
    prompts = [list(range(100 + 40 * i, 130 + 40 * i)) for i in range(3)]  # no repeats in the prompts
    seqs, _ = run(tiny_model_dir, prompts, [greedy(40) for _ in prompts], "NGRAM")
    plain, _ = run(tiny_model_dir, prompts, [greedy(40) for _ in prompts])
    assert [s.output_ids for s in seqs] == [p.output_ids for p in plain]

    sampled = [SamplingParams(max_new_tokens=80, temperature=1.0, ignore_eos=True, sampling_seed=7 + i) for i in range(3)]
    lookups = {}
    for pause in (16, 0):  # 0: no back-off (every row looks up every step, as before)
        monkeypatch.setattr(speculative, "NGRAM_MAX_BACKOFF", pause)
        calls.clear()
        seqs, stats = run(tiny_model_dir, prompts, sampled, "NGRAM")
        lookups[pause] = (len(calls), stats["spec_verify_forwards"], stats["decode_steps"])
        for seq in seqs:  # every decode step counted once for the spec metrics (accept length = tokens / steps)
            assert spec_meta_info(seq)["spec_verify_ct"] == 79
    assert lookups[0][0] == 78 * 3, lookups  # every row, every step but its last (no room for a draft)
    assert lookups[16][0] < 0.5 * lookups[0][0], lookups  # measured: 24 vs 234
    assert lookups[16][1] < lookups[0][1], lookups  # fewer verify forwards (1 vs 18), the rest ordinary steps
