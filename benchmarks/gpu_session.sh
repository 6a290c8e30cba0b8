#!/usr/bin/env bash
# One device call that runs every GPU check and benchmark still owed (issues #3, #5, #6); results land in $OUT.
# Usage on the device machine: bash benchmarks/gpu_session.sh   (needs FLASHDRAFT_GIT_COMMIT set by the caller)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/flashdraft-gpu}
mkdir -p "$out"
python3 -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -3
python3 -c "
from flashdraft.config import load_config
from flashdraft.run.doctor import print_checks, run_checks
print_checks(run_checks(load_config(None, ['model.target=/nonexistent', 'data.train=[/nonexistent]'])))
" 2>&1 | tee "$out/doctor.log" | grep -E "GPUs|flex_attention"
python3 -m flashdraft bench eval --out "$out/eval_h200.json" 2>&1 | tail -2
python3 -m flashdraft bench train --out "$out/train_h200.json" 2>&1 | grep -v -i warn | tail -5
