"""Delta disk weight sync without a server: the codec, the trainer's writer and the host's
``pull_weights`` (what the embedded engine's ``/pull_weights`` route runs)."""

import hashlib
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.backends.update_weight import delta
from slime.backends.update_weight.disk import DiskWeightUpdater
from slime.backends.update_weight.pull import PullError, pull_weights, read_marker
from slime.backends.update_weight.weight_files import version_dir_name
from tests.parsed_args import default_args


# ------------------------------------------------------------------------------------------- codec
def _byte_patterns(dtype_name, seed):
    """old and new tensors of a dtype (as raw bytes) where about 3% of the elements changed."""
    gen = torch.Generator().manual_seed(seed)
    if dtype_name == "fp8-like":
        old = torch.randint(0, 256, (4099,), generator=gen, dtype=torch.uint8)
    else:
        old = torch.randn(4099, generator=gen).to(getattr(torch, dtype_name))
    new = old.clone()
    positions = torch.randperm(old.numel(), generator=gen)[:120]
    raw = new.view(torch.uint8).view(old.numel(), -1)
    raw[positions] ^= torch.randint(1, 256, (120, raw.shape[1]), generator=gen, dtype=torch.uint8)
    return old.view(torch.uint8).numpy().copy(), new.view(torch.uint8).numpy().copy(), old.element_size()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32", "fp8-like"])
@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_round_trip_is_byte_exact(encoding, dtype_name):
    old, new, itemsize = _byte_patterns(dtype_name, seed=len(dtype_name))
    payload = delta.encode(encoding, new, old, itemsize)
    target = old.copy()
    delta.apply(encoding, target, payload, itemsize)
    assert target.tobytes() == new.tobytes()
    assert len(payload) < new.nbytes / 4  # 3% changed: far smaller than the tensor
    delta.apply(encoding, target, payload, itemsize)
    # xor is an involution (twice reverts); overwrite is idempotent (twice = once)
    assert target.tobytes() == (old if encoding == "xor" else new).tobytes()


def test_tensor_larger_than_a_chunk_round_trips_and_rejects_a_short_payload():
    """xor streams tensors above delta.CHUNK_BYTES piece by piece."""
    gen = torch.Generator().manual_seed(5)
    old = torch.randn(3 * delta.CHUNK_BYTES // 2 + 3, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[::101] = new[::101] * 2
    old_bytes, new_bytes = old.view(torch.uint8).numpy().copy(), new.view(torch.uint8).numpy()
    payload = delta.encode("xor", new_bytes, old_bytes, 2)
    target = old_bytes.copy()
    delta.apply("xor", target, payload, 2)
    assert target.tobytes() == new_bytes.tobytes()
    with pytest.raises(delta.DeltaError, match="corrupt zstd payload|xor payload holds"):
        delta.apply("xor", old_bytes.copy(), payload[:len(payload) // 2], 2)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_no_change_and_all_changed(encoding):
    old = np.arange(1000, dtype=np.uint16).view(np.uint8)
    for new in (old.copy(), (np.arange(1000, dtype=np.uint16) + 7).view(np.uint8)):
        target = old.copy()
        delta.apply(encoding, target, delta.encode(encoding, new, old, 2), 2)
        assert target.tobytes() == new.tobytes()


def test_corrupt_and_mismatched_payloads_are_rejected():
    old, new, _ = _byte_patterns("bfloat16", seed=3)
    payload = bytearray(delta.encode("xor", new, old, 2))
    with pytest.raises(delta.DeltaError, match="xor payload holds 8198 bytes, the tensor has 8196"):
        delta.apply("xor", old[:-2].copy(), bytes(payload), 2)
    payload[len(payload) // 2] ^= 0xFF
    target = old.copy()
    try:  # zstd may or may not notice; if it does not, the bytes differ and the checksum catches it
        delta.apply("xor", target, bytes(payload), 2)
    except delta.DeltaError:
        pass
    else:
        assert delta.checksum(target, "xxh3-128") != delta.checksum(new, "xxh3-128")
    with pytest.raises(delta.DeltaError, match="for 2-byte elements .* the tensor has 1-byte elements"):
        delta.apply("overwrite", old.copy(), delta.encode("overwrite", new, old, 2), 1)


@pytest.mark.parametrize("algorithm", ["xxh3-128", "blake3", "adler32"])
def test_checksums_see_one_changed_byte(algorithm):
    data = np.zeros(1 << 16, dtype=np.uint8)
    before = delta.checksum(data, algorithm)
    data[12345] = 1
    assert delta.checksum(data, algorithm) != before
    assert delta.checksum(data, algorithm) == delta.checksum(data.copy(), algorithm)


# ----------------------------------------------------------------------------- writer and pull
def _initial_state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=gen),
            "model.layers.0.scale_inv": torch.randint(0, 256, (40,), generator=gen, dtype=torch.uint8),
            "model.norm.weight": torch.ones(32, dtype=torch.bfloat16)}


def _step(state, seed, fraction=0.02):
    """A small update: a few elements of every tensor move."""
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in state.items():
        t = tensor.clone()
        flat = t.view(-1)
        picks = torch.randperm(flat.numel(), generator=gen)[:max(1, int(fraction * flat.numel()))]
        flat[picks] = (flat[picks].float() + 1).to(t.dtype) if t.is_floating_point() else flat[picks] + 1
        new[name] = t
    return new


class Trainer:
    """The real trainer-side updater publishing versions into ``source`` (no engines attached)."""

    def __init__(self, tmp_path, encoding="xor", checksum="xxh3-128", keep_files=True):
        self.hf = tmp_path / "hf"
        self.hf.mkdir()
        self.state = _initial_state()
        save_file(self.state, str(self.hf / "model.safetensors"), metadata={"format": "pt"})
        (self.hf / "config.json").write_text("{}")
        self.source = tmp_path / "published"
        args = default_args(update_weight_mode="delta", update_weight_disk_dir=str(self.source),
                            hf_checkpoint=str(self.hf), update_weight_delta_encoding=encoding,
                            update_weight_delta_checksum=checksum, update_weight_disk_keep_files=keep_files,
                            update_weight_local_checkpoint_dir=str(tmp_path / "unused"),
                            custom_update_weight_post_write_path=None)
        self.updater = DiskWeightUpdater(args, [])
        self.published = {}

    def publish(self, version, state):
        self.state = state
        self.updater.update([list(state.items())[:2], list(state.items())[2:]], str(version))
        self.published[version] = {k: v.clone() for k, v in state.items()}
        return read_version_kind(self.source, version)


def read_version_kind(source, version):
    from slime.backends.update_weight.weight_files import read_version

    return read_version(str(source / version_dir_name(version))).kind


def _local_tensors(local):
    out = {}
    for name in os.listdir(local):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(local, name)))
    return out


