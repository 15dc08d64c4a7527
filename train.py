"""Synchronous RL training: generate → train → (save, evaluate) → push weights, one step at a time.

    python train.py --hf-checkpoint MODEL --prompt-data train.jsonl --rollout-batch-size 8 ... (see docs/usage.md)
"""

import time

from slime.ray.job import Job
from slime.preflight import main


def train(args) -> None:
    with Job(args) as job:
        if args.num_rollout == 0 and args.eval_interval is not None:
            job.evaluate(0)  # eval-only mode
            return
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            step_start = time.perf_counter()
            if job.eval_before_train(rollout_id):
                job.evaluate(rollout_id)

            data_refs, rollout_metrics = job.generate(rollout_id)
            train_metrics = job.train(rollout_id, data_refs)

            if job.should_save(rollout_id):
                job.save(rollout_id)
            train_metrics.update(job.update_weights())
            if job.should_eval(rollout_id):
                job.evaluate(rollout_id + 1)

            step_time = time.perf_counter() - step_start
            wait_time = job.timings.get("rollout", 0.0)  # trainers idle while generating
            job.log_step(rollout_id, rollout_metrics, train_metrics, step_time, wait_time)


if __name__ == "__main__":
    main(train)  # a mistake in the command line, data or hooks: one message before anything starts
