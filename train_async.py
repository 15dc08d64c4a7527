"""One-step-off-policy training: generation of step k+1 overlaps training on step k.

Weights are pushed every ``--update-weights-interval`` steps, after the in-flight generation has
finished (so no sample mixes two policies). ``--colocate`` is rejected: generation and training
cannot overlap on the same devices.
"""

import time

import ray

from slime.ray.job import Job
from slime.preflight import UserError, main


def train_async(args) -> None:
    if args.colocate:
        raise UserError("train_async.py overlaps generation and training, which --colocate cannot do; use train.py")
    args.rollout_overlaps_training = True  # engines and trainers run at once (CPU engines size their threads by it)
    with Job(args) as job:
        rollout_ids = range(args.start_rollout_id, args.num_rollout)
        if job.eval_before_train(args.start_rollout_id):
            job.evaluate(args.start_rollout_id)
        in_flight = job.rollout_manager.generate.remote(args.start_rollout_id) if len(rollout_ids) else None
        for rollout_id in rollout_ids:
            step_start = time.perf_counter()
            data_refs, rollout_metrics = ray.get(in_flight)
            wait_time = time.perf_counter() - step_start  # trainers idle, waiting for generation
            job.tracker.log(rollout_metrics, rollout_id, "rollout")
            # launch generation of step k+1 (with the current weights) before training on step k
            in_flight = job.rollout_manager.generate.remote(rollout_id + 1) if rollout_id + 1 < args.num_rollout else None
            train_metrics = job.train(rollout_id, data_refs)
            if job.should_save(rollout_id):
                job.save(rollout_id)
            if (rollout_id + 1) % args.update_weights_interval == 0:
                if in_flight is not None:
                    ray.wait([in_flight], num_returns=1, timeout=None)  # never swap weights mid-generation
                train_metrics.update(job.update_weights())
            if job.should_eval(rollout_id):
                job.evaluate(rollout_id + 1)
            job.log_step(rollout_id, rollout_metrics, train_metrics, time.perf_counter() - step_start, wait_time)


if __name__ == "__main__":
    main(train_async)
