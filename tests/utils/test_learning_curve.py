"""slime.utils.learning_curve: the main command's JSON summary and PNG from a run's metrics.jsonl."""

import json

from slime.utils.learning_curve import hardware_name, learning_curve, main


def _records():
    """An eval before step 1 (at t=100), steps ending every 10 s (their perf record), evals after steps 2 and 4."""
    records = [{"kind": "eval", "step": 0, "time": 100.0, "eval/heldout": 0.25}]
    for step in range(4):
        end = 110.0 + 10 * step
        records += [{"kind": "rollout", "step": step, "time": end - 6, "rollout/raw_reward/mean": 0.1 * (step + 1),
                     "rollout/response_len/mean": 12.0},
                    {"kind": "train", "step": step, "time": end - 2, "train/loss": 0.0,
                     "train/train_rollout_logprob_abs_diff": 0.01 * step, "train/ppo_kl": 0.0},
                    {"kind": "perf", "step": step, "time": end, "perf/rollout_time": 4.0, "perf/train_time": 3.0 + step,
                     "perf/step_time": 10.0}]
        if step in (1, 3):
            records.append({"kind": "eval", "step": step + 1, "time": end - 1, "eval/heldout": 0.25 + 0.1 * step})
    return records


def test_curves_are_against_steps_and_seconds_since_the_first_eval():
    summary = learning_curve(_records(), "heldout")
    assert (summary["before"], summary["after"], summary["best"]) == (0.25, 0.55, 0.55)
    assert summary["gain"] == 0.3 and summary["steps"] == 4 and summary["seconds"] == 40.0
    assert [(h["step"], h["seconds"]) for h in summary["heldout_curve"]] == [(0, 0.0), (2, 19.0), (4, 39.0)]
    assert [(s["step"], s["seconds"], s["reward"]) for s in summary["step_curve"]][:2] == [(1, 10.0, 0.1), (2, 20.0, 0.2)]
    assert summary["step_time_split_mean_s"] == {"rollout_time": 4.0, "step_time": 10.0, "train_time": 4.5}
    assert [s["logprob_abs_diff"] for s in summary["step_curve"]] == [0.0, 0.01, 0.02, 0.03]  # each step's own


def test_writes_json_naming_model_and_hardware_and_a_png(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    main(["--run", str(run), "--eval-name", "heldout", "--model", "SmolLM2-135M-Instruct", "--task", "chain_sum",
          "--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "c.png"), "--extra", '{"seed": 3}'])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["model"] == "SmolLM2-135M-Instruct" and summary["seed"] == 3 and summary["hardware"] == hardware_name()
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "0.250 -> 0.550 (+0.300) in 4 steps" in capsys.readouterr().out


def test_compare_draws_groups_of_runs_and_refuses_a_malformed_group(tmp_path, capsys):
    import pytest

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    main(["--run", str(run), "--eval-name", "heldout", "--model", "m", "--task", "t", "--json", str(tmp_path / "a.json")])
    out = tmp_path / "cmp.png"
    main(["--compare", f"on={tmp_path / 'a.json'},{tmp_path / 'a.json'}", f"off={tmp_path / 'a.json'}", "--png", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(["--compare", str(tmp_path / "a.json"), "--png", str(out)])  # no LABEL=
    assert "LABEL=A.json" in capsys.readouterr().err
