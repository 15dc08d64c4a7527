"""FSDP routing replay (``--use-rollout-routing-replay`` R3, ``--use-routing-replay`` R2) on the HF MoE
families: replaying the experts transformers' own forward picks gives the plain log-probs; replaying
other experts gives another network, whose log-probs and gradients equal autograd of transformers'
model with those experts forced (weights from its own router scores); R2 records the π_old pass's
routing and refuses a training pass without one. On MoE vision-language models the engine's experts at the
image tokens are the trainer's own, and R3 replays them there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime.backends.training.backend import ModelOutput
from slime.backends.training.worker import TrainWorker
from slime.algorithms import functional as algo
from slime.utils.moe_routing import hf_routers
from tests.backends.fsdp_utils.fsdp_test_utils import full_grads, make_args, make_samples, rank_data

pytestmark = pytest.mark.usefixtures("single_rank")


def _serve(engine, requests):
    """Start ``engine``, run ``requests`` to completion, stop it; their sequences in request order."""
    import threading

    done, left = threading.Event(), [len(requests)]

    def on_event(seq, finished):
        left[0] -= finished
        if not left[0]:
            done.set()

    engine.start()
    try:
        seqs = engine.call(lambda: [engine.add_request(r, on_event) for r in requests]).result(30)
        assert done.wait(120)
    finally:
        engine.stop()
    return seqs


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@torch.no_grad()
def hf_routing(model, tokens: list[int]) -> np.ndarray:
    """``[len − 1, layers, k]``: the experts transformers' forward picks (dense layers zero)."""
    out = np.zeros((len(tokens), model.config.num_hidden_layers, model.config.num_experts_per_tok), dtype=np.int64)
    handles = [router.register_forward_hook(lambda m, a, o, layer=layer: out.__setitem__((slice(None), layer), o[2].numpy()))
               for layer, router in hf_routers(model)]
    model(torch.tensor([tokens]))
    for handle in handles:
        handle.remove()
    return out[:-1]


def forced_forward(model, tokens: list[int], experts: np.ndarray, response: int) -> torch.Tensor:
    """Response log-probs of transformers' model with every router's choice forced to ``experts``
    (its weights: the router's own sigmoid scores / softmax probabilities at them, normalised, scaled)."""
    handles = []
    for layer, router in hf_routers(model):
        forced = torch.as_tensor(np.concatenate([experts[:, layer], np.arange(experts.shape[2])[None]]), dtype=torch.long)

        def force(module, args, output, forced=forced):
            logits = output[0]
            if hasattr(module, "e_score_correction_bias"):  # DeepSeek-V3 / GLM-4.5
                w = torch.sigmoid(logits).gather(1, forced)
                w = w / (w.sum(-1, keepdim=True) + 1e-20) * module.routed_scaling_factor
            else:  # Qwen3-MoE
                w = torch.softmax(logits.float(), -1).gather(1, forced)
                w = (w / w.sum(-1, keepdim=True)).to(logits.dtype)
            return logits, w, forced
        handles.append(router.register_forward_hook(force))
    try:
        rows = model(torch.tensor([tokens])).logits[0][len(tokens) - response - 1: len(tokens) - 1]
    finally:
        for handle in handles:
            handle.remove()
    return algo.compute_log_probs(rows, torch.tensor(tokens[-response:]), 1.0)


def shifted(experts: np.ndarray, moe_layers: list[int], num_experts: int = 8) -> np.ndarray:
    """Other experts at every MoE position (a shift keeps a token's k experts distinct)."""
    out = experts.copy()
    out[:, moe_layers] = (out[:, moe_layers] + 3) % num_experts
    return out


@pytest.mark.parametrize("arch,attn", [("deepseek_v3", "sdpa"), ("qwen3_moe", "sdpa"), ("glm4_moe", "eager"),
                                       ("qwen3_5_moe", "eager"), ("qwen3_next", "eager")])
