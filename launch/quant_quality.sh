#!/usr/bin/env bash
# The shipped model quantized: held-out loss (standard-library and package splits) and
# HumanEval acceptance of `chain` K=3 for each weight / KV mode, one JSON pair per mode.
#   bash launch/quant_quality.sh OUT STDLIB_DIR HUMANEVAL.jsonl.gz [MODES...]
# MODES are WEIGHTS:KV pairs (default: none: int8: fp8: fp8-block: none:fp8 int8:fp8).
set -euo pipefail
out=$1; stdlib=$2; humaneval=$3; shift 3
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(none: int8: fp8: fp8-block: none:fp8 int8:fp8)
mkdir -p "$out"
for mode in "${modes[@]}"; do
  w=${mode%%:*}; kv=${mode#*:}
  args=()
  [ "$w" != none ] && args+=(--quantize "$w")
  [ -n "$kv" ] && args+=(--kv-dtype "$kv")
  name="w-${w}_kv-${kv:-model}"
  python -m mtp_train heldout --model checkpoints --stdlib "$stdlib" --site-packages auto \
    --humaneval "$humaneval" "${args[@]}" --out "$out/heldout_$name.json" > "$out/heldout_$name.log" 2>&1
  python -m mtp_jax.evaluate --dataset "$humaneval" --max-batch 32 --max-tokens 128 \
    --methods chain --num-speculative-tokens 3 "${args[@]}" \
    --output "$out/humaneval_$name.json" > "$out/humaneval_$name.log" 2>&1
  echo "$name done"
done
