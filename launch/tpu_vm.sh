#!/usr/bin/env bash
# Runs mtp_jax on a Cloud TPU VM: creates the VM, installs the project with jax[tpu] on
# every worker, runs batch generation (launch/data/example_prompts.jsonl) and the
# evaluation (HumanEval: acceptance per depth, tokens/s vs plain decoding, lossless
# check), copies the results back and, with --delete, deletes the VM. With --hub-model, a
# published MTP checkpoint is also run by hub id (int8 weights) on chat messages
# (launch/data/chat_prompts.jsonl), plain decoding against speculative, and the speed-up
# is printed.
#
#   bash launch/tpu_vm.sh [--dry-run] [--name NAME] [--zone ZONE] [--project PROJECT]
#       [--accelerator-type v5litepod-8] [--version tpu-ubuntu2204-base] [--repo URL]
#       [--model PATH] [--mesh tp=N,dp=M] [--limit N] [--results DIR] [--delete]
#       [--hub-model ORG/NAME[@REVISION]]
#
#   --dry-run   print every command, one per line, exactly as it would run; run nothing
#               (gcloud need not be installed)
#   --repo      git address the VM clones (default: this checkout's `origin` remote)
#   --model     model folder on the VM, relative to the clone (default: the shipped model)
#   --mesh      mesh for generate, e.g. tp=4 (default: one chip)
#   --limit     evaluate only the first N HumanEval prompts (default: all 164)
#   --results   local folder for the results (default: tpu_results/NAME)
#   --hub-model a Hugging Face Hub id, e.g. XiaomiMiMo/MiMo-7B-RL: downloaded on the VM,
#               run with --method none and with chain (results/hub_{none,chain}.*)
#
# A slice of more than one host (the accelerator type's suffix above 8: v4-16,
# v5litepod-16, ...) runs generate and evaluate through launch/multihost.py on every
# worker, where jax.distributed.initialize() detects the pod; only worker 0 writes the
# results. Give --mesh spanning all chips there for generate (evaluate runs without one:
# each worker evaluates on its first chip).
# The VM's Ubuntu 22.04 ships Python 3.10 and jax needs 3.11+, so the install puts
# python3.11 in a virtual environment (~/mtp_venv).
# Not run on TPU hardware by this project: see README.md, "Scale-out and launch".
set -euo pipefail

dry_run=0 delete=0
name=mtp-jax-demo zone=us-west4-a project="" accel=v5litepod-8 version=tpu-ubuntu2204-base
repo="" model="" mesh="" limit="" results="" hub_model=""

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { local code=$1; shift; echo "tpu_vm.sh: $*" >&2; exit "$code"; }  # die STATUS MSG

while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --delete) delete=1 ;;
    -h|--help) usage; exit 0 ;;
    --name|--zone|--project|--accelerator-type|--version|--repo|--model|--mesh|--limit|--results|\
    --hub-model)
      (($# >= 2)) && [[ -n "$2" && "$2" != --* ]] || die 2 "$1 needs a value (see --help)"
      case "$1" in
        --name) name=$2 ;; --zone) zone=$2 ;; --project) project=$2 ;;
        --accelerator-type) accel=$2 ;; --version) version=$2 ;; --repo) repo=$2 ;;
        --model) model=$2 ;; --mesh) mesh=$2 ;; --limit) limit=$2 ;; --results) results=$2 ;;
        --hub-model) hub_model=$2 ;;
      esac
      shift ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    *) die 2 "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

[[ "$name" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  die 2 "--name '$name': lower-case letters, digits and dashes, starting with a letter"
[[ "$accel" =~ ^[a-z0-9]+-([0-9]+)$ ]] ||
  die 2 "--accelerator-type '$accel': expected a type such as v5litepod-8 or v4-16"
chips=${BASH_REMATCH[1]}
[[ -z "$limit" || "$limit" =~ ^[1-9][0-9]*$ ]] || die 2 "--limit '$limit': a positive integer"
[[ -z "$mesh" || "$mesh" =~ ^(tp|dp)=[0-9]+(,(tp|dp)=[0-9]+)?$ ]] ||
  die 2 "--mesh '$mesh': expected tp=N,dp=M"
[[ -z "$hub_model" || "$hub_model" =~ ^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_./]+)?$ ]] ||
  die 2 "--hub-model '$hub_model': expected a hub id ORG/NAME or ORG/NAME@REVISION"
