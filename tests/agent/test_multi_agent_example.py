"""examples/multi_agent: one real rollout step through the embedded engine and the router.

The tiny model is taught (here, a few hundred Adam steps) to answer ``1+2=`` with ``3`` (right) and
``2+2=`` with ``5`` (wrong), and as a critic to say ``yes`` to ``check 1+2=3`` and ``no`` to
``check 2+2=5``. Greedy rollouts then show what the example promises: each slot comes back as a
solver and a critic sample sharing one rollout id and the group; the critic was shown the solver's
own answer; the solver is scored on the answer, the critic on the truth of its verdict (a critic
that catches the wrong answer earns 1); in the training data both turns form one rollout and each
role is normalised against its own role.
"""

import json

import pytest

from examples.multi_agent.data import build
from examples.multi_agent.generate import critic_messages, critic_reward
from examples.multi_agent.reward import balanced_critic_rewards, post_process
from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.router import running_router
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from slime.backends.training.train_data import convert_samples_to_train_data
from slime.utils.types import Sample
from tests.rollout.test_reasoning_gym import _teach

pytestmark = [pytest.mark.timeout(300)]


def test_critic_reward_rule():
    assert critic_reward("yes", True) == 1.0 and critic_reward("no", False) == 1.0
    assert critic_reward("yes", False) == 0.0 and critic_reward("No", True) == 0.0
    assert critic_reward("maybe", True) == 0.0


def test_each_role_is_normalised_against_its_own_role():
    """Slot 0: solver right, critic wrong; slot 1: the reverse. Per rollout both slots average 0.5
    (the default normaliser would give every turn 0); per role each turn is ±0.707."""
    args = parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--rollout-batch-size", "1",
                       "--n-samples-per-prompt", "2", "--num-rollout", "1", "--debug-rollout-only"])
    samples = [Sample(group_index=0, rollout_id=slot, reward=reward, metadata={"agent": role})
               for slot, rewards in ((0, (1.0, 0.0)), (1, (0.0, 1.0)))
               for role, reward in zip(("solver", "critic"), rewards)]
    raw, normalised = post_process(args, samples)
    assert raw == [1.0, 0.0, 0.0, 1.0]
    assert normalised == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-3)


def _critic_turns(verdict_right: list[bool], solver_right: list[bool]) -> list[Sample]:
    return [Sample(group_index=0, rollout_id=slot, reward=float(v), metadata={"agent": "critic", "solver_correct": c})
            for slot, (v, c) in enumerate(zip(verdict_right, solver_right))]


def test_the_critic_reward_is_balanced_over_right_and_wrong_answers():
    """One right solver answer among four: a critic that always says no is right 3 times in 4 but earns
    what a coin earns (0.5), as does always yes; only telling them apart earns 1."""
    solver_right = [True, False, False, False]
    mean = lambda verdicts: sum(balanced_critic_rewards(t := _critic_turns(verdicts, solver_right),
                                                        [s.reward for s in t])) / 4
    assert mean([False, True, True, True]) == pytest.approx(0.5)  # always "no"
    assert mean([True, False, False, False]) == pytest.approx(0.5)  # always "yes"
    assert mean([True, True, True, True]) == pytest.approx(1.0)
    assert mean([False, False, False, False]) == 0.0
    # all answers wrong: nothing to balance, the raw rewards stay
    same = _critic_turns([True, False], [False, False])
    assert balanced_critic_rewards(same, [1.0, 0.0]) == [1.0, 0.0]
    # through the post-process: the always-no critic's miss on the right answer is its worst turn
    args = parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--rollout-batch-size", "1",
                       "--n-samples-per-prompt", "4", "--num-rollout", "1", "--debug-rollout-only"])
    raw, normalised = post_process(args, _critic_turns([False, True, True, True], solver_right))
    assert raw == [0.0, 1.0, 1.0, 1.0]  # logged: plain accuracy
    assert normalised[0] == pytest.approx(-1.5, abs=1e-3) and normalised[1:] == pytest.approx([0.5] * 3, abs=1e-3)


def test_data_has_both_roles(tmp_path):
    paths = build(tmp_path, seed=0, num_train=8, num_eval=4, num_sft=10)
    sft = [json.loads(line) for line in open(paths["sft"])]
    critic = [r for r in sft if r["messages"][0]["content"].startswith("check ")]
    assert len(sft) == 20 and len(critic) == 10
    for row in critic:  # the verdict is the truth about the shown answer
        question, shown = row["messages"][0]["content"][len("check "):].split("=")
        a, b = map(int, question.split("+"))
        assert row["messages"][1]["content"] == ("yes" if int(shown) == a + b else "no")


def test_one_rollout_step(tiny_model_dir, tmp_path):
    taught = [{"prompt": [{"role": "user", "content": "1+2="}], "label": "3"},
              {"prompt": [{"role": "user", "content": "2+2="}], "label": "5"},  # a wrong answer
              {"prompt": critic_messages("1+2=", "3"), "label": "yes"},
              {"prompt": critic_messages("2+2=", "5"), "label": "no"}]
    model_dir = _teach(tiny_model_dir, tmp_path / "taught", taught)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [{"role": "user", "content": "1+2="}], "label": "3"},
        {"prompt": [{"role": "user", "content": "2+2="}], "label": "4"}]) + "\n")
    with running_engine(model_dir, extra_args=["--context-length", "256"]) as engine, \
            running_router("round_robin", worker_urls=[engine.url]) as router:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
            "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rollout-max-response-len", "6", "--rollout-temperature", "0.01",
            "--custom-generate-function-path", "examples.multi_agent.generate.generate",
            "--custom-reward-post-process-path", "examples.multi_agent.reward.post_process",
            "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    assert len(output.samples) == 2
    by_question = {}
    for group in output.samples:
        assert len(group) == 2
        for slot in group:
            solver, critic = slot
            assert [solver.metadata["agent"], critic.metadata["agent"]] == ["solver", "critic"]
            assert solver.rollout_id == critic.rollout_id is not None
            assert solver.group_index == critic.group_index
            for turn in slot:
                assert turn.status == Sample.Status.COMPLETED
                assert len(turn.rollout_log_probs) == turn.response_length > 0 and turn.weight_versions
            assert critic.metadata["judged_answer"] == solver.metadata["answer"]  # the critic saw this answer
            by_question[solver.prompt[-1]["content"]] = (solver, critic)
    right_solver, right_critic = by_question["1+2="]
    assert right_solver.metadata["answer"] == "3" and right_solver.reward == 1.0
    assert right_critic.metadata["verdict"] == "yes" and right_critic.reward == 1.0
    wrong_solver, wrong_critic = by_question["2+2="]
    assert wrong_solver.metadata["answer"] == "5" and wrong_solver.reward == 0.0
    assert wrong_critic.metadata["verdict"] == "no" and wrong_critic.reward == 1.0  # caught it

    samples = [turn for group in output.samples for slot in group for turn in slot]
    data = convert_samples_to_train_data(args, samples)
    assert len(set(data["rollout_ids"])) == 4 and len(data["rollout_ids"]) == 8  # 4 rollouts of 2 turns
    for i in range(0, 8, 2):
        assert data["rollout_ids"][i] == data["rollout_ids"][i + 1]
        assert data["rollout_mask_sums"][i] == sum(data["loss_masks"][i]) + sum(data["loss_masks"][i + 1])
    raw, normalised = post_process(args, samples)
    assert raw == data["raw_reward"] and normalised == data["rewards"]
    # greedy: a role's two slots of one problem agree, so every role-group has no spread → 0
    assert all(abs(r) < 1e-6 for r in normalised)
