#!/usr/bin/env bash
# The Python-tool example end to end on CPU (ReTool style): a tiny Qwen3 model, questions about a list x
# that only the sandbox holds (so only running code answers them), an SFT warm start on a demonstrator that
# runs the question's snippet only some of the time (and otherwise guesses), then GRPO where every rollout slot is
# an agent episode through slime's OpenAI adapter whose python calls run in the sandbox (a child process
# with CPU, memory, wall-time and file limits, no network, no new processes). Greedy eval on 64 held-out problems.
#   bash examples/python_tool/run.sh        (outputs under outputs/python-tool; OUT=dir to change)
#   SFT_STEPS=.. SFT_TOOL_FRACTION=.. GRPO_STEPS=.. GRPO_LR=.. to change the two phases
#   MODEL=smollm2: SmolLM2-135M-Instruct instead of the tiny model (the tiny model's ChatML template with the
#   one-line tool list, SFT and GRPO at lr 1e-5); SFT_STEPS / GRPO_STEPS / GRPO_PROMPTS to size it.
#   PYTHON=/path/to/python runs in an environment you installed yourself (no setup step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [ -n "${PYTHON:-}" ]; then  # an environment you installed yourself: no setup step
  py="$PYTHON"
else
  bash scripts/setup-env.sh dev  # the agent uses the openai client (dev extra)
  py=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source examples/model.sh
out="${OUT:-outputs/python-tool$(smollm2_or -smollm2 '')}"
common=(--train-backend fsdp --actor-num-gpus-per-node 1 --seed 1 --lr-decay-style constant --weight-decay 0.0
        --adam-beta2 0.99)
rm -rf "$out" && mkdir -p "$out"

echo "== 1/4 the model (MODEL=${MODEL:-tiny}; one-line tool list in its template) and the list task"
example_model "$out/model"
$py -m examples.tool_use.template "$out/model" $(smollm2_or --chatml '')
$py -m examples.python_tool.task --out "$out/data" --seed 0 --num-train 256 --num-eval 64 --num-sft 4096 \
  --sft-tool-fraction "${SFT_TOOL_FRACTION:-0.3}"

echo "== 2/4 SFT warm start: code calls (<tool_call> format) and guesses, mixed"
$py train.py "${common[@]}" --debug-train-only --hf-checkpoint "$out/model" \
  --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
  --prompt-data "$out/data/sft.jsonl" --input-key messages --tool-key tools --rollout-shuffle \
  --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns \
  --rollout-batch-size 16 --num-rollout "${SFT_STEPS:-400}" --lr "$(smollm2_or 1e-5 3e-3)" \
  --save "$out/sft_ckpt" --save-interval 1000 --save-hf "$out/sft_hf" --run-dir "$out/runs/sft"

echo "== 3/4 GRPO: each slot is an agent episode, its code run in the sandbox"
$py train.py "${common[@]}" --rollout-backend embedded --rollout-num-gpus 1 "${colocate[@]}" --hf-checkpoint "$out/sft_hf" \
  --prompt-data "$out/data/train.jsonl" --input-key messages --label-key label --tool-key tools --rollout-shuffle \
  --custom-generate-function-path examples.python_tool.generate.generate \
  --custom-rm-path examples.tool_use.reward.reward \
  --sglang-tool-call-parser qwen25 --router-policy consistent_hashing \
  --rollout-batch-size "${GRPO_PROMPTS:-8}" --n-samples-per-prompt 8 --rollout-max-response-len 48 \
  --rollout-max-context-len 512 --rollout-temperature 1.0 --num-rollout "${GRPO_STEPS:-20}" \
  --num-steps-per-rollout 1 --lr "${GRPO_LR:-$(smollm2_or 1e-5 3e-4)}" --eps-clip 0.2 \
  --eval-prompt-data heldout "$out/data/eval.jsonl" --eval-interval 5 --eval-temperature 0.01 \
  --n-samples-per-eval-prompt 1 --save-debug-rollout-data "$out/dumps/rollout_{rollout_id}.pt" \
  --run-dir "$out/runs/grpo"

echo "== 4/4 summary"
$py -m slime.utils.run_summary --sft-run "$out/runs/sft" --grpo-run "$out/runs/grpo" --eval-name heldout
$py -m examples.tool_use.summary --out "$out" --json "$out/summary.json"
