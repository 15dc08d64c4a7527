"""On-policy distillation: a second engine serves a tiny teacher that differs from the student; its
per-token log-probs reach the training data, and the OPD advantage trains the reverse KL.

* The teacher's log-probs of the student's responses (through ``--custom-rm-path reward_func`` and
  ``--custom-reward-post-process-path post_process_rewards``) equal the teacher model's own
  log-softmax computed here with transformers, and differ from the student's.
* The example's models (``examples/on_policy_distillation/models.py``: the student and a teacher
  with its own initial weights and training, one tokenizer) are what the engines serve, and its
  ``teacher-score`` reads the teacher's greedy answers through the engine.
* The policy loss with OPD advantages has the gradient of a reverse-KL surrogate written here
  (REINFORCE: λ · sg(log π − log π_teacher) · log π, plus the task term), checked with autograd.
"""

import json

import pytest
import torch

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.router import running_router
from slime.rollout import on_policy_distillation as opd
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.algorithms import functional as pu
from slime.arguments import parse_args
from slime.backends.training.train_data import convert_samples_to_train_data
from slime.utils.types import Sample
from tests.algorithms.test_functional import _args

pytestmark = [pytest.mark.timeout(240)]


def _hf_log_probs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_teacher_log_probs_from_a_second_engine_reach_the_train_data(tiny_model_dir, tmp_path):
    from examples.on_policy_distillation import models, summary

    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps({"messages": m}) for m in models.conversations(3)) + "\n")
    student_dir, teacher_dir = str(tmp_path / "student"), str(tmp_path / "teacher")
    report = models.build(tiny_model_dir, student_dir, teacher_dir, sft, max_operand=3, teacher_steps=20, student_steps=2)
    assert report["teacher"]["loss_last"] < report["teacher"]["loss_first"]
    assert open(f"{student_dir}/tokenizer.json").read() == open(f"{teacher_dir}/tokenizer.json").read()
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "label": str(2 * i)} for i in range(4)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with running_engine(student_dir, extra_args=["--context-length", "256"]) as student, \
            running_engine(teacher_dir, extra_args=["--context-length", "256"]) as teacher, \
            running_router("round_robin", worker_urls=[student.url]) as router:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", student_dir,
            "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rollout-max-response-len", "6", "--rollout-temperature", "1.0",
            "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0", "--rm-url", f"{teacher.url}/generate",
            "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func",
            "--custom-reward-post-process-path", "slime.rollout.on_policy_distillation.post_process_rewards",
            "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        ])  # fmt: skip
        args.rollout_engine_urls = [student.url]
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
        # teacher-score: labelled with the teacher's own greedy answers it scores 1, with others 0
        own = tmp_path / "own.jsonl"
        own.write_text("\n".join(json.dumps({**r, "label": _greedy_answer(teacher_dir, r["prompt"])}) for r in rows))
        other = tmp_path / "other.jsonl"
        other.write_text("\n".join(json.dumps({**r, "label": "no such answer"}) for r in rows))
        assert summary.teacher_score(teacher.url, teacher_dir, {"own": str(own), "other": str(other)},
                                     temperature=0.0) == \
            {"own": 1.0, "other": 0.0}
    samples = [s for group in output.samples for s in group]
    assert len(samples) == 4 and all(s.status != Sample.Status.FAILED for s in samples)
    data = convert_samples_to_train_data(args, samples)
    from transformers import AutoModelForCausalLM

    teacher_model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    assert data["rewards"] == [0.0] * 4  # pure distillation: the teacher is the only signal
    for sample, teacher_lp in zip(samples, data["teacher_log_probs"]):
        n = sample.response_length
        assert n > 0 and len(teacher_lp) == n
        expected = _hf_log_probs(teacher_model, sample.tokens)[-n:]
        torch.testing.assert_close(torch.tensor(teacher_lp, dtype=torch.float32), expected, atol=2e-4, rtol=1e-4)
        student_lp = torch.tensor(sample.rollout_log_probs)
        assert (student_lp - expected).abs().max() > 0.05  # the teacher is another model


def _greedy_answer(model_dir, messages):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.tiny_cpu.reward import extract_answer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return extract_answer(tokenizer.decode(out[0, len(ids):]))


def test_post_process_rewards_errors_name_the_cause():
    sample = Sample(index=3, tokens=[1, 2, 3, 4], response_length=2, reward=0.5)
    args = _args(reward_key=None)
    with pytest.raises(ValueError, match="reward_func"):
        opd.post_process_rewards(args, [sample])
    sample.reward = {"meta_info": {"input_token_logprobs": [[None, 1], [-1.0, 2]]}}
    with pytest.raises(ValueError, match="2 input log-probs for 4 tokens"):
        opd.post_process_rewards(args, [sample])
    with pytest.raises(ValueError, match="--reward-key"):
        opd.post_process_rewards(_args(reward_key="score"), [sample])
    sample.reward = {"meta_info": {"input_token_logprobs": [[None, 1], [-1.0, 2], [-2.0, 3], [-3.0, 4]]}}
    assert opd.post_process_rewards(args, [sample]) == ([0.0], [0.0])
    assert sample.teacher_log_probs == [-2.0, -3.0]


def test_opd_policy_gradient_is_the_reverse_kl_gradient():
    g = torch.Generator().manual_seed(0)
    lengths = [4, 2, 5]
    n = sum(lengths)
    student = (torch.randn(n, generator=g) * 0.5 - 1.5).double()
    teacher = (torch.randn(n, generator=g) * 0.5 - 1.5).double()
    task_adv = torch.randn(n, generator=g).double()
    masks = [(torch.rand(length, generator=g) > 0.3).int() for length in lengths]
    for m in masks:
        m[0] = 1
    split = lambda x: list(torch.split(x, lengths))  # noqa: E731
    coef = 0.7
    advantages, reverse_kl = pu.apply_opd(split(task_adv), split(student), split(teacher), coef)
    torch.testing.assert_close(torch.cat(reverse_kl).double(), student - teacher, rtol=1e-6, atol=1e-6)
    denominators = [float(m.sum()) for m in masks]
    batch = {"response_lengths": lengths, "loss_masks": masks, "advantages": [a.double() for a in advantages],
             "log_probs": split(student), "rollout_mask_sums": denominators, "total_lengths": [x + 3 for x in lengths]}
    new = student.clone().requires_grad_()  # on policy: the sampling policy is the current one
    reducer = pu.make_sum_of_sample_mean(lengths, masks, denominators)
    loss, _ = pu.policy_loss_function(_args(), batch, new, None, reducer)
    (grad,) = torch.autograd.grad(loss, new)

    # reference: per-sample token means of the task term and λ · sg(log π − log π_T) · log π
    ref_new = student.clone().requires_grad_()
    reference = ref_new.new_zeros(())
    offset = 0
    for i, length in enumerate(lengths):
        for t in range(length):
            j = offset + t
            kl_term = coef * (ref_new[j].detach() - teacher[j]) * ref_new[j]
            reference = reference + (-task_adv[j] * ref_new[j] + kl_term) * masks[i][t] / denominators[i]
        offset += length
    (expected,) = torch.autograd.grad(reference, ref_new)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    # the distillation term matters: without it the gradient is another one
    no_opd = dict(batch, advantages=split(task_adv))
    loss_task, _ = pu.policy_loss_function(_args(), no_opd, new, None, reducer)
    (grad_task,) = torch.autograd.grad(loss_task, new)
    assert (grad_task - expected).abs().max() > 1e-2
