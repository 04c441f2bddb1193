#!/usr/bin/env bash
# Two GPUs of one host: the generate CLI on the shipped model with no mesh, --mesh tp=2
# and --mesh dp=2 (token ids against the unsharded run; wall times of a cold run, which
# compiles, and of a warm one, which loads what it saved); launch/multihost.py with two
# processes of one GPU each over --mesh dp=2 (tokens against an unsharded run, made first
# where the generate part does not run, and any distributed-runtime error in their logs);
# launch/bench_decode.py's steps at the MiMo-7B shape with and without --mesh tp=2.
#
#   bash launch/multi_gpu_check.sh [generate] [multihost] [bench]    (default: all three)
#
# Each part takes minutes: where a command's time is limited, run them one at a time.
# Every run is under `timeout` (GEN_TIMEOUT, MULTIHOST_TIMEOUT, BENCH_TIMEOUT seconds).
# What the script prints also goes to $OUT/summary_PARTS.txt ($OUT: ./out unless set),
# and every log, output file and benchmark table into $OUT/logs_PARTS.tar.gz (PARTS: the
# parts run, joined by _). NVLink multicast stays off (NCCL, PyTorch, NVSHMEM). PYTHON
# picks the interpreter (python3); BENCH_ARGS is added to both benchmark runs (`--tiny`
# for a CPU smoke run).
set -uo pipefail  # no -e: a failed run is reported and the other parts still run
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(generate multihost bench)
for p in "${parts[@]}"; do
  case "$p" in generate|multihost|bench) ;; *) echo "unknown part: $p" >&2; exit 2 ;; esac
done
tag=$(IFS=_; echo "${parts[*]}")
OUT=$(mkdir -p "${OUT:-./out}" && cd "${OUT:-./out}" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
work=$(mktemp -d)
prompts=launch/data/example_prompts.jsonl
cache="$work/compile_cache"
summary="$OUT/summary_$tag.txt"
: > "$summary"
failed=()

say() { echo "$*" | tee -a "$summary"; }
since() { awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }
summary_of() {  # LOG: a generate run's compile and run seconds, executables loaded / saved
  echo "$(grep -E '^compile [0-9.]+ s' "$1" | tail -n 1)" \
    "$(grep -oE 'executables [0-9]+ loaded / [0-9]+ saved' "$1" | tail -n 1)"
}

gen() {  # NAME ARGS...: one generate run into $work/NAME.jsonl, its log NAME.log
  local name=$1 t0 rc
  shift
  t0=$(date +%s.%N)
  timeout "${GEN_TIMEOUT:-300}" "$py" -m mtp_jax.generate --input "$prompts" \
    --output "$work/$name.jsonl" --compile-cache "$cache" "$@" 2> "$work/$name.log"
  rc=$?
  say "$name: exit $rc, wall $(since "$t0") s | $(summary_of "$work/$name.log")"
  [ $rc -eq 0 ] || failed+=("$name")
  return $rc
}

same_tokens() {  # NAME: NAME.jsonl's token ids against the unsharded run's
  local line
  line=$("$py" - "$work/none_cold.jsonl" "$work/$1.jsonl" <<'EOF'
import json, sys
want, got = ({json.loads(x)["id"]: json.loads(x).get("token_ids") for x in open(p)}
             for p in sys.argv[1:])
differ = [k for k in want if got.get(k) != want[k]]
print(f"{len(want) - len(differ)}/{len(want)} records with the unsharded run's tokens"
      + (f"; differ: {differ}" if differ else ""))
sys.exit(1 if differ else 0)
EOF
  )
  local rc=$?
  say "  $1: $line"
  [ $rc -eq 0 ] || failed+=("$1 tokens")
}

reference() {  # the unsharded runs (cold, then warm), once
  [ -s "$work/none_cold.jsonl" ] && return 0
  gen none_cold && gen none_warm
}

part_generate() {
  say "== generate on the shipped model: no mesh, tp=2, dp=2"
  reference || return
  for mesh in tp=2 dp=2; do
    local name=${mesh/=/}
    gen "${name}_cold" --mesh "$mesh" && same_tokens "${name}_cold"
    gen "${name}_warm" --mesh "$mesh" && same_tokens "${name}_warm"
  done
}

part_multihost() {
  say "== launch/multihost.py: two processes, one GPU each, --mesh dp=2"
  reference || return
  local port t0 i rc=0 pids=()
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  t0=$(date +%s.%N)
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i timeout "${MULTIHOST_TIMEOUT:-400}" "$py" launch/multihost.py \
      --coordinator "127.0.0.1:$port" --num-processes 2 --process-id "$i" --mesh dp=2 -- \
      generate --input "$prompts" --output "$work/multihost.jsonl" --compile-cache off \
      > "$work/multihost_p$i.out" 2> "$work/multihost_p$i.log" &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}" || rc=$?
  done
  say "multihost: exit $rc, wall $(since "$t0") s | $(summary_of "$work/multihost_p0.log")"
  if [ $rc -ne 0 ]; then failed+=(multihost); else same_tokens multihost; fi
  # Errors: glog E / F lines and aborts. jax 0.11's client also logs W lines
  # ("WatchTasksAsync failed ... CANCELLED / UNAVAILABLE") while it tears down after the
  # coordination service has stopped: counted and shown, not failed on.
  local errors warnings
  errors=$(grep -hE '^[EF][0-9]{4} |Terminating process|Check failed|Fatal' \
    "$work"/multihost_p*.log | head -n 5)
  warnings=$(grep -hE '^W[0-9]{4} .*(grpc|UNAVAILABLE|CANCELLED|WatchTasks)' \
    "$work"/multihost_p*.log | wc -l)
  if [ -n "$errors" ]; then
    say "  distributed-runtime errors in the logs (first lines):"
    say "$errors"
    failed+=("multihost logs")
  else
    say "  no distributed-runtime error in either process's log"
  fi
  [ "${warnings:-0}" -eq 0 ] || say "  $warnings teardown warnings of the distributed client (W lines, after the run)"
}

part_bench() {
  say "== bench_decode: MiMo-7B shape, steps only, B 1 and 8 at 4096, one GPU and tp=2"
  local mesh name t0 rc
  for mesh in "" tp=2; do
    name=bench_${mesh:-one_gpu}
    name=${name/=/}
    mkdir -p "$work/$name"
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086  # BENCH_ARGS: words of their own
    OUT="$work/$name" timeout "${BENCH_TIMEOUT:-500}" "$py" launch/bench_decode.py \
      --batches 1,8 --ctxs 4096 --steps-only ${mesh:+--mesh "$mesh"} ${BENCH_ARGS:-} \
      > "$work/$name.log" 2>&1
    rc=$?
    say "$name: exit $rc, wall $(since "$t0") s"
    if [ $rc -eq 0 ] && [ -s "$work/$name/bench_decode.md" ]; then
      tee -a "$summary" < "$work/$name/bench_decode.md"
    else
      failed+=("$name")
      tail -n 5 "$work/$name.log" | tee -a "$summary"
    fi
  done
}

say "devices: $("$py" -c 'import jax; print(jax.device_count(), jax.devices()[0].device_kind)' 2>&1 | tail -n 1)"
for p in "${parts[@]}"; do
  "part_$p"
done
tar -czf "$OUT/logs_$tag.tar.gz" -C "$work" --exclude=compile_cache .
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]}"
  exit 1
fi
say "all parts passed"
