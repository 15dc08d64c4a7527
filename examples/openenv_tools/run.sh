#!/usr/bin/env bash
# The OpenEnv example end to end on CPU: a thermometer environment served by openenv-core's own server
# (127.0.0.1, one WebSocket session per episode), a tiny Qwen3 model, an SFT warm start on a demonstrator
# that looks only some of the time, then GRPO in which every rollout slot is an episode played by
# slime.agent.openenv.generate through the OpenAI adapter (Ray, the smg router, the embedded engine, FSDP2),
# scored by the env's verifier; greedy evaluation on 64 held-out tasks.
#   bash examples/openenv_tools/run.sh        (outputs under outputs/openenv-tools; OUT=dir to change)
#   SFT_STEPS=.. GRPO_STEPS=.. GRPO_LR=.. TRANSPORT=http ..; SKIP_SFT=1 reruns GRPO from an earlier SFT in OUT.
#   MODEL=smollm2: SmolLM2-135M-Instruct instead of the tiny model (the tiny model's ChatML template with the
#   one-line tool list, SFT and GRPO at lr 1e-5); SFT_STEPS / GRPO_STEPS / GRPO_PROMPTS to size it.
#   PYTHON=/path/to/python runs in an environment you installed yourself (no setup step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [ -n "${PYTHON:-}" ]; then  # an environment you installed yourself: no setup step
  py="$PYTHON"
else
  bash scripts/setup-env.sh dev  # openenv-core is in the dev extra (and in the openenv one)
  py=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source examples/model.sh
out="${OUT:-outputs/openenv-tools$(smollm2_or -smollm2 '')}"
common=(--train-backend fsdp --actor-num-gpus-per-node 1 --seed 1 --lr-decay-style constant --weight-decay 0.0
        --adam-beta2 0.99)

if [ "${SKIP_SFT:-0}" != 1 ]; then rm -rf "$out"; fi
mkdir -p "$out"
rm -f "$out/env.port"
echo "== 1/5 the thermometer env server (openenv-core, 127.0.0.1)"
$py -m examples.openenv_tools.env --port-file "$out/env.port" > "$out/env.log" 2>&1 &
env_pid=$!
trap 'kill "$env_pid" 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -f "$out/env.port" ] && break; kill -0 "$env_pid" || { cat "$out/env.log"; exit 1; }; sleep 0.1; done
env_url="http://127.0.0.1:$(cat "$out/env.port")"
$py -m examples.openenv_tools.data --out "$out/data" --env-url "$env_url" --transport "${TRANSPORT:-ws}"

if [ "${SKIP_SFT:-0}" != 1 ]; then
echo "== 2/5 the model (MODEL=${MODEL:-tiny}; one-line tool list in its template)"
example_model "$out/model"
$py -m examples.tool_use.template "$out/model" $(smollm2_or --chatml '')

echo "== 3/5 SFT warm start: look-ups (<tool_call> format) and unlooked answers, mixed"
$py train.py "${common[@]}" --debug-train-only --hf-checkpoint "$out/model" \
  --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
  --prompt-data "$out/data/tool_use/sft.jsonl" --input-key messages --tool-key tools --rollout-shuffle \
  --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns \
  --rollout-batch-size 16 --num-rollout "${SFT_STEPS:-400}" --lr "$(smollm2_or 1e-5 3e-3)" \
  --save "$out/sft_ckpt" --save-interval 1000 --save-hf "$out/sft_hf" --run-dir "$out/runs/sft"
fi
rm -rf "$out/runs/grpo" "$out/dumps"

echo "== 4/5 GRPO: each slot is an episode on the env, played through the OpenAI adapter"
$py train.py "${common[@]}" --rollout-backend embedded --rollout-num-gpus 1 "${colocate[@]}" --hf-checkpoint "$out/sft_hf" \
  --prompt-data "$out/data/train.jsonl" --input-key messages --metadata-key metadata --rollout-shuffle \
  --custom-generate-function-path slime.agent.openenv.generate \
  --dynamic-sampling-filter-path slime.agent.openenv.keep_scored_groups \
  --sglang-tool-call-parser qwen25 --router-policy consistent_hashing \
  --rollout-batch-size "${GRPO_PROMPTS:-8}" --n-samples-per-prompt 8 --rollout-max-response-len 32 \
  --rollout-max-context-len 512 --rollout-temperature 1.0 --num-rollout "${GRPO_STEPS:-20}" \
  --num-steps-per-rollout 1 --lr "${GRPO_LR:-$(smollm2_or 1e-5 3e-4)}" --eps-clip 0.2 \
  --eval-prompt-data heldout "$out/data/eval.jsonl" --eval-interval "${EVAL_INTERVAL:-5}" --eval-temperature 0.01 \
  --n-samples-per-eval-prompt 1 --save-debug-rollout-data "$out/dumps/rollout_{rollout_id}.pt" \
  --run-dir "$out/runs/grpo"

echo "== 5/5 summary"
$py -m slime.utils.run_summary --sft-run "$out/runs/sft" --grpo-run "$out/runs/grpo" --eval-name heldout
$py -m examples.openenv_tools.summary --out "$out" --json "$out/summary.json"
