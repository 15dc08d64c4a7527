"""--use-wandb --wandb-mode offline: the scalars the run logs reach the W&B run file (``run-<id>.wandb``
under ``<run dir>/wandb/offline-run-*``), which ``wandb sync`` uploads later; no network is used."""

import glob
import json
import struct

import torch

from slime.arguments import parse_args
from slime.utils.tracking import Tracker

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]


def wandb_records(path: str) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) join into records."""
    from wandb.proto import wandb_internal_pb2

    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's zero-padded tail
            pos += left
            continue
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_offline_wandb_run_holds_the_logged_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = parse_args(BASE + ["--use-wandb", "--wandb-mode", "offline", "--wandb-project", "slime-test",
                              "--run-dir", str(tmp_path / "run")])
    tracker = Tracker(args)
    tracker.log({"rollout/raw_reward": torch.tensor(0.25), "rollout/truncated": True, "rollout/bad": float("nan")}, 0,
                "rollout")
    tracker.log({"train/loss": 0.5, "train/grad_norm": 1.5}, 0, "train")
    tracker.log({"train/loss": 0.125, "train/grad_norm": 0.75}, 1, "train")
    tracker.close()
    import wandb

    wandb.teardown()  # the W&B service process writes the run file; its shutdown flushes it
    (path,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history]
    assert logged == [{"rollout/raw_reward": 0.25, "rollout/truncated": 1, "rollout/step": 0},
                      {"train/loss": 0.5, "train/grad_norm": 1.5, "train/step": 0},
                      {"train/loss": 0.125, "train/grad_norm": 0.75, "train/step": 1}]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "slime-test"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["rollout_batch_size"] == 4 and config["train_backend"] == "fsdp"  # the run's flags: its config
