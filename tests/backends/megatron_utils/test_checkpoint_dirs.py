"""--load / --ref-load / --ckpt-step / latest_checkpointed_iteration.txt semantics (CPU, no Megatron)."""

import json

import pytest

from slime.backends.megatron_utils.checkpoint import (
    LATEST_FILE,
    iteration_dir,
    read_latest_iteration,
    resolve_checkpoint,
    write_latest_iteration,
)
from slime.arguments import parse_args


def _megatron_ckpt(root, *iterations, latest=None):
    root.mkdir(parents=True, exist_ok=True)
    for it in iterations:
        (root / f"iter_{it:07d}").mkdir()
    if latest is not None:
        write_latest_iteration(str(root), latest)
    return str(root)


def _hf_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return str(path)


def _args(tmp_path, *extra):
    # the Megatron backend's flags, parsed without Megatron-Core installed (--debug-rollout-only skips that check)
    return parse_args(["--train-backend", "megatron", "--rollout-backend", "embedded", "--rollout-batch-size", "1",
                       "--num-rollout", "1", "--debug-rollout-only", *extra])


def test_latest_marker_round_trip(tmp_path):
    assert read_latest_iteration(str(tmp_path)) is None
    write_latest_iteration(str(tmp_path), 12)
    assert (tmp_path / LATEST_FILE).read_text() == "12" and read_latest_iteration(str(tmp_path)) == 12
    assert iteration_dir("/ckpt", 12) == "/ckpt/iter_0000012"
    (tmp_path / LATEST_FILE).write_text("twelve")
    with pytest.raises(ValueError, match="expected an iteration number, found 'twelve'"):
        read_latest_iteration(str(tmp_path))


def test_resume_from_load_with_a_checkpoint(tmp_path):
    save = _megatron_ckpt(tmp_path / "save", 3, 7, latest=7)
    ref = _megatron_ckpt(tmp_path / "ref", 0, latest=0)
    args = _args(tmp_path, "--load", save, "--ref-load", ref)
    assert args.load == save and not args.finetune and args.start_rollout_id is None
    choice = resolve_checkpoint(args.load, args.ckpt_step, args.finetune)
    assert (choice.kind, choice.iteration, choice.resume) == ("megatron", 7, True)
    assert choice.path.endswith("iter_0000007")
    # --ckpt-step picks an older one
    older = resolve_checkpoint(args.load, 3, args.finetune)
    assert older.iteration == 3 and older.path.endswith("iter_0000003")


def test_empty_load_falls_back_to_ref_load_weights_only(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    ref = _megatron_ckpt(tmp_path / "ref", 0, latest=0)
    args = _args(tmp_path, "--load", str(save), "--ref-load", ref)
    assert args.load == ref and args.finetune and args.no_load_optim and args.no_load_rng and args.start_rollout_id == 0
    choice = resolve_checkpoint(args.load, args.ckpt_step, args.finetune)
    assert (choice.kind, choice.iteration, choice.resume) == ("megatron", 0, False)


def test_ref_ckpt_step_applies_on_fallback(tmp_path):
    ref = _megatron_ckpt(tmp_path / "ref", 0, 5, latest=5)
    args = _args(tmp_path, "--ref-load", ref, "--ref-ckpt-step", "0")
    choice = resolve_checkpoint(args.load, args.ckpt_step, args.finetune)
    assert choice.iteration == 0 and not choice.resume


def test_hf_directory_is_read_as_hf(tmp_path):
    hf = _hf_dir(tmp_path / "hf")
    args = _args(tmp_path, "--ref-load", hf)
    assert resolve_checkpoint(args.load, args.ckpt_step, args.finetune).kind == "hf"
    assert resolve_checkpoint(None).kind == "none"


def test_missing_checkpoints_are_explained(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no checkpoint.*convert_hf_to_torch_dist"):
        resolve_checkpoint(str(empty))
    ckpt = _megatron_ckpt(tmp_path / "c", 2, latest=2)
    with pytest.raises(FileNotFoundError, match=r"iter_0000009 does not exist \(--ckpt-step 9\).*iter_0000002"):
        resolve_checkpoint(ckpt, 9)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nowhere"))


def test_adam_step_count_is_read_and_put_back():
    """Resume restores torch Adam's step count (Megatron-Core's load leaves the dummy step's 1)."""
    from types import SimpleNamespace

    import torch

    from slime.backends.megatron_utils.checkpoint import _adam_step, _set_adam_step

    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([param], lr=0.1)
    for _ in range(2):
        param.grad = torch.ones(3)
        adam.step()
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])
    assert _adam_step(chained) == 2.0
    adam.param_groups[0]["step"] = 1  # where Transformer Engine's Adam keeps it
    adam.state[param]["step"] = torch.tensor(1.0)
    _set_adam_step(chained, 2.0)
    assert float(adam.state[param]["step"]) == 2.0 and adam.param_groups[0]["step"] == 2
    assert isinstance(adam.state[param]["step"], torch.Tensor) and isinstance(adam.param_groups[0]["step"], int)
