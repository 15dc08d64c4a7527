"""Engine admin calls and the choice of transport."""

from __future__ import annotations

import logging

import httpx

from slime.backends.update_weight.engine_client import EngineClient

__all__ = ["EngineClient", "bucket_named_tensors", "make_weight_updater", "cpu_engines_on_this_host"]

logger = logging.getLogger(__name__)


def bucket_named_tensors(named_tensors, bucket_bytes: int):
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` bytes (the
    trainer's bucketing, :func:`slime.backends.training.weights.bucket_weights`)."""
    from slime.backends.training.weights import bucket_weights

    return bucket_weights(named_tensors, bucket_bytes)


def make_weight_updater(args, engine_urls: list[str], engine_gpu_counts: list[int], colocate: bool):
    """Pick the transport: disk when asked; tensor handles when colocated, or shared memory when every
    engine is an embedded CPU engine on this machine (:func:`cpu_engines_on_this_host`); otherwise broadcast."""
    if args.update_weight_transport == "disk":  # full or delta mode
        from slime.backends.update_weight.disk import DiskWeightUpdater

        return DiskWeightUpdater(args, engine_urls)
    if colocate or cpu_engines_on_this_host(args, engine_urls):
        from slime.backends.update_weight.tensor import TensorWeightUpdater

        if not colocate:
            logger.info("weights to the engines %s through shared memory (/update_weights_from_tensor): CPU "
                        "engines on the trainer's machine", engine_urls)
        return TensorWeightUpdater(args, engine_urls, engine_gpu_counts)
    from slime.backends.update_weight.distributed import DistributedWeightUpdater

    return DistributedWeightUpdater(args, engine_urls, engine_gpu_counts)


def cpu_engines_on_this_host(args, engine_urls: list[str]) -> bool:
    """Whether a CPU trainer's engines can take its weights through shared memory instead of a gloo
    broadcast over TCP loopback (6.2 vs 0.94 GB/s on the 2-core machine, docs/loop.md): the trainer has no
    CUDA, and every engine is an embedded engine (``"engine": "slime-embedded"`` in ``/get_server_info``)
    running on the CPU (``"device": "cpu"``) behind a loopback address, i.e. on this machine (embedded
    engines listen on loopback only). SGLang engines keep the broadcast, the protocol path they are tested on."""
    import ipaddress
    from urllib.parse import urlparse

    import torch

    if not engine_urls or not (args.cpu_only or not torch.cuda.is_available()):
        return False
    for url in engine_urls:
        host = (urlparse(url).hostname or "").strip("[]")
        try:
            local = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = False
        if not local:
            return False
        try:
            info = httpx.get(url + "/get_server_info", timeout=30).json()
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("could not read %s/get_server_info (%s): weights go by broadcast", url, e)
            return False
        if info.get("engine") != "slime-embedded" or info.get("device") != "cpu":
            return False
    return True