def test_r3_replays_given_experts(arch, attn, request):
    """sdpa: right-padded rows; eager: one packed row (the layout of flash/varlen attention on GPU)."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = load_hf(model_dir)
    moe_layers = [layer for layer, _ in hf_routers(hf)]
    args = make_args(model_dir, "--use-rollout-routing-replay", "--num-steps-per-rollout", "1",
                     "--fsdp-attn-implementation", attn, rbs=2)
    worker = TrainWorker(args)
    worker.init()
    backend = worker.backend
    samples = make_samples(4)
    for s in samples:
        s.rollout_routed_experts = hf_routing(hf, s.tokens).tolist()
    data = rank_data(args, samples)
    replayed = backend.forward_only("model", data, ModelOutput("log_probs"))[0]
    routing, backend.routing = backend.routing, None
    plain = backend.forward_only("model", data, ModelOutput("log_probs"))[0]
    backend.routing = routing
    for a, b in zip(replayed, plain):  # HF's own choices replayed: the plain network
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    for s in samples:
        s.rollout_routed_experts = shifted(np.asarray(s.rollout_routed_experts), moe_layers)
    other = rank_data(args, samples)
    forced = backend.forward_only("model", other, ModelOutput("log_probs"))[0]
    assert max(float((a - b).abs().max()) for a, b in zip(forced, plain)) > 1e-3  # another network
    reference = [forced_forward(hf, s.tokens, np.asarray(s.rollout_routed_experts), s.response_length) for s in samples]
    for a, b in zip(forced, reference):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)

    # training: gradients of Σ coef · log π with the replayed routing = autograd of the forced HF model
    coefs = [torch.linspace(-1.0, 1.0, s.response_length) for s in samples]

    def loss_fn(micro_batch, outputs):
        return (outputs.log_probs * torch.cat([coefs[i] for i in micro_batch])).sum(), {}

    backend.optimizer.zero_grad(set_to_none=True)
    backend.forward_backward(other, [list(range(len(samples)))], ModelOutput("log_probs"), loss_fn)
    grads = full_grads(backend.model)
    hf.zero_grad(set_to_none=True)
    torch.stack([(c * lp).sum() for c, lp in zip(coefs, reference)]).sum().backward()
    expected = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    router_grads = [n for n in expected if n.endswith("mlp.gate.weight")]
    assert router_grads and all(float(expected[n].abs().sum()) > 0 for n in router_grads)  # the routers train
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def engine_vlm_samples(model_dir) -> list:
    """Four samples the embedded engine generates (routed experts on) with images in their prompts: two of
    one prompt with one image, one with two images, one without; prompts in 8-token prefill chunks."""

    from PIL import Image, ImageDraw

    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner
    from slime.backends.embedded_engine.vision import attach_images
    from slime.utils.multimodal import encode_image, process_images
    from slime.utils.processing_utils import load_processor
    from slime.utils.types import Sample

    def picture(size, boxes):
        image = Image.new("RGB", size, (255, 255, 255))
        for k in range(boxes):
            ImageDraw.Draw(image).rectangle([3 + 11 * k, 5, 11 + 11 * k, 13], fill=(40 * k, 90, 200))
        return image

    processor = load_processor(model_dir)
    one = [picture((84, 56), 2)]
    pictures = [one, one, [picture((56, 56), 1), picture((112, 56), 3)], []]
    texts, requests = [], []
    for i, images in enumerate(pictures):
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": f"how many boxes {max(i, 1)}?"}]
        texts.append(processor.tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                             add_generation_prompt=True))
        requests.append(GenerateRequest(
            rid=str(i), input_ids=processor.tokenizer.encode(texts[-1], add_special_tokens=False),
            image_data=[encode_image(image) for image in images] or None, return_routed_experts=True,
            return_logprob=True, params=SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True,
                                                       sampling_seed=i)))
    runner = ModelRunner(model_dir, num_slots=4, slot_capacity=128, routed_experts=True)
    attach_images(runner, requests)
    engine = Engine(runner, chunked_prefill_size=8)
    seqs = _serve(engine, requests)
    samples = []
    for i, (req, seq, text, images) in enumerate(zip(requests, seqs, texts, pictures)):
        ids, train_inputs = process_images(processor, text, images)
        assert ids == req.input_ids
        samples.append(Sample(index=i, group_index=i // 2, tokens=ids + seq.output_ids,
                              response_length=len(seq.output_ids), reward=float(i % 2), status=Sample.Status.COMPLETED,
                              rollout_log_probs=list(seq.output_logprobs), rollout_routed_experts=seq.routed_experts,
                              multimodal_train_inputs=train_inputs if images else None))
    return samples


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_vl_moe"])
def test_r3_replays_the_engines_experts_at_image_tokens(arch, request):
    """A MoE vision-language model (Qwen3.5-MoE, Qwen3-VL-MoE) with images in the prompts, one packed row:
    the trainer's own routing of the samples (recorded as R2 does) equals the engine's at every position, the
    image tokens' included; replaying the engine's experts (R3) gives the engine's log-probs; other experts
    replayed at the image tokens change the log-probs of the samples with images only."""
    from transformers import AutoConfig

    model_dir = request.getfixturevalue({"qwen3_5_moe": "tiny_qwen3_5_moe_vl_dir",
                                         "qwen3_vl_moe": "tiny_qwen3_vl_moe_dir"}[arch])
    image_token = AutoConfig.from_pretrained(model_dir).image_token_id
    samples = engine_vlm_samples(model_dir)

    args = make_args(model_dir, "--use-routing-replay", "--num-steps-per-rollout", "1",
                     "--fsdp-attn-implementation", "eager", rbs=2)
    recorder = TrainWorker(args)
    recorder.init()
    data = rank_data(args, samples)
    recorder.backend.forward_only("model", data, ModelOutput("log_probs"))
    image_rows = 0
    for position, i in enumerate(data.sample_indices):
        mine = np.sort(recorder.backend.routing.recorded[position], -1)
        engine = np.sort(np.asarray(samples[i].rollout_routed_experts), -1)
        np.testing.assert_array_equal(mine, engine, err_msg=f"sample {i}")
        image_rows += int((np.asarray(samples[i].tokens[:-1]) == image_token).sum())
    assert image_rows == 6 + 6 + 4 + 8

    args = make_args(model_dir, "--use-rollout-routing-replay", "--num-steps-per-rollout", "1",
                     "--fsdp-attn-implementation", "eager", rbs=2)
    worker = TrainWorker(args)
    worker.init()
    backend = worker.backend
    replayed = backend.forward_only("model", data, ModelOutput("log_probs"))[0]
    routing, backend.routing = backend.routing, None
    plain = backend.forward_only("model", data, ModelOutput("log_probs"))[0]
    backend.routing = routing
    for position, i in enumerate(data.sample_indices):
        torch.testing.assert_close(replayed[position], plain[position], atol=1e-6, rtol=0)
        torch.testing.assert_close(replayed[position], torch.tensor(samples[i].rollout_log_probs), atol=1e-4, rtol=0)

    for s in samples:  # other experts at the image tokens only
        experts = np.asarray(s.rollout_routed_experts)
        at_images = np.asarray(s.tokens[:-1]) == image_token
        s.rollout_routed_experts = np.where(at_images[:, None, None], shifted(experts, slice(None)), experts)
    moved = backend.forward_only("model", rank_data(args, samples), ModelOutput("log_probs"))[0]
    for position, i in enumerate(data.sample_indices):
        gap = float((moved[position] - plain[position]).abs().max())
        if samples[i].multimodal_train_inputs:
            assert gap > 1e-3, (i, gap)
        else:  # the text-only sample packed beside them keeps its log-probs
            assert gap < 1e-5, (i, gap)


def test_r3_refuses_samples_without_or_with_misshapen_experts(tiny_glm4_moe_dir):
    args = make_args(tiny_glm4_moe_dir, "--use-rollout-routing-replay", "--num-steps-per-rollout", "1", rbs=1)
    worker = TrainWorker(args)
    worker.init()
    samples = make_samples(2)
    with pytest.raises(ValueError, match="needs rollout_routed_experts for every sample; sample 0 has none"):
        worker.backend.forward_only("model", rank_data(args, samples), ModelOutput("log_probs"))
    for s in samples:
        s.rollout_routed_experts = [[[0, 1]] * 4] * len(s.tokens)  # one row too many
    with pytest.raises(ValueError, match=r"expected \[len\(tokens\) - 1"):
        worker.backend.forward_only("model", rank_data(args, samples), ModelOutput("log_probs"))


def test_r2_records_the_pi_old_routing_and_replays_it(tiny_glm4_moe_dir):
    hf = load_hf(tiny_glm4_moe_dir)
    args = make_args(tiny_glm4_moe_dir, "--use-routing-replay", "--num-steps-per-rollout", "1", rbs=2)
    worker = TrainWorker(args)
    worker.init()
    samples = make_samples(4)
    data = rank_data(args, samples)
    assert not worker.skips_old_log_prob_pass(data)  # R2 needs the π_old pass that records
    with pytest.raises(RuntimeError, match="replays the routing recorded in the π_old forward pass"):
        worker.backend.forward_backward(data, [[0, 1]], ModelOutput("log_probs"), lambda mb, out: (out.log_probs.sum(), {}))
    prepared = worker.prepare(0, data)
    recorded = worker.backend.routing.recorded
    for i, s in enumerate(samples):
        np.testing.assert_array_equal(recorded[i], hf_routing(hf, s.tokens))
    metrics = worker.train(0, data)
    assert np.isfinite(metrics["train/loss"]) and prepared.log_probs is not None
    assert not worker.backend.routing.recorded  # forgotten after the rollout step


def test_r3_removes_the_bf16_routing_flips_between_engine_and_trainer(tiny_deepseek_v3_dir):
    """The embedded engine in bf16 samples 32 responses and reports its experts; the FSDP trainer in bf16
    recomputes the log-probs. Their hidden states differ in the last bits, so near-tie top-k choices flip
    between the two (measured here: 9 of 2592 MoE routings), and a flipped token's log-prob jumps (max
    gap 0.087 without R3). Replaying the engine's experts removes those jumps (max 0.006) and lowers the
    mean gap (0.00219 -> 0.00153); with no flip R3 would change nothing."""

    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner
    from slime.backends.fsdp_utils.model import pad_samples
    from slime.utils.types import Sample

    engine = Engine(ModelRunner(tiny_deepseek_v3_dir, dtype="bfloat16", num_slots=32, slot_capacity=64,
                                routed_experts=True))
    g = torch.Generator().manual_seed(0)
    requests = [GenerateRequest(rid=str(i), input_ids=torch.randint(10, 500, (12,), generator=g).tolist(),
                                params=SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=i),
                                return_routed_experts=True, return_logprob=True) for i in range(32)]
    seqs = _serve(engine, requests)
    samples = [Sample(index=i, group_index=i // 2, tokens=r.input_ids + s.output_ids, response_length=len(s.output_ids),
                      reward=0.0, status=Sample.Status.COMPLETED, rollout_log_probs=list(s.output_logprobs),
                      rollout_routed_experts=s.routed_experts.tolist()) for i, (r, s) in enumerate(zip(requests, seqs))]
    args = make_args(tiny_deepseek_v3_dir, "--use-rollout-routing-replay", "--num-steps-per-rollout", "1",
                     "--fsdp-mixed-precision", "bf16", rbs=16)
    worker = TrainWorker(args)
    worker.init()
    backend, data = worker.backend, rank_data(args, samples)
    replayed = backend.forward_only("model", data, ModelOutput("log_probs"))[0]
    routing, backend.routing = backend.routing, None
    plain = backend.forward_only("model", data, ModelOutput("log_probs"))[0]
    flips = 0
    with torch.no_grad():
        for i, s in enumerate(samples):  # the trainer's own choices (recorded) against the engine's
            packed = pad_samples([torch.tensor(s.tokens)], [s.response_length], backend.device)
            with routing.record(packed, [i]):
                backend.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            mine = np.sort(routing.recorded[i][:, 1:], -1)
            flips += int((mine != np.sort(np.asarray(s.rollout_routed_experts)[:, 1:], -1)).any(-1).sum())
    engine_lp = [torch.tensor(s.rollout_log_probs) for s in samples]
    gap_plain = torch.cat([(a - b).abs() for a, b in zip(plain, engine_lp)])
    gap_r3 = torch.cat([(a - b).abs() for a, b in zip(replayed, engine_lp)])
    print(f"bf16: {flips} flipped routings; gap mean/max without R3 {gap_plain.mean():.5f}/{gap_plain.max():.4f}, "
          f"with R3 {gap_r3.mean():.5f}/{gap_r3.max():.4f}")
    if not flips:  # numerics of another CPU: then the replayed routing is the trainer's own
        for a, b in zip(replayed, plain):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        return
    assert gap_r3.max() < 0.5 * gap_plain.max() and gap_r3.mean() < gap_plain.mean()
