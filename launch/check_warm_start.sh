#!/usr/bin/env bash
# Warm starts on this machine's own devices (two GPUs, say): the README job twice, then an
# unsharded run, a mesh run and both again, all from one fresh cache folder; every run's
# tokens must equal the first's and every warm run must load what its cold run saved.
# The same checks on fake CPU devices are tests/test_warm_start_devices.py.
#
#   bash launch/check_warm_start.sh [--mesh dp=2] [--cache DIR] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
mesh="dp=2" cache="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mesh) mesh="$2"; shift 2 ;;
    --cache) cache="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
cache=${cache:-$(mktemp -d)/cache}
out=${out:-$(mktemp -d)}
mkdir -p "$out"
prompts=launch/data/example_prompts.jsonl
run() {  # NAME ARGS...: one generate run, its summary kept in $out/NAME.log
  local name=$1; shift
  python -m mtp_jax.generate --input "$prompts" --output "$out/$name.jsonl" \
    --compile-cache "$cache" "$@" 2> "$out/$name.log"
  echo "$name: $(grep -E 'executables [0-9]+ loaded' "$out/$name.log" | tail -n 1)"
  if grep -q "could not run here" "$out/$name.log"; then grep "could not run here" "$out/$name.log"; fi
}
python -c "import jax; print('devices:', jax.devices())"
run readme_1
run readme_2
run mesh_1 --mesh "$mesh"
run readme_3
run mesh_2 --mesh "$mesh"
python - "$out" readme_1 readme_2 mesh_1 readme_3 mesh_2 <<'EOF'
import json, re, sys
out, names = sys.argv[1], sys.argv[2:]
tokens = {n: {json.loads(l)["id"]: json.loads(l)["token_ids"]
              for l in open(f"{out}/{n}.jsonl")} for n in names}
counts = {}
for n in names:
    m = re.findall(r"executables (\d+) loaded / (\d+) saved", open(f"{out}/{n}.log").read())
    counts[n] = tuple(map(int, m[-1]))
same = all(tokens[n] == tokens[names[0]] for n in names)
warm = (counts["readme_2"] == (counts["readme_1"][1], 0) and counts["readme_3"] ==
        (counts["readme_1"][1], 0) and counts["mesh_2"] == (counts["mesh_1"][1], 0))
print("tokens equal across runs:", same, "| warm runs loaded all:", warm, counts)
sys.exit(0 if same and warm else 1)
EOF
