"""The verification of ``--true-on-policy`` and ``--deterministic-mode`` on one GPU (``-m gpu``): the real loop
(Ray, the embedded engine with its CUDA graphs, FSDP2 on NCCL, trainer and engine sharing the GPU) in bf16
on the tiny Qwen3, run twice with one seed. CUDA is named in ``SLIME_VERIFY_EXACTNESS_ON``, which lets the
flags start on a device not yet verified; where this passes on a GPU, the CUDA refusal can go
(``slime.utils.exactness.VERIFIED_DEVICES``)."""

import os
from pathlib import Path

import pytest
import ray

from tests.ray.test_exact_runs import HERE, exact_args, run, saved_state, values, without_timings

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    os.environ["SLIME_VERIFY_EXACTNESS_ON"] = "cuda"  # the driver's start-up check too
    python_path = os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "SLIME_VERIFY_EXACTNESS_ON": "cuda"}})
    yield
    ray.shutdown()
    os.environ.pop("SLIME_VERIFY_EXACTNESS_ON", None)


def test_on_one_gpu_in_bf16_the_loop_is_exact_and_repeats(tiny_model_dir, tiny_task_data, tmp_path):
    flags = ("--true-on-policy", "--deterministic-mode", "--colocate", "--embedded-engine-dtype", "bfloat16",
             "--fsdp-mixed-precision", "bf16")
    first = run(exact_args(tiny_model_dir, tiny_task_data, tmp_path / "a", *flags))
    diff, ppo_kl = values(first, "train/train_rollout_logprob_abs_diff"), values(first, "train/ppo_kl")
    assert diff == [0.0, 0.0] and ppo_kl == [0.0, 0.0], (diff, ppo_kl)
    second = run(exact_args(tiny_model_dir, tiny_task_data, tmp_path / "b", *flags))
    differ = [k for r, q in zip(without_timings(first), without_timings(second))
              for k in sorted(set(r) | set(q)) if r.get(k) != q.get(k)]
    assert len(first) == len(second) and not differ, differ
    a, b = saved_state(Path(tmp_path) / "a", tmp_path), saved_state(Path(tmp_path) / "b", tmp_path)
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
