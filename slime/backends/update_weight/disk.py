"""Disk transport, full mode: every version is an ordinary HF checkpoint in
``<update_weight_disk_dir>/weight_v{N:06d}/`` that engines load with ``/update_weights_from_disk``.

The trainer writes safetensors shards (one per bucket) plus ``model.safetensors.index.json``,
``config.json`` and the tokenizer copied from ``--hf-checkpoint``; ``--custom-update-weight-post-write-path``
runs after the files are written and before engines read them. Older versions are deleted unless
``--update-weight-disk-keep-files``.
"""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import save_file

from slime.backends.update_weight.base import EngineClient
from slime.utils.misc import load_function

_COPY_FROM_HF = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


class DiskWeightUpdater:
    def __init__(self, args, engine_urls: list[str]):
        self.args = args
        self.client = EngineClient(engine_urls)
        self.root = args.update_weight_disk_dir
        os.makedirs(self.root, exist_ok=True)
        self.previous_dir: str | None = None

    def write_version(self, buckets, version: int) -> tuple[str, int]:
        version_dir = os.path.join(self.root, f"weight_v{version:06d}")
        tmp_dir = version_dir + ".tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
        weight_map, total, shard_names = {}, 0, []
        for index, bucket in enumerate(buckets):
            shard = f"model-{index + 1:05d}.safetensors"
            tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
            save_file(tensors, os.path.join(tmp_dir, shard), metadata={"format": "pt"})
            for name, tensor in tensors.items():
                weight_map[name] = shard
                total += tensor.numel() * tensor.element_size()
            shard_names.append(shard)
        with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total, "weight_version": version}, "weight_map": weight_map}, f)
        for name in _COPY_FROM_HF:
            src = os.path.join(self.args.hf_checkpoint, name)
            if os.path.isfile(src):
                shutil.copy(src, tmp_dir)
        shutil.rmtree(version_dir, ignore_errors=True)
        os.replace(tmp_dir, version_dir)  # readers never see a half-written version
        return version_dir, total

    def update(self, buckets, weight_version: str) -> int:
        version_dir, total = self.write_version(buckets, int(weight_version))
        if self.args.custom_update_weight_post_write_path:
            load_function(self.args.custom_update_weight_post_write_path)(self.args, version_dir, self.client.engine_urls)
        self.client.post_all("/update_weights_from_disk", {"model_path": version_dir, "weight_version": weight_version,
                                                           "flush_cache": False})
        if self.previous_dir and not self.args.update_weight_disk_keep_files:
            shutil.rmtree(self.previous_dir, ignore_errors=True)
        self.previous_dir = version_dir
        return total

    def close(self) -> None:
        self.client.close()
