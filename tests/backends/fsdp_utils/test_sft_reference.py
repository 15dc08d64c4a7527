"""The SFT path trains exactly like a plain PyTorch loop.

``slime.rollout.sft_rollout`` (chat transcripts → tokens and loss masks) → train data → the FSDP2
worker with ``--loss-type sft_loss`` is run for a few rollout steps next to a hand-written loop on
the same samples in the same order: one unpacked forward per sample, ``log_softmax`` of the HF
model's logits, the loss of docs/INTERFACES.md §5.6/§5.8 (per-token: Σ m·log p / Σ m over the step;
per-sample: the mean over samples of each sample's masked mean), ``clip_grad_norm_``, ``torch.optim.AdamW``
(biases and norm weights without weight decay) and the lr asked for, step by step. Loss, gradient
norm and lr must agree at every optimizer step and the weights at the end.

The conversations are multi-turn with a system prompt, tool calls, tool results and a turn with
``step_loss_mask: 0``; the SFT data wraps into a reshuffled second epoch.
"""

from __future__ import annotations

import json

import pytest
import torch

from slime.backends.training.worker import TrainWorker
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sft_rollout import generate_rollout
from slime.arguments import parse_args
from slime.utils.processing_utils import load_tokenizer
from slime.backends.training.train_data import convert_samples_to_train_data, split_train_data_by_dp

pytestmark = pytest.mark.usefixtures("single_rank")

TOOLS = [{"type": "function", "function": {"name": "get_temperature", "description": "Reads the thermometer",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _call(name="get_temperature"):
    return {"type": "function", "function": {"name": name, "arguments": {}}}


def conversations() -> list[dict]:
    rows = []
    for reading in ("3", "7", "1"):
        rows.append({"messages": [
            {"role": "user", "content": "What is the temperature outside?"},
            {"role": "assistant", "content": "", "tool_calls": [_call()]},
            {"role": "tool", "content": reading},
            {"role": "assistant", "content": f"It is {reading} degrees."},
        ], "tools": TOOLS})
    rows.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="},
                              {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
                              {"role": "assistant", "content": "5", "step_loss_mask": 0},
                              {"role": "user", "content": "really?"}, {"role": "assistant", "content": "4"}]})
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]})
    rows.append({"messages": [{"role": "user", "content": "How warm is it?"}, {"role": "assistant", "content": "5"}],
                 "tools": TOOLS})
    rows.append({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "9+3="},
                              {"role": "assistant", "content": "12"}]})
    return rows


def sft_args(model_dir, data_path, *extra):
    return parse_args(["--train-backend", "fsdp", "--debug-train-only", "--hf-checkpoint", str(model_dir), "--seed", "0",
                       "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
                       "--prompt-data", str(data_path), "--input-key", "messages", "--tool-key", "tools",
                       "--loss-type", "sft_loss", "--disable-compute-advantages-and-returns",
                       "--rollout-batch-size", "4", "--num-rollout", "3", *extra])


