"""NEXTN speculative decoding (mtp.py): the model's own multi-token-prediction layer drafts, on a tiny
DeepSeek-V3 checkpoint with one MTP layer written into its safetensors by the test.

Two targets: the random tiny DeepSeek-V3 with a random MTP layer (the MTP layer's attention matters:
its drafts are checked against a from-scratch run of the layer over the whole text), and a "Markov"
target whose attention and MLP outputs are zeroed, so that its next token depends on the current
token only: there an MTP layer that forwards the embedding half of its input (``eh_proj = [I, 0]``,
its own attention and MLP zeroed) predicts the target's next-next token exactly, and one that forwards
the hidden half (``[0, I]``) is off by one token, which the acceptance counters must show."""

from __future__ import annotations

import dataclasses
import shutil
from collections import Counter

import pytest
import torch

from engine_test_utils import (assert_sequences_follow, exact_sequence_probs, generate_in_engine, hf_logprobs, load_hf,
                               markov_checkpoint)
from slime.backends.embedded_engine.config import parse_args
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import SamplingParams
from slime.backends.embedded_engine.kv_cache import SlotKVCache
from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner
from slime.backends.embedded_engine.speculative.mtp import NextNDrafter, add_mtp_layer
from slime.backends.embedded_engine.speculative.decoder import SpeculativeConfig, SpeculativeDecoder, spec_meta_info

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(4)]
def with_random_mtp(base: str, out) -> str:
    """A copy of ``base`` with a random MTP layer (weights large enough that its attention matters)."""
    shutil.copytree(base, out)
    add_mtp_layer(str(out), seed=1, std=0.1)
    return str(out)


@pytest.fixture(scope="module")
def mtp_dir(tiny_deepseek_v3_dir, tmp_path_factory):
    return with_random_mtp(tiny_deepseek_v3_dir, tmp_path_factory.mktemp("nextn") / "random")


