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


def start_cuda_engine(model_dir, *extra, env=None):
    """An embedded engine on CUDA with ``extra`` flags, started and healthy (stopped if it is not)."""
    from slime.backends.embedded_engine.launch import EmbeddedEngineProcess

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
    from slime.backends.embedded_engine.mtp import make_markov_checkpoint

    shutil.copytree(base, out)
    return make_markov_checkpoint(str(out), mtp, noise)
