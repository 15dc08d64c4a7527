"""Engine-host side of disk weight sync in delta mode: ``/pull_weights``.

``pull_weights(local_checkpoint_dir, source_dir, target_version)`` brings the host-local checkpoint
to version ``target_version`` published under ``source_dir/weight_v{N:06d}/`` (see
:mod:`weight_files` for the layout); the engine then loads the local directory through the ordinary
``/update_weights_from_disk``.

* Once per host: engines of one host share the local directory; a file lock
  (``<local_checkpoint_dir>.lock``, ``fcntl.flock``) serialises them and the local marker
  ``slime_weight_version.json`` (``{"version", "chain"}``) makes a repeated pull a no-op.
* Only on top of the declared base: a delta applies to the local checkpoint only when it holds the
  delta's base version of the same chain. A host that is behind catches up through the published
  chain; one with no usable local checkpoint starts from the newest full version at or before the
  target, or from its own copy of the ``--hf-checkpoint`` (version -1) when the chain has no full
  version yet. A target older than the local version, or a chain link missing from ``source_dir``,
  is an error.
* Verified: every tensor's new bytes are checked against the published checksum; any mismatch,
  corrupt payload or truncated file raises :class:`PullError` naming the version, tensor and file.
* All or nothing per version: changed shards are written to temporary files and renamed into place
  only after every tensor of the version verified; a seeded checkpoint is built in a staging
  directory and swapped in at the end. On failure the local checkpoint is left as it was.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from slime.backends.update_weight import delta
from slime.backends.update_weight.weight_files import (
    BASE_CHECKPOINT_VERSION,
    DTYPE_SIZES,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    Shard,
    VersionInfo,
    checkpoint_weight_map,
    read_shard,
    read_version,
    version_dir_name,
    write_json_atomic,
    write_shard,
)

logger = logging.getLogger(__name__)

MARKER_NAME = "slime_weight_version.json"
TMP_SUFFIX = ".slime-tmp"


class PullError(RuntimeError):
    """A version that cannot be applied; the message names the version, tensor or file at fault."""


def read_marker(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MARKER_NAME)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _source_version(source_dir: str, version: int) -> VersionInfo:
    path = os.path.join(source_dir, version_dir_name(version))
    if not os.path.isdir(path):
        raise FileNotFoundError(path)
    try:
        return read_version(path, expected_version=version)
    except (OSError, ValueError, KeyError) as exc:
        raise PullError(f"version {version}: unreadable metadata: {exc}") from exc


def _plan(local: dict | None, source_dir: str, target: VersionInfo) -> tuple[str | VersionInfo | None, list[VersionInfo]]:
    """Walk back from ``target`` to something the host has: returns (seed, deltas to apply in order).
    seed is None (apply in place), a full VersionInfo, or "base" (the host's --hf-checkpoint)."""
    chain: list[VersionInfo] = []
    current = target
    while True:
        if current.kind == "full":
            return current, chain[::-1]
        chain.append(current)
        base = current.base_version
        if local is not None and local.get("version") == base and (
                base == BASE_CHECKPOINT_VERSION or local.get("chain") == current.chain):
            return None, chain[::-1]
        if base == BASE_CHECKPOINT_VERSION:
            return "base", chain[::-1]
        try:
            previous = _source_version(source_dir, base)
        except FileNotFoundError:
            have = "no local checkpoint" if local is None else f"the local checkpoint is at version {local.get('version')}"
            raise PullError(f"version {current.version} applies on top of version {base}, which is not in {source_dir} "
                            f"(skipped or deleted), and {have}; cannot reach version {target.version}") from None
        if previous.chain != current.chain:
            raise PullError(f"version {current.version} applies on top of version {base} of run {current.chain}, but "
                            f"{previous.path} was written by run {previous.chain}")
        current = previous


def _verify(name: str, data: np.ndarray, info: dict, version: VersionInfo, where: str) -> None:
    digest = delta.checksum(data, version.checksum)
    if digest != info["checksum"]:
        raise PullError(f"version {version.version}: checksum mismatch for tensor {name} ({version.checksum} {digest}, "
                        f"published {info['checksum']}) {where}")


def _copy_full(version: VersionInfo, staging: str, pool: ThreadPoolExecutor) -> None:
    """Copy a full version as-is and verify every tensor it lists."""
    shutil.copytree(version.path, staging)
    for file_name in sorted(set(version.weight_map[name] for name in version.tensors)):
        try:
            shard = read_shard(os.path.join(staging, file_name))
        except (OSError, ValueError) as exc:
            raise PullError(f"version {version.version}: {exc}") from exc

        def check(name):
            if name not in shard.entries:
                raise PullError(f"version {version.version}: tensor {name} is missing from {file_name}")
            _verify(name, shard.tensor(name), version.tensors[name], version, f"in {version.path}/{file_name}")

        list(pool.map(check, [n for n in version.tensors if version.weight_map[n] == file_name]))


def _check_version(directory: str, version: VersionInfo, local_map: dict[str, str]) -> None:
    for name, info in version.tensors.items():
        if info["encoding"] not in ("raw", *delta.ENCODINGS):
            raise PullError(f"version {version.version}: tensor {name} has unknown encoding {info['encoding']!r}")
        if info["encoding"] != "raw" and name not in local_map:
            raise PullError(f"version {version.version}: tensor {name} is a {info['encoding']} delta but the local "
                            f"checkpoint {directory} has no such tensor")
        if name not in version.weight_map:
            raise PullError(f"version {version.version}: tensor {name} is not in the weight_map of {version.path}")


def _read_payloads(version: VersionInfo) -> dict[str, Shard]:
    shards = {}
    for file_name in sorted(set(version.weight_map[name] for name in version.tensors)):
        try:
            shards[file_name] = read_shard(os.path.join(version.path, file_name))
        except (OSError, ValueError) as exc:
            raise PullError(f"version {version.version}: {exc}") from exc
    return shards


def _new_tensor(name: str, shard: Shard | None, payloads: dict[str, Shard], version: VersionInfo) -> np.ndarray:
    """The tensor's bytes in the new version, verified against the published checksum."""
    info = version.tensors[name]
    payload_file = payloads[version.weight_map[name]]
    if name not in payload_file.entries:
        raise PullError(f"version {version.version}: tensor {name} is missing from {payload_file.path}")
    payload = payload_file.tensor(name)
    if info["encoding"] == "raw":
        new = payload
    else:
        entry = shard.entries[name]
        if entry.dtype != info["dtype"] or entry.shape != info["shape"]:
            raise PullError(f"version {version.version}: tensor {name} is {entry.dtype} {entry.shape} in the local "
                            f"checkpoint, the delta is for {info['dtype']} {info['shape']}")
        new = shard.tensor(name)  # the shard is a private copy: apply in place
        try:
            delta.apply(info["encoding"], new, payload, DTYPE_SIZES[info["dtype"]])
        except (delta.DeltaError, ValueError) as exc:
            raise PullError(f"version {version.version}: tensor {name} in {payload_file.path}: {exc}") from exc
    _verify(name, new, info, version, f"after applying {payload_file.path} to {shard.path if shard else 'nothing'}; "
            f"the local checkpoint is not version {version.base_version} or the delta is corrupt")
    return new


def _rewrite_shard(path: str, names: list[str], added: list[str], removed: list[str], payloads: dict[str, Shard],
                   version: VersionInfo, pool: ThreadPoolExecutor) -> str:
    """Write the new content of one local shard to a temporary file next to it; returns that file."""
    if os.path.exists(path):
        try:
            shard = read_shard(path)
        except (OSError, ValueError) as exc:
            raise PullError(f"local checkpoint: {exc}") from exc
    elif added and set(names) <= set(added):
        shard = None  # an empty checkpoint receiving its first tensors
    else:
        raise PullError(f"local checkpoint: {path} is listed in its index but does not exist")
    changed = [name for name in names if name in version.tensors]
    new_bytes = dict(zip(changed, pool.map(lambda name: _new_tensor(name, shard, payloads, version), changed)))
    tensors = []
    for name, entry in (shard.entries.items() if shard else []):
        info = version.tensors.get(name)
        if name in removed:
            continue
        if info is not None and info["encoding"] == "raw":  # may change dtype or shape
            tensors.append((name, info["dtype"], info["shape"], new_bytes[name]))
        else:
            tensors.append((name, entry.dtype, entry.shape, new_bytes.get(name, shard.tensor(name))))
    tensors += [(name, version.tensors[name]["dtype"], version.tensors[name]["shape"], new_bytes[name])
                for name in names if name in added]
    write_shard(path + TMP_SUFFIX, tensors, shard.metadata if shard else None)
    return path + TMP_SUFFIX


def _apply_delta(directory: str, version: VersionInfo, pool: ThreadPoolExecutor) -> None:
    """Apply one delta version to the checkpoint in ``directory``: all changed files or none."""
    local_map = checkpoint_weight_map(directory)
    _check_version(directory, version, local_map)
    payloads = _read_payloads(version)
    added = [name for name in version.tensors if name not in local_map]
    removed = [name for name in version.removed if name in local_map]
    first_file = min(local_map.values(), default=SINGLE_FILE_NAME)  # where new tensors go
    touched: dict[str, list[str]] = {}
    for name in list(version.tensors) + removed:
        touched.setdefault(local_map.get(name, first_file), []).append(name)
    index_path = os.path.join(directory, INDEX_NAME)
    written: list[tuple[str, str]] = []
    try:
        for file_name, names in sorted(touched.items()):  # one local shard in memory at a time
            path = os.path.join(directory, file_name)
            written.append((_rewrite_shard(path, names, added, removed, payloads, version, pool), path))
        if (added or removed) and os.path.isfile(index_path):
            with open(index_path) as f:
                index = json.load(f)
            for name in removed:
                index["weight_map"].pop(name, None)
            index["weight_map"].update({name: first_file for name in added})
            write_json_atomic(index_path + TMP_SUFFIX, index)
            written.append((index_path + TMP_SUFFIX, index_path))
    except BaseException:
        for tmp, _ in written:
            _remove(tmp)
        raise
    for tmp, final in written:
        os.replace(tmp, final)
    write_json_atomic(os.path.join(directory, MARKER_NAME), {"version": version.version, "chain": version.chain})


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def pull_weights(local_checkpoint_dir: str, source_dir: str, target_version: int, base_checkpoint: str | None = None,
                 pre_read_hook=None, num_workers: int | None = None) -> str:
    """Bring ``local_checkpoint_dir`` to ``target_version``; returns a message saying what was done.

    ``base_checkpoint``: this host's copy of ``--hf-checkpoint`` (version -1). ``pre_read_hook``:
    ``hook(source_dir, target_version)`` called under the lock before anything is read (e.g. to
    refresh an object-store mount)."""
    local_checkpoint_dir = os.path.abspath(local_checkpoint_dir)
    os.makedirs(os.path.dirname(local_checkpoint_dir), exist_ok=True)
    with open(local_checkpoint_dir + ".lock", "a") as lock, \
            ThreadPoolExecutor(max_workers=num_workers or min(8, os.cpu_count() or 1),
                               thread_name_prefix="delta-apply") as pool:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if pre_read_hook is not None:
            try:
                pre_read_hook(source_dir, target_version)
            except Exception as exc:  # e.g. the object store is unreachable: nothing has been touched yet
                raise PullError(f"the pre-read hook failed for version {target_version} of {source_dir}: {exc!r}") from exc
        local = read_marker(local_checkpoint_dir) if os.path.isdir(local_checkpoint_dir) else None
        try:
            target = _source_version(source_dir, target_version)
        except FileNotFoundError:
            raise PullError(f"version {target_version} is not in {source_dir}") from None
        if local is not None and local.get("chain") == target.chain:
            if local.get("version") == target_version:
                return f"local checkpoint already at version {target_version}"
            if local.get("version", -1) > target_version:
                raise PullError(f"out-of-order pull: the local checkpoint {local_checkpoint_dir} is at version "
                                f"{local['version']}, newer than the requested version {target_version}")
        seed, deltas = _plan(local, source_dir, target)
        if seed is None:
            for version in deltas:
                _apply_delta(local_checkpoint_dir, version, pool)
            return f"applied versions {[v.version for v in deltas]} in place"
        staging = f"{local_checkpoint_dir}.staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            if seed == "base":
                if not base_checkpoint or not os.path.isdir(base_checkpoint):
                    raise PullError(f"version {deltas[0].version} applies on top of the --hf-checkpoint (version -1) "
                                    f"but this engine has no local copy of it ({base_checkpoint!r})")
                shutil.copytree(base_checkpoint, staging)
                seeded_from = f"the base checkpoint {base_checkpoint}"
                write_json_atomic(os.path.join(staging, MARKER_NAME), {"version": BASE_CHECKPOINT_VERSION, "chain": None})
            else:
                _copy_full(seed, staging, pool)
                seeded_from = f"full version {seed.version}"
                write_json_atomic(os.path.join(staging, MARKER_NAME), {"version": seed.version, "chain": seed.chain})
            for version in deltas:
                _apply_delta(staging, version, pool)
            _swap_in(staging, local_checkpoint_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return f"seeded from {seeded_from}, applied versions {[v.version for v in deltas]}"


def _swap_in(staging: str, destination: str) -> None:
    old = f"{destination}.old-{os.getpid()}"
    if os.path.exists(destination):
        os.replace(destination, old)
    os.replace(staging, destination)
    shutil.rmtree(old, ignore_errors=True)
