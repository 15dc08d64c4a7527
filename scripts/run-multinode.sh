#!/usr/bin/env bash
# Multi-node training on a Ray cluster: Ray is started on every machine with `ray start`, then
# train.py is submitted from the head as a Ray job (`ray job submit`); slime places the training
# ranks over --actor-num-nodes nodes (--actor-num-gpus-per-node each) and the engines wherever their
# GPUs are free, and pushes weights from the trainer to every engine across the nodes.
#
#   on the head machine:     bash scripts/run-multinode.sh head
#   on every other machine:  HEAD_IP=10.0.0.1 bash scripts/run-multinode.sh worker
#   then, on the head:       bash scripts/run-multinode.sh submit --actor-num-nodes 2 --actor-num-gpus-per-node 8 \
#                              --rollout-num-gpus 8 --hf-checkpoint /shared/model --prompt-data /shared/train.jsonl \
#                              --save /shared/ckpt --load /shared/ckpt ...   (train.py's flags, docs/usage.md)
#   to stop, on every machine: bash scripts/run-multinode.sh stop
#
# Needs: this repository and its .venv at the same path on every machine (`bash scripts/setup-env.sh cluster`: slime and ray[default], whose job server the head runs
# there); --hf-checkpoint, the prompt files and --save / --load on a filesystem every machine sees (each
# training rank writes its checkpoint shard; engines read the model on their own machine). Settings
# (environment): NODE_IP (this machine's address, default: the first of `hostname -I`), HEAD_IP,
# RAY_PORT (6379), DASHBOARD_PORT (8265), NUM_GPUS (default: what Ray detects), SUBMISSION_ID.
# Ray's token authentication: give every machine the same RAY_AUTH_TOKEN (`ray get-auth-token --generate`
# on the head), or set RAY_AUTH_MODE=disabled on a trusted network.
# To resume after a machine failed: start Ray on the replacement machine (`worker`) and submit the same
# command again; the run continues from the last checkpoint under --load.
# One machine, no GPU: scripts/run-multinode-cpu.sh runs this with a head and a worker node on loopback.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
ray_bin="$root/.venv/bin/ray"
role="${1:?usage: run-multinode.sh head|worker|submit|stop [train.py flags]}"
shift || true
node_ip="${NODE_IP:-$(hostname -I | awk '{print $1}')}"
ray_port="${RAY_PORT:-6379}"
dashboard_port="${DASHBOARD_PORT:-8265}"
gpus=(); [ -n "${NUM_GPUS:-}" ] && gpus=(--num-gpus "$NUM_GPUS")
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 TOKENIZERS_PARALLELISM=false

case "$role" in
  head)
    "$ray_bin" start --head --node-ip-address "$node_ip" --port "$ray_port" --include-dashboard true \
      --dashboard-host 127.0.0.1 --dashboard-port "$dashboard_port" "${gpus[@]}" --disable-usage-stats ;;
  worker)
    "$ray_bin" start --address "${HEAD_IP:?set HEAD_IP to the address of the head machine}:$ray_port" \
      --node-ip-address "$node_ip" "${gpus[@]}" --disable-usage-stats ;;
  submit)
    "$ray_bin" status --address "127.0.0.1:$ray_port" | sed -n '/Resources/,$p'
    "$ray_bin" job submit --address "http://127.0.0.1:$dashboard_port" --entrypoint-num-cpus 0 \
      ${SUBMISSION_ID:+--submission-id "$SUBMISSION_ID"} \
      --runtime-env-json "{\"env_vars\": {\"PYTHONPATH\": \"$root\"}}" \
      -- bash -c "cd '$root' && exec .venv/bin/python train.py $(printf '%q ' "$@")" ;;
  stop)
    "$ray_bin" stop ;;
  *)
    echo "unknown role '$role': head, worker, submit or stop" >&2; exit 2 ;;
esac
