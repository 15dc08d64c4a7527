"""Disk transport: every version is a directory ``<update_weight_disk_dir>/weight_v{N:06d}/``.

Full mode: an ordinary HF checkpoint that engines load with ``/update_weights_from_disk``; older
versions are deleted unless ``--update-weight-disk-keep-files``.

Delta mode (:mod:`delta_writer`, :mod:`pull`): the version holds only the changed bytes of each
tensor (or is a full checkpoint now and then); each engine is asked to ``/pull_weights`` it into its
host-local ``--update-weight-local-checkpoint-dir`` and then loads that directory with
``/update_weights_from_disk``. Versions older than the newest full one are deleted unless
``--update-weight-disk-keep-files`` (a late-joining host needs that full version and the deltas after it).

Either way the trainer writes into ``weight_v{N:06d}.tmp`` and renames it when complete, copies
``config.json`` and the tokenizer from ``--hf-checkpoint``, and calls
``--custom-update-weight-post-write-path`` after the files are written and before engines read them.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import logging

import httpx
from safetensors.torch import save_file

from slime.backends.update_weight.engine_client import EngineClient
from slime.backends.update_weight.weight_files import version_dir_name
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

_COPY_FROM_HF = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


class DiskWeightUpdater:
    def __init__(self, args, engine_urls: list[str]):
        self.args = args
        self.client = EngineClient(engine_urls)
        self.root = args.update_weight_disk_dir
        os.makedirs(self.root, exist_ok=True)
        self.previous_dir: str | None = None
        self.delta_writer = None
        if args.update_weight_mode == "delta" and not self._engines_serve_pull_weights(engine_urls):
            logger.warning(
                "--update-weight-mode delta needs /pull_weights on every engine, a slime patch that vanilla SGLang "
                "(0.5.23) does not serve; these engines (%s) do not list it, so weights are synced as full "
                "checkpoints (/update_weights_from_disk on each version directory)", ", ".join(engine_urls))
        elif args.update_weight_mode == "delta":
            from slime.backends.update_weight.delta_writer import DeltaVersionWriter

            self.delta_writer = DeltaVersionWriter(args.hf_checkpoint, args.update_weight_delta_encoding,
                                                   args.update_weight_delta_checksum)

    def _engines_serve_pull_weights(self, engine_urls: list[str]) -> bool:
        """The embedded engine serves /pull_weights. An SGLang server does only when patched: its FastAPI
        app lists its routes at /openapi.json, which is read instead of calling a route it may lack."""
        if self.args.rollout_backend == "embedded":
            return True
        for url in engine_urls:
            try:
                response = httpx.get(url + "/openapi.json", timeout=30)
            except httpx.HTTPError as e:
                raise RuntimeError(f"engine {url} is not reachable to read its routes (/openapi.json): {e}") from e
            if response.status_code != 200 or "/pull_weights" not in response.json().get("paths", {}):
                return False
        return True

    def set_engines(self, engine_urls: list[str]) -> None:
        """New engine URLs (engines restarted): published versions and the delta snapshot stay valid, since
        a restarted engine pulls from the same chain."""
        self.client.close()
        self.client = EngineClient(engine_urls)

    def write_version(self, buckets, version: int) -> tuple[str, int, str]:
        """Write one version atomically; returns (its directory, bytes written, "full" or "delta")."""
        version_dir = os.path.join(self.root, version_dir_name(version))
        tmp_dir = version_dir + ".tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
        if self.delta_writer is not None:
            kind, total = self.delta_writer.write(buckets, version, tmp_dir)
        else:
            kind, total = "full", self._write_full(buckets, version, tmp_dir)
        for name in _COPY_FROM_HF:
            src = os.path.join(self.args.hf_checkpoint, name)
            if os.path.isfile(src):
                shutil.copy(src, tmp_dir)
        shutil.rmtree(version_dir, ignore_errors=True)
        os.replace(tmp_dir, version_dir)  # readers never see a half-written version
        return version_dir, total, kind

    @staticmethod
    def _write_full(buckets, version: int, directory: str) -> int:
        weight_map, total = {}, 0
        for index, bucket in enumerate(buckets):
            shard = f"model-{index + 1:05d}.safetensors"
            tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
            save_file(tensors, os.path.join(directory, shard), metadata={"format": "pt"})
            for name, tensor in tensors.items():
                weight_map[name] = shard
                total += tensor.numel() * tensor.element_size()
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total, "weight_version": version}, "weight_map": weight_map}, f)
        return total

    def update(self, buckets, weight_version: str) -> int:
        """Publish a version and have every engine load it; returns the bytes written."""
        version = int(weight_version)
        try:
            version_dir, total, kind = self.write_version(buckets, version)
        except BaseException as exc:
            if self.args.custom_update_weight_post_write_path:
                run_post_write_hook(self.args, None, self.client.engine_urls, failure=f"writing version {version}: {exc}")
            raise
        if self.args.custom_update_weight_post_write_path:
            run_post_write_hook(self.args, version_dir, self.client.engine_urls)
        model_path = version_dir
        if self.delta_writer is not None:
            model_path = self.args.update_weight_local_checkpoint_dir
            self.client.post_all("/pull_weights", {"local_checkpoint_dir": model_path, "source_dir": self.root,
                                                   "target_version": version})
        self.client.post_all("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version,
                                                           "flush_cache": False})
        if not self.args.update_weight_disk_keep_files:
            if self.delta_writer is None and self.previous_dir:
                shutil.rmtree(self.previous_dir, ignore_errors=True)
            elif kind == "full":
                self._remove_versions_before(version)
        self.previous_dir = version_dir
        return total

    def _remove_versions_before(self, version: int) -> None:
        for name in os.listdir(self.root):
            match = re.fullmatch(r"weight_v(\d{6,})", name)
            if match and int(match.group(1)) < version:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def close(self) -> None:
        if self.delta_writer is not None:
            self.delta_writer.close()
        self.client.close()


def run_post_write_hook(args, version_dir: str | None, engine_urls: list[str], failure: str | None = None) -> None:
    """``--custom-update-weight-post-write-path`` on every training rank (docs/INTERFACES.md §2.20).

    Trainer rank 0 writes the version and calls this with its directory; the other ranks call it with
    ``None`` once they have produced their share of the buckets (``TrainRayActor.update_weights``) and
    learn the directory from rank 0. Every rank returns only when the hook finished on all of them, so
    engines read nothing before that; a hook that raises on any rank raises on every rank. ``failure``
    (rank 0 could not write) releases the other ranks without running the hook."""
    import torch.distributed as dist

    hook = load_function(args.custom_update_weight_post_write_path)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if failure is None:
            hook(args, version_dir, engine_urls)
        return
    box = [(version_dir, failure)]
    dist.broadcast_object_list(box, src=0)
    version_dir, failure = box[0]
    if failure is not None:
        if dist.get_rank() != 0:
            raise RuntimeError(f"disk weight sync failed on trainer rank 0 ({failure})")
        return
    error = None
    try:
        hook(args, version_dir, engine_urls)
    except Exception as exc:  # reported on every rank below, so that no rank waits forever
        error = f"rank {dist.get_rank()}: {exc!r}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        raise RuntimeError(f"--custom-update-weight-post-write-path {args.custom_update_weight_post_write_path} "
                           f"failed for {version_dir}: {'; '.join(failed)}")
