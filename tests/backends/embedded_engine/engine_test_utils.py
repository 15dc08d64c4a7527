"""Shared test helpers: tiny checkpoints (base, perturbed, trained on a tool call) and HF references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def replay_graph_forwards(monkeypatch) -> list:
    """The CUDA graph path on the CPU: ``DecodeGraphs._record`` returns a "graph" whose replay runs the recorded
    forward again. Returns the list each replay appends its runner to."""
    import types

    from slime.backends.embedded_engine.cuda_graphs import DecodeGraphs

    replays = []

    def record(self, forward):
        def replay():
            replays.append(self.runner)
            forward()
        return types.SimpleNamespace(replay=replay)

    monkeypatch.setattr(DecodeGraphs, "_record", record)
    return replays


def start_cuda_engine(model_dir, *extra, env=None):
    """An embedded engine on CUDA with ``extra`` flags, started and healthy (stopped if it is not)."""
    from slime.backends.embedded_engine.serving.launch import EmbeddedEngineProcess

    proc = EmbeddedEngineProcess(model_dir, extra_args=["--device", "cuda", *extra], env=env)
    proc.start()
    try:
        proc.wait_healthy(timeout=300)
    except Exception:
        proc.stop()
        raise
    return proc


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """Reference: log_softmax(logits / T) of a plain full-sequence forward, at each output token."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0].double()
    t = 1.0 if temperature < 1e-6 else temperature
    logprobs = torch.log_softmax(logits / t, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


def copy_with_weights(src, dst, state_dict) -> Path:
    dst = Path(dst)
    shutil.copytree(src, dst)
    model = load_hf(src)
    model.load_state_dict(state_dict)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def perturbed_state_dict(model_dir, seed: int = 1) -> dict:
    model = load_hf(model_dir)
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def train_tool_call(model_dir, steps: int = 120) -> dict:
    """Overfit the tiny model on one chat turn whose reply is a tool call (so greedy reproduces it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    reply_ids = tok.encode(TOOL_REPLY, add_special_tokens=False)
    ids = torch.tensor([prompt_ids + reply_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    model = load_hf(model_dir).train()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert hf_greedy(model, prompt_ids, len(reply_ids)) == reply_ids, f"training did not converge: {loss.item()}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def dumps(obj) -> str:
    return json.dumps(obj)


def markov_checkpoint(base: str, out, mtp: str, noise: float = 0.0) -> str:
    """A copy of the DeepSeek-V3 checkpoint ``base`` made a "Markov" model with an ``exact`` or ``wrong``
    MTP layer (``mtp.make_markov_checkpoint``: the exact layer predicts the target's next-next token)."""
    from slime.backends.embedded_engine.speculative.mtp import make_markov_checkpoint

    shutil.copytree(base, out)
    return make_markov_checkpoint(str(out), mtp, noise)


def generate_in_engine(engine, prompts, params_list):
    """Submit one request per prompt to a started ``Engine`` (on its thread) and wait for all; the
    finished ``Sequence`` objects."""
    import threading

    from slime.backends.embedded_engine.io_struct import GenerateRequest

    seqs, events = [], []
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        done = threading.Event()
        request = GenerateRequest(rid=f"r{i}", input_ids=prompt, params=params)
        seqs.append(engine.call(lambda r=request, d=done: engine.add_request(r, lambda s, f, d=d: f and d.set()))
                    .result(10))
        events.append(done)
    for done in events:
        assert done.wait(120)
    return seqs


def exact_sequence_probs(model, prompt, length, top_k):
    """Target probability of every continuation of ``length`` tokens under top-k sampling at T=1."""
    from slime.backends.embedded_engine.sampler import RowSampling, sampling_distribution

    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, prob in out.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            _, probs = sampling_distribution(logits.unsqueeze(0), [RowSampling(temperature=1.0, top_k=top_k)])
            for token in torch.nonzero(probs[0]).flatten().tolist():
                grown[prefix + (token,)] = prob * float(probs[0, token])
        out = grown
    return out


def assert_sequences_follow(exact: dict, counts, n: int) -> None:
    """Chi-square of the sampled sequence ``counts`` (of ``n``) against their ``exact`` probabilities
    (rare sequences pooled into one cell), at p = 1e-4 by the Wilson-Hilferty approximation."""
    import math

    assert set(counts) <= set(exact)
    cells, statistic, pooled_expected, pooled_count = 0, 0.0, 0.0, 0
    for sequence, prob in exact.items():
        if n * prob < 5:
            pooled_expected += n * prob
            pooled_count += counts.get(sequence, 0)
            continue
        statistic += (counts.get(sequence, 0) - n * prob) ** 2 / (n * prob)
        cells += 1
    if pooled_expected > 0:
        statistic += (pooled_count - pooled_expected) ** 2 / pooled_expected
        cells += 1
    dof = cells - 1
    limit = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
    assert statistic < limit, (statistic, limit, dof)


def generate_concurrently(url: str, prompts, lengths, temperature: float) -> tuple[list[dict], dict]:
    """One /generate per prompt, all at once (``return_logprob``, ``ignore_eos``); the responses and the
    server's ``batch_stats`` after them."""
    import concurrent.futures

    import httpx

    with httpx.Client(timeout=300) as client:
        def one(prompt, n):
            body = {"input_ids": prompt, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}}
            response = client.post(url + "/generate", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(one, prompts, lengths))
        return outs, client.get(url + "/get_server_info").json()["batch_stats"]
