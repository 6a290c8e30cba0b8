#!/usr/bin/env bash
# `flashdraft bench regen` on the GPU machine: a 135M-shaped random target and 2,000 prompts made there,
# then prepare --regenerate with each engine against plain batched generate (docs/regeneration.md).
# Usage on the device machine: bash benchmarks/regen_gpu.sh [max_new_tokens] [engines...]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/flashdraft-gpu}
mkdir -p "$out"
new=${1:-256}; shift || true
engines=${*:-hf-cb hf}
python3 -m flashdraft bench regen --make-inputs /tmp/regen-inputs --num-prompts 2000 2>&1 | grep -v -i warn | tail -2
baseline=""
for engine in $engines; do
  python3 -m flashdraft bench regen --target /tmp/regen-inputs/target --prompts /tmp/regen-inputs/prompts.jsonl \
    --max-new-tokens "$new" --baseline-batch 500 --engine "$engine" $baseline --out "$out/regen_${engine}.json" \
    > "$out/regen_${engine}.log" 2>&1
  echo "== $engine"; grep -E '"(seconds|tokens_per_s|speedup|engine)"' "$out/regen_${engine}.log"; tail -3 "$out/regen_${engine}.log" | grep -i error
  baseline="--skip-baseline"
done
