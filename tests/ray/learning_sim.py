"""The loop tests' GRPO recipe in one process, to measure how reliably it learns (not a test).

Same tiny model (seed 0), prompts (tiny task, seed 0, 64 train prompts, 8 a step in order), sampling
(temperature 1, 4 new tokens, stop at the end-of-turn ids), reward (``loop_plugins``), GRPO group
normalisation, per-sample mean loss over the batch, grad-norm clip 1.0 and AdamW (beta2 0.99, no
weight decay) as ``tests/ray/test_loop.py``; on-policy the PPO ratio is 1, so its gradient is the
plain policy gradient used here. ``--async`` samples with the weights from before the previous
update, as ``train_async.py`` does. ``--no-update`` never changes the sampling weights and
``--flip`` negates the advantages (the checks must fail on both). One JSON line per run:

    python tests/ray/learning_sim.py --runs 100 --steps 6
    python tests/ray/learning_sim.py --runs 40 --steps 8 --async
    python tests/ray/learning_sim.py --reward first --lr 5e-2 --steps 5   # the earlier recipe, for comparison
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path


def reward_of(response: list[int], kind: str) -> float:
    if not response:
        return 0.0
    if kind == "first":
        return float(response[0] % 2 == 0)
    return sum(token % 2 == 0 for token in response) / len(response)


def sample(model, prompts: list[list[int]], n: int, max_new_tokens: int, stop_ids: set[int], generator):
    """``n`` responses per prompt, left-padded batched decoding without a KV cache (tiny model)."""
    import torch

    contexts = [list(p) for p in prompts for _ in range(n)]
    responses: list[list[int]] = [[] for _ in contexts]
    done = [False] * len(contexts)
    for _ in range(max_new_tokens):
        width = max(len(c) + len(r) for c, r in zip(contexts, responses))
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (c, r) in enumerate(zip(contexts, responses)):
            ids[i, width - len(c) - len(r):] = torch.tensor(c + r)
            mask[i, width - len(c) - len(r):] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        tokens = torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1, generator=generator).squeeze(1)
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                responses[i].append(token)
                done[i] = token in stop_ids
        if all(done):
            break
    return contexts, responses


def policy_gradient_step(model, optimizer, contexts, responses, advantages) -> None:
    import torch

    width = max(len(c) + len(r) for c, r in zip(contexts, responses))
    ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    weight = torch.zeros(len(contexts), width)
    for i, (c, r) in enumerate(zip(contexts, responses)):
        ids[i, :len(c) + len(r)] = torch.tensor(c + r)
        mask[i, :len(c) + len(r)] = 1
        weight[i, len(c):len(c) + len(r)] = advantages[i] / len(r)  # per-sample mean over its tokens
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(log_probs * weight[:, 1:]).sum() / len(contexts)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def run(model_dir, prompt_ids, stop_ids, args, seed: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    engine = copy.deepcopy(model) if (args.async_ or args.no_update) else model
    previous = copy.deepcopy(model.state_dict())
    rewards = []
    for step in range(args.steps):
        prompts = [prompt_ids[(step * args.prompts + i) % len(prompt_ids)] for i in range(args.prompts)]
        contexts, responses = sample(engine, prompts, args.n, 4, stop_ids, generator)
        raw = torch.tensor([reward_of(r, args.reward) for r in responses])
        rewards.append(raw.mean().item())
        groups = raw.view(args.prompts, args.n)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
        policy_gradient_step(model, optimizer, contexts, responses, -advantages if args.flip else advantages)
        if args.async_ and not args.no_update:  # the next step samples with the weights before this update
            engine.load_state_dict(previous)
            previous = copy.deepcopy(model.state_dict())
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step")
    parser.add_argument("--n", type=int, default=8, help="samples a prompt")
    parser.add_argument("--reward", choices=["fraction", "first"], default="fraction")
    parser.add_argument("--async", dest="async_", action="store_true")
    parser.add_argument("--no-update", action="store_true")
    parser.add_argument("--flip", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from slime.utils.tiny_model import build_tiny_model
    from slime.utils.tiny_task import build_task_data

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="learning_sim-"))
    model_dir = str(build_tiny_model(root / "model", size="tiny", seed=0))
    data = build_task_data(root / "task", seed=0, num_train=64, num_eval=16, num_sft=64)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in open(data["train"])]
    prompt_ids = [tokenizer(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)["input_ids"] for p in prompts]
    stop_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    for seed in range(args.first_seed, args.first_seed + args.runs):
        rewards = run(model_dir, prompt_ids, stop_ids, args, seed)
        rise = max(rewards[len(rewards) // 2:]) - (rewards[0] + rewards[1]) / 2  # test_loop.rise
        print(json.dumps({"seed": seed, "rewards": [round(r, 4) for r in rewards], "rise": round(rise, 4)}), flush=True)


if __name__ == "__main__":
    main()
