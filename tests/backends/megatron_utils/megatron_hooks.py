"""The Megatron hooks the CPU test passes (--custom-megatron-init-path, --custom-model-provider-path,
--custom-megatron-before-log-prob-hook-path): each appends what it was called with to the JSON-lines
file named by ``SLIME_TEST_HOOK_LOG``."""

import inspect
import json
import os

import torch.distributed as dist


def _record(**entry) -> None:
    with open(os.environ["SLIME_TEST_HOOK_LOG"], "a") as f:
        f.write(json.dumps({"rank": dist.get_rank(), **entry}) + "\n")


def init(args) -> None:
    _record(hook="init", hf_checkpoint=args.hf_checkpoint)


def provider(pre_process: bool, post_process: bool):
    """The default GPTModel, marked as this provider's. A provider is called without the run's flags (as
    Megatron's own read them from its globals); this one takes them from its caller, slime's build_model."""
    from slime.backends.megatron_utils.model import model_provider

    args = inspect.currentframe().f_back.f_locals["args"]
    model = model_provider(args, pre_process=pre_process, post_process=post_process)
    model.built_by_test_provider = True
    _record(hook="provider", pre_process=pre_process, post_process=post_process)
    return model


def before_log_prob(args, model, store_prefix: str) -> None:
    from slime.backends.megatron_utils.model import unwrap

    _record(hook="before_log_prob", store_prefix=store_prefix,
            provider_model=getattr(unwrap(model), "built_by_test_provider", False))
