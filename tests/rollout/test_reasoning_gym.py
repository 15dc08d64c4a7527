"""reasoning-gym as slime's data and reward (slime.rollout.reasoning_gym): rows from its generators,
its verifiers as ``--rm-type reasoning_gym`` / the custom rm, the data source, and one real rollout step
on the tiny model taught the answers of two of the gym's problems (greedy), behind the smg router."""

import asyncio
import json

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from slime.rollout.reasoning_gym import ReasoningGymDataSource, build, make_rows, reward, score  # noqa: E402
from slime.rollout.rm_hub import async_rm  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

pytestmark = pytest.mark.timeout(300)
CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_prep_files(tmp_path):
    paths = build(tmp_path, "chain_sum", config=CONFIG, num_train=40, num_eval=20, num_sft=10, seed=3,
                  answer_format="plain")
    train, evals, sft = (_rows(paths[k]) for k in ("train", "eval", "sft"))
    assert (len(train), len(evals), len(sft)) == (40, 20, 10)
    gym = {e["question"]: e["answer"] for seed in (3, 3 + 7919)  # the gym's draws (repeats skipped, then a redraw)
           for e in reasoning_gym.create_dataset("chain_sum", seed=seed, size=40, **CONFIG)}
    assert len({r["prompt"][0]["content"] for r in train}) == 40  # distinct problems
    for row in train:  # the gym's own problems and answers
        question = row["prompt"][0]["content"]
        assert row["prompt"] == [{"role": "user", "content": question}] and gym[question] == row["label"]
        assert row["metadata"]["rm_type"] == "reasoning_gym"
        assert row["metadata"]["reasoning_gym"]["entry"]["question"] == question
    questions = {r["prompt"][0]["content"] for r in train + [{"prompt": m["messages"]} for m in sft]}
    assert not questions & {r["prompt"][0]["content"] for r in evals}  # held-out problems are new
    assert sft[0]["messages"][-1]["role"] == "assistant" and sft[0]["messages"][-1]["content"].lstrip("-").isdigit()
    tagged = make_rows("chain_sum", size=2, seed=0, config=CONFIG, system_prompt="default")
    assert tagged[0]["prompt"][0]["role"] == "system" and "<answer>" in tagged[0]["prompt"][0]["content"]
    with pytest.raises(ValueError, match="only"):  # 2-term 1-digit sums are finite
        make_rows("chain_sum", size=5000, seed=0, config=CONFIG)


def test_verifier_as_rm_type_and_custom_rm():
    (plain,) = make_rows("chain_sum", size=1, seed=0, config=CONFIG, answer_format="plain")
    (tagged,) = make_rows("chain_sum", size=1, seed=0, config=CONFIG, answer_format="tag")
    answer = plain["label"]
    assert score(f"{answer}<|im_end|>", plain["metadata"]) == 1.0
    assert score(f"<think>\nhmm\n</think>\n{answer}", plain["metadata"]) == 1.0
    assert score(str(int(answer) + 1), plain["metadata"]) == 0.0
    assert score(f"so <answer>{answer}</answer>", tagged["metadata"]) == 1.0
    assert score(answer, tagged["metadata"]) == 0.0  # the tag format wants <answer>...</answer>

    class Args:
        rm_type, custom_rm_path = None, None

    sample = Sample(response=answer, label=answer, metadata=plain["metadata"])  # rm_type from the row
    assert asyncio.run(async_rm(Args(), sample)) == 1.0
    wrong = Sample(response="x", metadata=plain["metadata"])
    assert asyncio.run(reward(Args(), [sample, wrong])) == [1.0, 0.0]
    with pytest.raises(ValueError, match="metadata"):
        score(answer, {"rm_type": "reasoning_gym"})
    # a dataset whose verifier is not exact match: the gym's partial credit comes through
    (words,) = make_rows("spell_backward", size=1, seed=0, answer_format="plain")
    assert score(words["label"], words["metadata"]) == 1.0 and score("zzzz", words["metadata"]) < 1.0