if [[ -z "$repo" ]] && command -v git >/dev/null; then
  repo=$(git -C "$(dirname "$0")" remote get-url origin 2>/dev/null || true)
fi
[[ -n "$repo" ]] || die 2 "--repo URL is required (this checkout has no 'origin' remote)"
results=${results:-tpu_results/$name}
if ((!dry_run)) && ! command -v gcloud >/dev/null; then
  die 1 "gcloud (the Google Cloud CLI) is not on PATH: install it and run 'gcloud auth login'" \
      "(or pass --dry-run to print the commands without running them)"
fi

# Shell-quote one word only where needed, so a printed line pastes back into a shell.
q() {
  if [[ "$1" =~ ^[-A-Za-z0-9_./:=@,+%]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
run() {
  local out="" w
  for w in "$@"; do out+="${out:+ }$(q "$w")"; done
  if ((dry_run)); then printf '%s\n' "$out"; else echo "+ $out" >&2; "$@"; fi
}

where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")
ssh_all() { run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all --command="$1"; }

venv='~/mtp_venv/bin'
model_arg=${model:+ --model $(q "$model")}
mesh_arg=${mesh:+ --mesh $mesh}
if ((chips > 8)); then  # more than one host: every worker joins jax.distributed
  gen="$venv/python launch/multihost.py$mesh_arg -- generate"
  evaluate="$venv/python launch/multihost.py -- evaluate"
else
  gen="$venv/python -m mtp_jax.generate$mesh_arg"
  evaluate="$venv/python -m mtp_jax.evaluate"
fi

run gcloud compute tpus tpu-vm create "$name" "${where[@]}" --accelerator-type="$accel" \
  --version="$version"
ssh_all "set -e; sudo apt-get update -qq; sudo DEBIAN_FRONTEND=noninteractive apt-get install \
-y -qq git python3.11 python3.11-venv; if [ -d mtp_jax ]; then git -C mtp_jax pull --ff-only; \
else git clone $(q "$repo") mtp_jax; fi; python3.11 -m venv ~/mtp_venv; \
$venv/pip install -q -U pip; cd mtp_jax && $venv/pip install -q -e \".[tpu,eval]\""
ssh_all "set -e; cd mtp_jax && mkdir -p results && $gen$model_arg \
--input launch/data/example_prompts.jsonl --output results/generate.jsonl"
ssh_all "set -e; cd mtp_jax && mkdir -p results && $evaluate$model_arg \
--dataset humaneval${limit:+ --limit $limit} --output results/evaluate.json \
--plot results/evaluate.png"
if [[ -n "$hub_model" ]]; then  # plain, then speculative; the summaries' tokens/s compared
  ssh_all "set -e; cd mtp_jax && mkdir -p results && for m in none chain; do $gen \
--model $(q "$hub_model") --quantize int8 --method \$m --input launch/data/chat_prompts.jsonl \
--output results/hub_\$m.jsonl 2> results/hub_\$m.log; done; awk -F' [|] ' \
'/tokens\/s/ { t[n++] = \$2 + 0 } END { printf \"plain %.1f, chain %.1f tokens/s: speed-up \
%.2fx\\n\", t[0], t[1], t[1] / t[0] }' results/hub_none.log results/hub_chain.log"
fi
run mkdir -p "$(dirname "$results")"
run gcloud compute tpus tpu-vm scp --recurse "$name:mtp_jax/results" "$results" "${where[@]}" \
  --worker=0
if ((delete)); then
  run gcloud compute tpus tpu-vm delete "$name" "${where[@]}" --quiet
fi
