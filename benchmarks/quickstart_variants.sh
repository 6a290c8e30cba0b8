#!/bin/bash
# `flashdraft quickstart --real` once per variant NAME:ARG,ARG (key=value overrides or flags such as `--steps,2000`;
# a bare `NAME:` runs the defaults), on one GPU, for issue 33's quickstart goal. The first variant makes the data (conversion, regenerated answers) in
# $ROOT/qs-NAME; the others start on a copy of it as soon as its held-out shards exist, so every drafter trains on
# the same answers. Steps, not minutes, bound each run: sharing the GPU changes their times, not their drafters
# (the first run's whole-command time and speedup are then not a lone run's; each best drafter is decoded again
# alone at the end, below). Writes $ROOT/qs-NAME.log for each and $ROOT/qs-variants.done at the end. Usage
# (after gpu_session.sh real-setup, with /tmp/site on PYTHONPATH):
#   bash benchmarks/quickstart_variants.sh muon:train.optimizer=muon,train.muon_lr=0.006 adamw:
root=${ROOT:-/tmp}
rm -f "$root/qs-variants.done"
run() {  # NAME OVERRIDES
  local name=$1 seconds=$SECONDS
  python3 -m flashdraft quickstart --real --out "$root/qs-$name" $(echo "$2" | tr ',' ' ') > "$root/qs-$name.log" 2>&1
  echo "rc $? in $((SECONDS - seconds)) s" >> "$root/qs-$name.log"
}
first=${1%%:*}
run "$first" "${1#*:}" &
pids=$!
until [ -f "$root/qs-$first/eval-shards/manifest.json" ]; do
  kill -0 "$pids" 2>/dev/null || { echo "the first variant ended before its data was made"; exit 1; }
  sleep 5
done
for variant in "${@:2}"; do
  name=${variant%%:*}
  mkdir -p "$root/qs-$name"
  cp -al "$root/qs-$first"/{target,shards,eval-shards} "$root/qs-$name/"
  cp "$root/qs-$first"/{conversations,selection,heldout}.jsonl "$root/qs-$name/"
  run "$name" "${variant#*:}" &
  pids="$pids $!"
done
wait $pids
# Each variant's own decode ran while the others trained or decoded: its τ and lossless check hold, its
# speedup does not. With ALONE=1 (default) each best drafter is decoded again, one after another, alone on
# the GPU (the same prompts, tokens and check as the quickstart's step 4) into qs-NAME/eval-alone.json.
if [ "${ALONE:-1}" = 1 ]; then
  for variant in "$@"; do
    name=${variant%%:*}
    [ -d "$root/qs-$name/run/best" ] || continue
    python3 -m flashdraft eval --target "$root/qs-$name/target" --drafter "$root/qs-$name/run/best" \
      --prompts "$root/qs-$name/heldout.jsonl" --max-new-tokens 256 --check-lossless \
      --out "$root/qs-$name/eval-alone.json" --force > "$root/qs-$name-alone.log" 2>&1
    echo "$name decoded alone: rc $?" >> "$root/qs-$name.log"
  done
fi
touch "$root/qs-variants.done"