@pytest.fixture(scope="module")
def markov_dirs(tiny_deepseek_v3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("markov")
    return {name: markov_checkpoint(tiny_deepseek_v3_dir, root / name, mtp, noise)
            for name, mtp, noise in (("exact", "exact", 0.0), ("wrong", "wrong", 0.0), ("noisy", "exact", 0.03))}


def make_engine(model_dir, nextn: bool, steps: int = 3, slots: int = 8):
    runner = ModelRunner(model_dir, device="cpu", num_slots=slots)
    speculative = None
    if nextn:
        speculative = SpeculativeDecoder(SpeculativeConfig("NEXTN", steps + 1), NextNDrafter(runner, 256))
    engine = Engine(runner, speculative=speculative, seed=1)
    engine.start()
    return engine


def run(model_dir, prompts, params_list, nextn=True, steps=3):
    engine = make_engine(model_dir, nextn, steps)
    try:
        return generate_in_engine(engine, prompts, params_list), dict(vars(engine.scheduler.stats))
    finally:
        engine.stop()


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def accept_rate(stats):
    return stats["spec_accepted_drafts"] / stats["spec_proposed_drafts"]


# ---------------------------------------------------------------------- flags and start-up errors
def test_flags_accept_nextn_and_eagle_and_refuse_models_without_mtp_layers(tiny_deepseek_v3_dir, mtp_dir,
                                                                            tiny_model_dir):
    from slime.backends.embedded_engine.__main__ import build_speculative
    from slime.backends.embedded_engine.config import speculative_config

    for name in ("NEXTN", "nextn", "EAGLE"):  # SGLang routes NEXTN to EAGLE: both draft with the MTP layer
        config = speculative_config(parse_args(["--model-path", mtp_dir, "--speculative-algorithm", name]))
        assert (config.algorithm, config.max_drafts) == ("NEXTN", 3)  # SGLang's DeepSeek default: 3 steps
    args = parse_args(["--model-path", mtp_dir, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                       "--speculative-draft-model-path", mtp_dir, "--max-running-requests", "4"])
    runner = ModelRunner(mtp_dir, device="cpu", num_slots=4)
    decoder = build_speculative(args, runner, 256)
    assert decoder.config.max_drafts == 2 and runner.mtp is decoder.draft.layer
    assert decoder.draft.kv_cache.shape.num_layers == 1 and decoder.draft.kv_cache.shape.num_slots == 4
    with pytest.raises(SystemExit, match="--speculative-draft-model-path .* drop the draft path"):
        parse_args(["--model-path", mtp_dir, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                    tiny_model_dir])
    with pytest.raises(SystemExit, match="EAGLE3 needs"):
        parse_args(["--model-path", mtp_dir, "--speculative-algorithm", "EAGLE3"])
    # Qwen3 has no MTP layers; the stock tiny DeepSeek-V3 says it has one but its files hold none
    for model_dir, message in ((tiny_model_dir, "num_nextn_predict_layers = None"),
                               (tiny_deepseek_v3_dir, "no tensor of its safetensors files .* model.layers.4")):
        args = parse_args(["--model-path", model_dir, "--speculative-algorithm", "NEXTN"])
        with pytest.raises(SystemExit, match=f"--speculative-algorithm NEXTN.*{message}"):
            build_speculative(args, ModelRunner(model_dir, device="cpu", num_slots=2), 256)


def test_mtp_weight_names_map_as_sglangs_loader(mtp_dir):
    """Checkpoint names -> the block: enorm/hnorm/eh_proj/shared_head.norm are its own, the rest of
    model.layers.4 its decoder layer (experts one by one into the fused parameters), the layer's
    embed_tokens / shared_head.head copies and later MTP layers are not served, lower layers are not its."""
    from safetensors.torch import load_file

    runner = ModelRunner(mtp_dir, device="cpu", num_slots=2)
    layer = NextNDrafter(runner, 256).layer
    assert [layer.local_name(f"model.layers.4.{n}") for n in ("enorm.weight", "shared_head.norm.weight",
                                                              "self_attn.q_a_proj.weight", "embed_tokens.weight",
                                                              "shared_head.head.weight")] == \
        ["enorm.weight", "shared_head.norm.weight", "decoder.self_attn.q_a_proj.weight", None, None]
    assert layer.owns("model.layers.5.enorm.weight") and not layer.owns("model.layers.3.mlp.gate.weight")
    assert layer.load("model.layers.5.enorm.weight", torch.zeros(128)) == 0  # a second MTP layer: not served
    checkpoint = load_file(f"{mtp_dir}/model.safetensors")
    assert "model.layers.4.shared_head.head.weight" in checkpoint  # written, as DeepSeek-V3's hold it; skipped
    expert = checkpoint["model.layers.4.mlp.experts.3.up_proj.weight"]
    fused = layer.decoder.mlp.experts.gate_up_proj
    assert torch.equal(fused[3, fused.shape[1] // 2:], expert)  # loaded at start from the checkpoint's files
    assert torch.equal(runner.get_weight("model.layers.4.mlp.experts.3.up_proj.weight"), expert)
    runner.load_named_tensors([("model.layers.4.mlp.experts.3.up_proj.weight", expert + 1)])
    assert torch.equal(fused[3, fused.shape[1] // 2:], expert + 1)
    with pytest.raises(KeyError, match="shared_head.head are the model's"):
        runner.get_weight("model.layers.4.shared_head.head.weight")


# ---------------------------------------------------------------------- the drafts are the MTP layer's
def reference_logits(drafter, hidden, tokens, drafts):
    """The MTP layer run from scratch over the whole text, in a fresh cache, for each chained draft:
    positions p = 0..n-2 take (h_p, t_{p+1}); chained step j appends (its previous output, draft j)."""
    runner = drafter.runner
    cache = SlotKVCache(dataclasses.replace(drafter.kv_cache.shape, num_slots=1), runner.dtype, runner.device)
    states, fed, out = hidden[: len(tokens) - 1], list(tokens[1:]), []
    with torch.inference_mode():
        for j in range(len(drafts)):
            ids, positions, mask, view = runner.row_inputs([0], [ForwardRow(fed, 0)], cache)
            embeds = runner.model.get_input_embeddings()(ids)
            last = drafter.layer(embeds, states[None], runner.model.get_decoder().rotary_emb(embeds, positions),
                                 mask, view)[0, -1:]
            out.append(runner.model.get_output_embeddings()(last)[0].float())
            states, fed = torch.cat((states, last)), fed + [drafts[j]]
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_drafts_are_the_mtp_layers_over_the_whole_text(arch, mtp_dir, request, tmp_path):
    """Every proposal of a sampled run (rows finishing at different steps, drafts accepted and rejected,
    all rows retracted and re-prefilled after the third proposal) equals the MTP layer run from scratch
    over the text so far: its cache holds exactly the target's hidden states of the verified positions,
    whatever was accepted, rejected, moved or retracted. GLM-4.5 has the same MTP layout (SGLang's
    glm4_moe_nextn) and is served the same way."""
    if arch == "glm4_moe":
        mtp_dir = with_random_mtp(request.getfixturevalue("tiny_glm4_moe_dir"), tmp_path / "glm")
    engine = make_engine(mtp_dir, True, steps=3)
    drafter, proposals, calls = engine.speculative.draft, [], []
    propose = drafter.propose

    def recording(seqs, ks, settings, generator, batch_size):
        drafts, probs = propose(seqs, ks, settings, generator, batch_size)
        proposals.extend((list(seq.fill_ids), d, q) for seq, d, q in zip(seqs, drafts, probs))
        calls.append(len(seqs))
        if len(calls) == 3:  # between this step and the next: retract every running row, resume
            engine.call(lambda: engine.pause("retract"))
            engine.call(lambda: setattr(engine, "paused", False))
        return drafts, probs

    drafter.propose = recording
    try:
        params = [SamplingParams(max_new_tokens=8 + 4 * i, temperature=1.0, ignore_eos=True) for i in range(4)]
        seqs, stats = generate_in_engine(engine, PROMPTS, params), dict(vars(engine.scheduler.stats))
    finally:
        engine.stop()
    assert 0 < stats["spec_accepted_drafts"] < stats["spec_proposed_drafts"]
    # both verify as T-token decode steps (GLM-4.5's GQA, DeepSeek-V3's absorbed multi-latent attention),
    # whose hidden states feed the MTP layer
    assert stats["spec_verify_forwards"] > 0
    assert stats["spec_verify_decode_steps"] == stats["spec_verify_forwards"]
    retracted = [seq for seq in seqs if seq.num_retractions]  # the rows still running at the third step
    assert retracted and max(len(s.output_ids) for s in retracted) > 12 and len(calls) > 3, calls
    model = load_hf(mtp_dir)
    with torch.no_grad():
        finals = {tuple(s.prompt_ids + s.output_ids): model.model(torch.tensor([s.prompt_ids + s.output_ids]))
                  .last_hidden_state[0] for s in seqs}
    checked = 0
    for tokens, drafts, q in proposals:
        full = next(k for k in finals if list(k[: len(tokens)]) == tokens)
        expected = torch.softmax(reference_logits(drafter, finals[full], tokens, drafts), dim=-1)  # T = 1
        assert torch.allclose(q, expected, atol=1e-5), (tokens, (q - expected).abs().max())
        checked += 1
    assert checked >= 8


# ---------------------------------------------------------------------- output = the target's
@pytest.mark.parametrize("target", ["random", "noisy"])
def test_greedy_equals_plain_greedy_and_logprobs_are_the_targets(target, mtp_dir, markov_dirs):
    model_dir = mtp_dir if target == "random" else markov_dirs["noisy"]
    params = [greedy(10 + 3 * i) for i in range(4)]
    plain, _ = run(model_dir, PROMPTS, params, nextn=False)
    spec, stats = run(model_dir, PROMPTS, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    model = load_hf(model_dir)
    for prompt, seq in zip(PROMPTS, spec):
        assert seq.output_logprobs == pytest.approx(hf_logprobs(model, prompt, seq.output_ids, 0.0), abs=1e-4)
    assert stats["spec_verify_forwards"] > 0 and stats["spec_proposed_drafts"] > 0
    if target == "noisy":  # accepted and rejected drafts both seen, so fewer target forwards
        assert 0 < stats["spec_accepted_drafts"] < stats["spec_proposed_drafts"]
        assert stats["decode_steps"] < sum(len(s.output_ids) - 1 for s in spec)


def test_acceptance_tells_an_exact_mtp_layer_from_a_wrong_one(markov_dirs):
    """The exact MTP layer's drafts are the target's own next tokens: all accepted, greedy or sampled
    (q = p); the off-by-one layer's are mostly rejected; the per-request counters say the same."""
    exact, stats = run(markov_dirs["exact"], PROMPTS[:2], [greedy(13)] * 2)
    assert accept_rate(stats) == 1.0
    meta = spec_meta_info(exact[0])  # 13 tokens: 1 from prefill + 3 verify steps of 3 drafts + 1 bonus
    assert meta["spec_verify_ct"] == 3 and meta["spec_accept_rate"] == 1.0
    assert meta["spec_accept_length"] == pytest.approx(13 / 3) and meta["spec_correct_drafts_histogram"] == [0, 0, 0, 3]
    sampled = [SamplingParams(max_new_tokens=13, temperature=1.0, ignore_eos=True)] * 4
    _, stats = run(markov_dirs["exact"], PROMPTS, sampled)
    assert accept_rate(stats) > 0.95, stats
    _, stats = run(markov_dirs["wrong"], PROMPTS, [greedy(13)] * 4)
    assert accept_rate(stats) < 0.3, stats


def test_sampled_sequences_follow_the_target_distribution(mtp_dir):
    """400 samples of 4 tokens (top-k 2: 16 possible sequences, 2 drafts per step): chi-square against
    the exact probabilities of the target (the STANDALONE/NGRAM test's pattern)."""
    model_dir = mtp_dir
    prompt, n = [5, 6, 7, 5, 6, 7], 400
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    seqs, stats = run(model_dir, [prompt] * n, [params] * n, steps=2)
    assert 0 < stats["spec_accepted_drafts"] < stats["spec_proposed_drafts"]
    exact = exact_sequence_probs(load_hf(model_dir), prompt, 4, top_k=2)
    assert_sequences_follow(exact, Counter(tuple(s.output_ids) for s in seqs), n)


# ---------------------------------------------------------------------- weight updates reach the MTP layer
def test_weight_updates_reach_the_mtp_layer(markov_dirs, tmp_path):
    """On the engine thread, through the runner methods the update routes call: a tensor update of
    ``model.layers.4.eh_proj.weight`` (a checkpoint name, through the wire format of
    /update_weights_from_tensor) turns the off-by-one MTP layer exact (every draft accepted); a disk
    update (/update_weights_from_disk) from a checkpoint transformers saved (no MTP tensors, as the
    trainer's would be) keeps it; one from the off-by-one checkpoint makes it wrong again;
    get_weight (/get_weights_by_name) reads the layer by that name."""
    from safetensors.torch import load_file

    from slime.backends.update_weight import wire_format

    exact = load_file(f"{markov_dirs['exact']}/model.safetensors")["model.layers.4.eh_proj.weight"]
    engine = make_engine(markov_dirs["wrong"], True)
    runner = engine.runner

    def rate():
        before = dict(vars(engine.scheduler.stats))
        generate_in_engine(engine, PROMPTS[:2], [greedy(13)] * 2)
        after = vars(engine.scheduler.stats)
        return (after["spec_accepted_drafts"] - before["spec_accepted_drafts"]) / \
            (after["spec_proposed_drafts"] - before["spec_proposed_drafts"])

    try:
        assert rate() < 0.5
        wire_format.use_file_system_sharing()
        payload = wire_format.serialize_for_engine([("model.layers.4.eh_proj.weight", exact.clone().share_memory_())])
        named = wire_format.deserialize_named_tensors(payload, None)
        assert engine.call(lambda: runner.load_named_tensors(named)).result(30) == 1
        assert torch.equal(runner.get_weight("model.layers.4.eh_proj.weight"), exact)
        assert rate() == 1.0
        load_hf(markov_dirs["exact"]).save_pretrained(tmp_path / "saved")  # transformers drops model.layers.4.*
        assert not [k for k in load_file(f"{tmp_path}/saved/model.safetensors") if ".layers.4." in k]
        engine.call(lambda: runner.load_from_disk(str(tmp_path / "saved"))).result(60)
        assert rate() == 1.0
        loaded = engine.call(lambda: runner.load_from_disk(markov_dirs["wrong"])).result(60)
        assert loaded >= len([k for k in load_file(f"{markov_dirs['wrong']}/model.safetensors") if ".layers.4." in k])
        assert rate() < 0.5
        with pytest.raises(KeyError, match="model.layers.4.mlp.nonsense.weight"):
            runner.load_named_tensors([("model.layers.4.mlp.nonsense.weight", exact)])
    finally:
        engine.stop()


@pytest.mark.parametrize("quantization", ["fp8", "w8a8_fp8"])
def test_fp8_engine_drafts_with_its_unquantized_mtp_layer_and_updates_reach_it(markov_dirs, quantization):
    """``--quantization fp8`` (block-wise) / ``w8a8_fp8`` (per channel, routed experts included) quantizes the
    target's decoder layers only: the MTP layer (``model.layers.4.*``,
    past the decoder) stays in the model dtype — no FP8 storage claims its names — so an update by
    checkpoint name or from disk still reaches it: the off-by-one layer's drafts are rejected, the exact
    one's (read from disk into the FP8 engine) all accepted, and /get_weights_by_name reads its exact values."""
    from safetensors.torch import load_file

    runner = ModelRunner(markov_dirs["wrong"], device="cpu", num_slots=8, quantization=quantization)
    assert runner.fp8 is not None and runner.fp8.owns("model.layers.0.self_attn.o_proj.weight")
    assert runner.fp8.experts  # the target's routed experts are FP8 too
    assert not any(runner.fp8.owns(f"model.layers.4.{name}") for name in
                   ("eh_proj.weight", "self_attn.o_proj.weight", "mlp.experts.0.down_proj.weight"))
    engine = Engine(runner, speculative=SpeculativeDecoder(SpeculativeConfig("NEXTN", 4), NextNDrafter(runner, 256)),
                    seed=1)
    engine.start()

    def rate():
        before = dict(vars(engine.scheduler.stats))
        generate_in_engine(engine, PROMPTS[:2], [greedy(13)] * 2)
        after = vars(engine.scheduler.stats)
        return (after["spec_accepted_drafts"] - before["spec_accepted_drafts"]) / \
            (after["spec_proposed_drafts"] - before["spec_proposed_drafts"])

    try:
        assert rate() < 0.5
        engine.call(lambda: runner.load_from_disk(markov_dirs["exact"])).result(60)
        assert rate() == 1.0
        exact = load_file(f"{markov_dirs['exact']}/model.safetensors")["model.layers.4.eh_proj.weight"]
        assert torch.equal(runner.get_weight("model.layers.4.eh_proj.weight"), exact)
    finally:
        engine.stop()