def test_number_format_scores_the_last_number_of_a_sentence():
    """A small instruct model answers in a sentence; the number format reads its last number (sign and
    thousands separators kept, a full stop dropped), and a reply with no number or the wrong one scores 0."""
    (row,) = make_rows("chain_sum", size=1, seed=0, answer_format="number",
                       config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2})
    answer = int(row["label"])
    assert score(f"The final answer to this problem is {answer}.<|im_end|>", row["metadata"]) == 1.0
    assert score(f"{abs(answer) + 1} ... so the answer is {answer}", row["metadata"]) == 1.0
    assert score(f"The answer is {answer} plus 1 = {answer + 1}.", row["metadata"]) == 0.0  # the last number counts
    assert score("I do not know.", row["metadata"]) == 0.0
    (big,) = make_rows("products", size=1, seed=0, answer_format="number",
                       config={"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3})
    assert int(big["label"]) >= 1000 and score(f"It is {int(big['label']):,}.", big["metadata"]) == 1.0


def test_data_source(tiny_model_dir, tmp_path):
    from slime.arguments import parse_args

    config = tmp_path / "gym.yaml"
    config.write_text(json.dumps({"reasoning_gym": {"dataset": "chain_sum", "config": CONFIG, "size": 12,
                                                    "seed": 1, "answer_format": "plain"}}))
    argv = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", tiny_model_dir,
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--num-rollout", "1", "--apply-chat-template",
            "--data-source-path", "slime.rollout.reasoning_gym.ReasoningGymDataSource",
            "--custom-config-path", str(config), "--save", str(tmp_path / "ckpt")]
    args = parse_args(argv)
    source = ReasoningGymDataSource(args)
    assert len(source) == 12
    groups = source.get_samples(2)
    gym = reasoning_gym.create_dataset("chain_sum", seed=1, size=12, **CONFIG)
    assert [g[0].label for g in groups] == [gym[0]["answer"], gym[1]["answer"]] and all(len(g) == 3 for g in groups)
    assert gym[0]["question"] in groups[0][0].prompt  # rendered with the chat template
    source.save(0)
    after = [g[0].label for g in source.get_samples(2)]
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("0")  # what a trainer checkpoint leaves
    resumed = ReasoningGymDataSource(parse_args(argv + ["--load", str(tmp_path / "ckpt")]))
    resumed.load(0)
    assert [g[0].label for g in resumed.get_samples(2)] == after  # the checkpointed position, same problems


# ----------------------------------------------------------------------------- one rollout step


def _teach(model_dir, out_dir, rows):
    """The tiny model taught to answer these rows' problems with the gym's answers (greedy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        pairs.append((tokenizer.encode(prompt, add_special_tokens=False),
                      tokenizer.encode(row["label"] + "<|im_end|>", add_special_tokens=False)))
    width = max(len(p) + len(r) for p, r in pairs)
    ids, labels = torch.zeros(len(pairs), width, dtype=torch.long), torch.full((len(pairs), width), -100)
    attention = torch.zeros(len(pairs), width, dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
        attention[i, :len(p) + len(r)] = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def test_one_rollout_step(tiny_model_dir, tmp_path):
    from slime.backends.embedded_engine.serving.launch import running_engine
    from slime.backends.router import running_router
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import generate_rollout
    from slime.arguments import parse_args

    paths = build(tmp_path / "data", "chain_sum", config=CONFIG, num_train=3, num_eval=1, seed=5,
                  answer_format="plain")
    rows = _rows(paths["train"])
    model_dir = _teach(tiny_model_dir, tmp_path / "taught", rows[:2])  # the third problem is not taught
    with running_engine(model_dir, extra_args=["--context-length", "256"]) as engine, \
            running_router("consistent_hashing", worker_urls=[engine.url]) as router:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
            "--prompt-data", paths["train"], "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--rm-type", "reasoning_gym", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-max-response-len", "8",
            "--rollout-temperature", "0.01", "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    rewards = {}
    for group in output.samples:
        for sample in group:
            assert sample.status == Sample.Status.COMPLETED
            assert sample.reward == score(sample.response, sample.metadata)  # the gym's verdict on the reply
            rewards.setdefault(sample.metadata["reasoning_gym"]["entry"]["question"], set()).add(sample.reward)
    taught = [r["metadata"]["reasoning_gym"]["entry"]["question"] for r in rows[:2]]
    assert rewards[taught[0]] == {1.0} and rewards[taught[1]] == {1.0}  # the taught answers, verified
