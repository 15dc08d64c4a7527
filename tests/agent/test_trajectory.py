"""TrajectoryManager on hand-made turns: the CLEAN / REALIGN / FORK rules of docs/INTERFACES.md §6.6."""

import pytest

from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.types import Sample

USER = {"role": "user", "content": "q"}
TOOL = {"role": "tool", "content": "7"}


def reply(text, calls=False):
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    return message


def turn(prompt, output, finish="stop", ill_formed=False):
    return TurnRecord(prompt_ids=prompt, output_ids=output, finish_reason=finish,
                      output_log_probs=[-0.1 * (i + 1) for i in range(len(output))], ill_formed=ill_formed)


def trajectory(manager, sid="s", **kwargs):
    return manager.get_trajectory(sid, base_sample=Sample(index=5, group_index=1, label="x"), reward=1.0, **kwargs)


def test_clean_turns_merge_with_context_masked_out():
    manager = TrajectoryManager()
    manager.record_turn("s", turn=turn([1, 2, 3], [10, 11]), prompt_messages=[USER], response_message=reply("", True))
    manager.record_turn("s", turn=turn([1, 2, 3, 10, 11, 4, 5], [12], ill_formed=True),
                        prompt_messages=[USER, reply("", True), TOOL], response_message=reply("done"))
    [sample] = trajectory(manager, extra_metadata={"k": 1})
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12] and sample.response_length == 5
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.rollout_log_probs == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.1])
    assert sample.rollout_id == 5 and sample.reward == 1.0 and sample.label == "x"
    assert sample.metadata == {"k": 1, "truncated": False, "use_tool": True, "ill_formed": True}
    assert trajectory(manager) == []  # consumed


def test_divergence_inside_the_last_response_realigns_or_forks():
    for threshold, expected in ((None, 1), (0, 2)):
        manager = TrajectoryManager(fork_threshold_tokens=threshold)
        manager.record_turn("s", turn=turn([1, 2], [10, 11, 12]), prompt_messages=[USER], response_message=reply("a"))
        # the template re-rendered the reply as [10, 13]: divergence inside the response
        manager.record_turn("s", turn=turn([1, 2, 10, 13, 4], [20]), prompt_messages=[USER, reply("a"), USER],
                            response_message=reply("b"))
        samples = trajectory(manager)
        assert len(samples) == expected
        if expected == 1:
            assert samples[0].tokens == [1, 2, 10, 13, 4, 20] and samples[0].loss_mask == [0, 0, 0, 1]
        else:
            assert [s.tokens for s in samples] == [[1, 2, 10, 11, 12], [1, 2, 10, 13, 4, 20]]
            assert [s.loss_mask for s in samples] == [[1, 1, 1], [1]]
            assert {s.rollout_id for s in samples} == {5}


def test_divergence_before_the_last_response_forks():
    manager = TrajectoryManager()
    manager.record_turn("s", turn=turn([1, 2], [10]), prompt_messages=[USER], response_message=reply("a"))
    manager.record_turn("s", turn=turn([9, 2, 10, 4], [20]), prompt_messages=[USER, reply("a"), USER],
                        response_message=reply("b"))
    assert [s.tokens for s in trajectory(manager)] == [[1, 2, 10], [9, 2, 10, 4, 20]]


def test_branches_train_a_shared_turn_once_and_rewrites_demote_the_echo():
    manager = TrajectoryManager()
    manager.record_turn("s", turn=turn([1], [10]), prompt_messages=[USER], response_message=reply("a"))
    manager.record_turn("s", turn=turn([1, 10, 2], [11]), prompt_messages=[USER, reply("a"), USER],
                        response_message=reply("b"))
    other = {"role": "user", "content": "other"}
    manager.record_turn("s", turn=turn([1, 10, 3], [12]), prompt_messages=[USER, reply("a"), other],
                        response_message=reply("c"))
    samples = trajectory(manager)
    assert [s.tokens for s in samples] == [[1, 10, 2, 11], [1, 10, 3, 12]]
    assert [s.loss_mask for s in samples] == [[1, 0, 1], [0, 0, 1]]  # turn "a" trained in the first chain only

    manager.record_turn("t", turn=turn([1], [10]), prompt_messages=[USER], response_message=reply("a"))
    manager.record_turn("t", turn=turn([1, 15, 2], [11]), prompt_messages=[USER, reply("a "), USER],
                        response_message=reply("b"))
    [sample] = trajectory(manager, sid="t")  # "a " is the client's re-rendering of "a": not trained
    assert sample.tokens == [1, 15, 2, 11] and sample.loss_mask == [1]


def test_context_budget_truncates_and_marks_length():
    manager = TrajectoryManager()
    manager.record_turn("s", turn=turn([1, 2], [10, 11, 12], finish="length"), prompt_messages=[USER],
                        response_message=reply("a"))
    [sample] = trajectory(manager, max_sample_tokens=4)
    assert sample.tokens == [1, 2, 10, 11] and sample.loss_mask == [1, 1] and sample.metadata["truncated"]


def test_mismatched_log_probs_are_rejected():
    with pytest.raises(ValueError, match="log-probs"):
        TrajectoryManager().record_turn("s", turn=TurnRecord([1], [2, 3], "stop", [0.0]), prompt_messages=[USER],
                                        response_message=reply("a"))
