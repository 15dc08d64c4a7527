"""Speculative decoding on CUDA (marked ``gpu``, skipped without CUDA): the embedded engine serving the
tiny model in fp32 with NGRAM and with a STANDALONE draft (the draft's decode steps go through its
own CUDA graphs), and the tiny DeepSeek-V3 with NEXTN (its MTP layer written into the checkpoint),
checked token by token against HF on the same GPU, as test_gpu.py does.

    python -m pytest tests/backends/embedded_engine/speculative/test_speculative_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from engine_test_utils import generate_concurrently, start_cuda_engine

TOL = 1e-3  # fp32: engine and HF differ by ~1e-6; a genuine near-tie may break either way


def engine(model_dir, *spec):
    return start_cuda_engine(model_dir, "--dtype", "float32", "--context-length", "1024",
                             "--max-running-requests", "32", *spec)


@torch.no_grad()
def check_against_hf(model, prompt, out, temperature):
    ids = out["output_ids"]
    logits = model(torch.tensor([prompt + ids], device="cuda")).logits[0].double()
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(ids)]
    index = torch.arange(len(ids)), torch.tensor(ids, device="cuda")
    if temperature == 0.0:
        gap = (rows.max(dim=-1).values - rows[index]).tolist()
        assert max(gap) <= TOL, f"greedy token is not HF's argmax (logit gaps {gap})"
    t = 1.0 if temperature == 0.0 else temperature
    expected = torch.log_softmax(rows / t, dim=-1)[index].tolist()
    assert [e[0] for e in out["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=TOL)


def random_prompts(n: int = 19) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, 500, (int(k),), generator=gen).tolist() for k in torch.randint(1, 90, (n,), generator=gen)]


def run_and_check(model, proc, prompts, temperature) -> dict:
    """All ``prompts`` at once (rows finishing at different steps), each checked against HF; the
    server's batch stats, which must show verify steps with drafts."""
    lengths = [40 + 7 * i for i in range(len(prompts))]
    try:
        outs, stats = generate_concurrently(proc.url, prompts, lengths, temperature)
    finally:
        proc.stop()
    for prompt, n, out in zip(prompts, lengths, outs):
        assert len(out["output_ids"]) == n
        check_against_hf(model, prompt, out, temperature)
        assert out["meta_info"]["spec_verify_ct"] >= 1
    assert stats["spec_verify_forwards"] > 0 and stats["spec_proposed_drafts"] > 0
    return stats


def assert_verified_as_decode_steps(stats: dict) -> None:
    """Verify steps go through the T-token decode step (CUDA graphs; GQA, and multi-latent attention's
    absorbed decode): every verify forward but those of rows near their slot's end."""
    assert stats["spec_verify_decode_steps"] >= 0.9 * stats["spec_verify_forwards"], stats


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"],
                                  ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3"]],
                         ids=["ngram", "standalone"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_engine_matches_hf_on_cuda(tiny_model_dir, spec, temperature):
    from transformers import AutoModelForCausalLM

    if "STANDALONE" in spec:
        spec = spec + ["--speculative-draft-model-path", tiny_model_dir]  # the draft is the target: all accepted
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda").eval()
    prompts = [p + p for p in random_prompts()]  # repeated text: prompt lookup has matches
    stats = run_and_check(model, engine(tiny_model_dir, *spec), prompts, temperature)
    assert_verified_as_decode_steps(stats)
    if temperature == 0.0 or "STANDALONE" in spec:
        # Sampling at temperature 1, a prompt-lookup draft is accepted with the target's probability of
        # that token, which the tiny random model's spread-out distributions keep small: the H200 run
        # accepted none in 134 verify forwards, so only greedy (or a draft equal to the target) must accept.
        assert stats["spec_accepted_drafts"] > 0
    if "STANDALONE" in spec and temperature == 0.0:
        assert stats["spec_accepted_drafts"] == stats["spec_proposed_drafts"]


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", ["exact", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nextn_engine_matches_hf_on_cuda(tiny_deepseek_v3_dir, tmp_path, mtp, temperature):
    """NEXTN on CUDA: the tiny DeepSeek-V3 (absorbed MLA decode, MoE) with an MTP layer written into its
    checkpoint, fp32, 19 concurrent rows; tokens and log-probs checked against HF on the same GPU. The
    "Markov" target with the exact MTP layer accepts every greedy draft (and nearly every sampled one:
    its q equals p), so a broken MTP cache on CUDA shows in the counters, not only in the speed."""
    import shutil

    from transformers import AutoModelForCausalLM

    from engine_test_utils import markov_checkpoint
    from slime.backends.embedded_engine.speculative.mtp import add_mtp_layer

    if mtp == "exact":
        model_dir = markov_checkpoint(tiny_deepseek_v3_dir, tmp_path / "markov", "exact")
    else:
        model_dir = str(tmp_path / "random")
        shutil.copytree(tiny_deepseek_v3_dir, model_dir)
        add_mtp_layer(model_dir, seed=1, std=0.1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    proc = engine(model_dir, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")
    stats = run_and_check(model, proc, random_prompts(), temperature)
    assert_verified_as_decode_steps(stats)
    if mtp == "exact":
        rate = stats["spec_accepted_drafts"] / stats["spec_proposed_drafts"]
        assert rate > 0.99 if temperature == 0.0 else rate > 0.95, stats  # fp32 near-ties aside: all


@pytest.mark.gpu
def test_nextn_on_a_gqa_model_verifies_in_graphs_with_hidden_states(tiny_glm4_moe_dir, tmp_path):
    """NEXTN on the tiny GLM-4.5 (GQA, MoE) on CUDA: its verify steps replay CUDA graphs that also hand
    the MTP layer the target's hidden states; greedy tokens and log-probs checked against HF."""
    import shutil

    from transformers import AutoModelForCausalLM

    from slime.backends.embedded_engine.speculative.mtp import add_mtp_layer

    model_dir = str(tmp_path / "glm")
    shutil.copytree(tiny_glm4_moe_dir, model_dir)
    add_mtp_layer(model_dir, seed=1, std=0.1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    proc = engine(model_dir, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")
    stats = run_and_check(model, proc, random_prompts(), 0.0)
    assert_verified_as_decode_steps(stats)