def trained_text(tokenizer, sample) -> str:
    """The decoded tokens of ``sample`` whose loss mask is 1."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    return tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if m])


def test_sft_rollout_masks_every_assistant_token_and_nothing_else(tiny_model_dir, tmp_path):
    """Tokens are the template's rendering of the whole conversation; the trained tokens are exactly
    the assistant turns (tool-call turn and the answer after the tool result included, each with its
    end-of-turn token), minus ``step_loss_mask: 0`` turns."""
    path = tmp_path / "sft.jsonl"
    rows = conversations()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = sft_args(tiny_model_dir, path, "--rollout-batch-size", str(len(rows)))
    samples = [g[0] for g in generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples]
    tok = load_tokenizer(tiny_model_dir)
    for row, sample in zip(rows, samples):
        text = tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False)
        assert sample.tokens == tok(text, add_special_tokens=False)["input_ids"]
        assert len(sample.loss_mask) == sample.response_length and sample.loss_mask[0] == 1
        expected = ""
        for message in row["messages"]:
            if message["role"] == "assistant" and message.get("step_loss_mask", 1):
                body = tok.apply_chat_template([message], tokenize=False).split("<|im_start|>assistant\n", 1)[1]
                expected += body.rstrip("\n")
        assert trained_text(tok, sample) == expected
    assert trained_text(tok, samples[0]).startswith("<tool_call>\n{\"name\": \"get_temperature\"")
    assert trained_text(tok, samples[0]).endswith("</tool_call><|im_end|>It is 3 degrees.<|im_end|>")
    assert trained_text(tok, samples[3]) == "2<|im_end|>4<|im_end|>"


def _reference_lr(step: int, args, total_steps: int) -> float:
    """Megatron-style schedule as the flags describe it: linear warmup lr·(k+1)/W, then constant or
    linear decay to --min-lr at the last step count."""
    warmup = args.lr_warmup_iters
    if step < warmup:
        return args.lr * (step + 1) / warmup
    if args.lr_decay_style == "linear":
        return args.min_lr + (args.lr - args.min_lr) * (1 - (step - warmup) / (total_steps - warmup))
    assert args.lr_decay_style == "constant"
    return args.lr


def _reference_step(model, optimizer, samples, per_token: bool, clip: float) -> tuple[float, float]:
    optimizer.zero_grad(set_to_none=True)
    sums, counts = [], []
    for sample in samples:
        tokens = torch.tensor(sample.tokens)
        logits = model(tokens[None]).logits[0]
        log_probs = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, tokens[1:, None])[:, 0]
        mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
        sums.append((log_probs[-sample.response_length:] * mask).sum())
        counts.append(max(float(mask.sum()), 1.0))
    if per_token:
        loss = -torch.stack(sums).sum() / sum(counts)
    else:
        loss = -torch.stack([s / c for s, c in zip(sums, counts)]).mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return float(loss.detach()), float(grad_norm)


CASES = {
    "per_token_micro_batches": ("--calculate-per-token-loss", "--num-steps-per-rollout", "2", "--micro-batch-size", "1",
                                "--lr", "3e-3", "--weight-decay", "0.0", "--adam-beta2", "0.99"),
    "per_sample_dynamic_schedule": ("--global-batch-size", "2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "40",
                                    "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "linear",
                                    "--min-lr", "1e-4", "--weight-decay", "0.1", "--clip-grad", "0.5",
                                    "--adam-beta1", "0.8", "--adam-eps", "1e-6"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_steps_equal_plain_pytorch_loop(tiny_model_dir, tmp_path, case):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    args = sft_args(tiny_model_dir, path, "--rollout-shuffle", *CASES[case])
    worker = TrainWorker(args)
    worker.init()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    reference.train()
    decay = [p for p in reference.parameters() if p.ndim > 1]
    no_decay = [p for p in reference.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    steps_per_rollout = args.rollout_batch_size // args.global_batch_size
    assert steps_per_rollout == 2
    total_steps = args.num_rollout * steps_per_rollout
    source = RolloutDataSourceWithBuffer(args)
    seen, step = [], 0
    for rollout_id in range(args.num_rollout):
        samples = [g[0] for g in generate_rollout(args, rollout_id, source).samples]
        seen += [tuple(s.tokens) for s in samples]
        shard = split_train_data_by_dp(args, convert_samples_to_train_data(args, samples), 1)[0]
        assert max(shard.schedule.num_microbatches) > 1  # gradient accumulation is exercised
        worker.train(rollout_id, shard)
        ours = worker.get_step_metrics()
        assert len(ours) == steps_per_rollout
        for k in range(steps_per_rollout):
            lr = _reference_lr(step, args, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = samples[k * args.global_batch_size:(k + 1) * args.global_batch_size]
            loss, grad_norm = _reference_step(reference, optimizer, batch, args.calculate_per_token_loss, args.clip_grad)
            assert ours[k]["train/lr-pg_0"] == pytest.approx(lr, rel=1e-12), (step, "lr")
            assert ours[k]["train/loss"] == pytest.approx(loss, rel=1e-4), (step, "loss")
            assert ours[k]["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4), (step, "grad_norm")
            step += 1
    # 12 samples from 7 conversations: the first epoch whole, then a reshuffled second one
    assert len(set(seen[:7])) == 7 and seen[7:] != seen[:5]
    probe = torch.tensor([load_tokenizer(tiny_model_dir)("1+1=2 and the temperature is 7")["input_ids"]])
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference.eval()
    with torch.no_grad():
        ours_logits, ref_logits, init_logits = worker.backend.model(input_ids=probe).logits, reference(probe).logits, initial(probe).logits
    assert float((ref_logits - init_logits).abs().max()) > 0.1  # the weights did move
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    if args.adam_eps >= 1e-6:
        # Adam's g/(|g|+eps) amplifies fp32 summation-order noise in gradients of ~1e-9 when eps is
        # 1e-8 (a handful of elements then differ by a few % of lr); with eps 1e-6 every weight matches.
        state = worker.backend.model.state_dict()
        for name, param in reference.named_parameters():
            torch.testing.assert_close(state[name].full_tensor(), param.detach(), atol=1e-5, rtol=0, msg=name)