def _assert_local_is(local, state):
    tensors = _local_tensors(local)
    assert sorted(tensors) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(tensors[name].view(torch.uint8), tensor.view(torch.uint8)), name


def _digest(directory):
    """Content of every file of a directory (to check that a failed pull changed nothing)."""
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))}


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(tmp_path)
    yield t
    t.updater.close()


@pytest.mark.parametrize("encoding,checksum", [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32")])
def test_versions_apply_in_order_and_exactly_once(tmp_path, encoding, checksum):
    trainer = Trainer(tmp_path, encoding, checksum)
    local = str(tmp_path / "host" / "ckpt")
    assert trainer.publish(0, trainer.state) == "delta"  # on top of the --hf-checkpoint (version -1)
    message = pull_weights(local, str(trainer.source), 0, base_checkpoint=str(trainer.hf))
    assert "seeded from the base checkpoint" in message
    _assert_local_is(local, trainer.published[0])
    for version in (1, 2):
        assert trainer.publish(version, _step(trainer.state, version)) == "delta"
        assert "in place" in pull_weights(local, str(trainer.source), version)
        _assert_local_is(local, trainer.published[version])
    assert "already at version 2" in pull_weights(local, str(trainer.source), 2)
    assert read_marker(local)["version"] == 2
    trainer.updater.close()


def test_host_that_is_behind_catches_up_through_the_chain(trainer, tmp_path):
    local = str(tmp_path / "ckpt")
    trainer.publish(0, trainer.state)
    pull_weights(local, str(trainer.source), 0, base_checkpoint=str(trainer.hf))
    for version in (1, 2, 3):
        trainer.publish(version, _step(trainer.state, version))
    assert "applied versions [1, 2, 3] in place" in pull_weights(local, str(trainer.source), 3)
    _assert_local_is(local, trainer.published[3])


def _publish_three(trainer, tmp_path):
    local = str(tmp_path / "ckpt")
    trainer.publish(0, trainer.state)
    trainer.publish(1, _step(trainer.state, 1))
    pull_weights(local, str(trainer.source), 1, base_checkpoint=str(trainer.hf))
    trainer.publish(2, _step(trainer.state, 2))
    return local, _digest(local)


def _payload_offset(path, name):
    import json
    import struct

    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return 8 + header_len + header[name]["data_offsets"][0], header[name]["data_offsets"][1] - header[name]["data_offsets"][0]


def test_corrupted_delta_byte_fails_and_leaves_local_checkpoint(trainer, tmp_path):
    local, before = _publish_three(trainer, tmp_path)
    shard = trainer.source / version_dir_name(2) / "model-00001.safetensors"
    start, size = _payload_offset(shard, "model.layers.0.mlp.up_proj.weight")
    data = bytearray(shard.read_bytes())
    data[start + size // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    with pytest.raises(PullError, match=r"version 2: .*tensor model\.layers\.0\.mlp\.up_proj\.weight"):
        pull_weights(local, str(trainer.source), 2)
    assert _digest(local) == before


def test_wrong_base_fails_and_leaves_local_checkpoint(trainer, tmp_path):
    local, _ = _publish_three(trainer, tmp_path)
    # the local files are not what the marker says (version 1): the new-state checksum catches it
    tensors = load_file(os.path.join(local, "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 3
    save_file(tensors, os.path.join(local, "model.safetensors"), metadata={"format": "pt"})
    before = _digest(local)
    with pytest.raises(PullError, match=r"version 2: checksum mismatch for tensor model\.norm\.weight .*not version 1"):
        pull_weights(local, str(trainer.source), 2)
    assert _digest(local) == before


def test_skipped_version_fails_and_leaves_local_checkpoint(trainer, tmp_path):
    local, before = _publish_three(trainer, tmp_path)
    trainer.publish(3, _step(trainer.state, 3))
    import shutil

    shutil.rmtree(trainer.source / version_dir_name(2))
    with pytest.raises(PullError, match=r"version 3 applies on top of version 2, which is not in .*local checkpoint is at version 1"):
        pull_weights(local, str(trainer.source), 3)
    assert _digest(local) == before


def test_out_of_order_pull_fails(trainer, tmp_path):
    local, _ = _publish_three(trainer, tmp_path)
    pull_weights(local, str(trainer.source), 2)
    before = _digest(local)
    with pytest.raises(PullError, match="out-of-order pull: .* is at version 2, newer than the requested version 1"):
        pull_weights(local, str(trainer.source), 1)
    assert _digest(local) == before


def test_truncated_file_fails_and_leaves_local_checkpoint(trainer, tmp_path):
    local, before = _publish_three(trainer, tmp_path)
    shard = trainer.source / version_dir_name(2) / "model-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(PullError, match=r"version 2: .*model-00002\.safetensors: truncated"):
        pull_weights(local, str(trainer.source), 2)
    assert _digest(local) == before


def test_late_host_seeds_from_newest_full_version(tmp_path):
    trainer = Trainer(tmp_path, keep_files=False)
    kinds = [trainer.publish(0, trainer.state)]
    while kinds[-1] != "full":  # rewriting every weight: once a model's worth of deltas piled up, a full version
        kinds.append(trainer.publish(len(kinds), _initial_state(seed=len(kinds))))
    full = len(kinds) - 1
    assert 2 <= full <= 3, kinds
    trainer.publish(full + 1, _step(trainer.state, 1))
    trainer.publish(full + 2, _step(trainer.state, 2))
    # versions before the newest full one are deleted (no --update-weight-disk-keep-files)
    assert sorted(os.listdir(trainer.source)) == [version_dir_name(v) for v in (full, full + 1, full + 2)]
    local = str(tmp_path / "late-host" / "ckpt")
    message = pull_weights(local, str(trainer.source), full + 2, base_checkpoint=None)  # no --hf-checkpoint needed
    assert message == f"seeded from full version {full}, applied versions [{full + 1}, {full + 2}]"
    _assert_local_is(local, trainer.published[full + 2])
    trainer.updater.close()


def test_new_and_removed_tensors_travel_in_a_delta(trainer, tmp_path):
    local, _ = _publish_three(trainer, tmp_path)
    state = dict(trainer.state)
    state["model.norm.weight"] = state["model.norm.weight"].float()  # dtype changed
    state["lm_head.weight"] = torch.randn(64, 32).to(torch.bfloat16)  # new
    del state["model.layers.0.scale_inv"]  # gone
    trainer.publish(3, state)
    pull_weights(local, str(trainer.source), 3)
    _assert_local_is(local, trainer.published[3])


def test_pre_read_hook_runs_before_reading(trainer, tmp_path):
    trainer.publish(0, trainer.state)
    calls = []
    pull_weights(str(tmp_path / "ckpt"), str(trainer.source), 0, base_checkpoint=str(trainer.hf),
                 pre_read_hook=lambda source_dir, version: calls.append((source_dir, version)))
    assert calls == [(str(trainer.source), 0)]

    def unreachable(source_dir, version):
        raise OSError("mount is gone")

    with pytest.raises(PullError, match=r"the pre-read hook failed for version 0 .*mount is gone"):
        pull_weights(str(tmp_path / "other"), str(trainer.source), 0, base_checkpoint=str(trainer.hf),
                     pre_read_hook=unreachable)
    assert not (tmp_path / "other").exists()


# ---------------------------------------------------------------- post-write hook on every rank
def record_hook(args, version_dir, engine_urls):
    import torch.distributed as dist

    rank = dist.get_rank()
    complete = os.path.isfile(os.path.join(version_dir, "model.safetensors.index.json"))
    with open(os.path.join(args.record_dir, f"rank{rank}"), "w") as f:
        f.write(f"{version_dir} {complete}")
    if args.fail_on_rank == rank:
        raise ValueError("upload failed")


def _hook_rank(rank, world_size, port, args):
    import torch.distributed as dist

    from slime.backends.update_weight.disk import run_post_write_hook

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        if rank == 0:
            updater = DiskWeightUpdater(args, [])
            updater.update([list(_initial_state().items())], "3")
        else:
            run_post_write_hook(args, None, [])
    except RuntimeError as exc:
        with open(os.path.join(args.record_dir, f"error{rank}"), "w") as f:
            f.write(str(exc))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fail_on_rank", [None, 1])
def test_post_write_hook_runs_on_every_rank_after_the_files_are_written(tmp_path, fail_on_rank):
    import torch.multiprocessing as mp

    from slime.backends.embedded_engine.serving.launch import find_free_port

    args = default_args(update_weight_mode="full", update_weight_disk_dir=str(tmp_path / "published"),
                        hf_checkpoint=str(tmp_path), update_weight_disk_keep_files=False,
                        custom_update_weight_post_write_path=f"{__name__}.record_hook",
                        record_dir=str(tmp_path), fail_on_rank=fail_on_rank)
    mp.start_processes(_hook_rank, args=(2, find_free_port(), args), nprocs=2, start_method="spawn")
    expected = f"{tmp_path / 'published' / version_dir_name(3)} True"
    assert (tmp_path / "rank0").read_text() == expected and (tmp_path / "rank1").read_text() == expected
    errors = sorted(p.name for p in tmp_path.glob("error*"))
    if fail_on_rank is None:
        assert errors == []
    else:  # the failure on rank 1 is raised on both ranks, naming the rank and the hook's error
        assert errors == ["error0", "error1"]
        assert "rank 1: ValueError('upload failed')" in (tmp_path / "error0").read_text()


def test_engines_of_one_host_apply_a_version_once(trainer, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    trainer.publish(0, trainer.state)
    local = str(tmp_path / "shared-host-ckpt")
    with ThreadPoolExecutor(4) as pool:  # four engines of one host, each with its own lock handle
        messages = list(pool.map(lambda _: pull_weights(local, str(trainer.source), 0, base_checkpoint=str(trainer.hf)),
                                 range(4)))
    assert sum("seeded from" in m for m in messages) == 1
    assert sum(m == "local checkpoint already at version 0" for m in messages) == 3
    _assert_local_is(local, trainer.published[0])


def test_seeding_needs_the_base_checkpoint_or_a_full_version(trainer, tmp_path):
    trainer.publish(0, trainer.state)
    local = tmp_path / "ckpt"
    with pytest.raises(PullError, match=r"version 0 applies on top of the --hf-checkpoint \(version -1\) but this "
                                        r"engine has no local copy of it"):
        pull_weights(str(local), str(trainer.source), 0, base_checkpoint=None)
    assert not local.exists()
    with pytest.raises(PullError, match=r"version 7 is not in"):
        pull_weights(str(local), str(trainer.source), 7, base_checkpoint=str(trainer.hf))


def test_truncated_full_version_is_refused_when_seeding(tmp_path):
    trainer = Trainer(tmp_path)
    trainer.updater.delta_writer.snapshot = None  # as after a failed write: the next version is full
    assert trainer.publish(0, trainer.state) == "full"
    shard = trainer.source / version_dir_name(0) / "model-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    local = tmp_path / "ckpt"
    with pytest.raises(PullError, match=r"version 0: .*model-00001\.safetensors: truncated"):
        pull_weights(str(local), str(trainer.source), 0)
    assert not local.exists() and not list(tmp_path.glob("ckpt.staging*"))
    trainer.updater.close()


def test_pre_read_hook_flag_reaches_the_embedded_engine():
    from slime.ray.engine_actor import embedded_engine_argv
    from slime.arguments import parse_args

    args = parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", "/tmp",
                       "--rollout-batch-size", "4", "--num-rollout", "1",
                       "--update-weight-transport", "disk", "--update-weight-mode", "delta",
                       "--update-weight-disk-dir", "/shared/w", "--update-weight-local-checkpoint-dir", "/local/w",
                       "--sglang-custom-pull-weights-pre-read-hook", "my_mounts.refresh"])
    argv = embedded_engine_argv(args, gpu=False)
    assert argv[argv.index("--custom-pull-weights-pre-read-hook") + 1] == "my_mounts.refresh"
