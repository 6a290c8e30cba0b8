#!/usr/bin/env bash
# The GPU checks and benchmarks, in parts that each fit one device call (10 min); results land in $OUT.
# Usage on the device machine: FLASHDRAFT_GIT_COMMIT=$(git rev-parse --short HEAD) (run here; the device copy has no .git) bash benchmarks/gpu_session.sh tests|eval|probe|train
#   tests: the `gpu`-marked tests and the doctor's GPU checks (~4 min)
#   eval:  flashdraft bench eval, 8B-shaped target (~7 min)
#   train: flashdraft bench train, shapes (a) and (b) (~6 min)
#   hybrid: flashdraft bench train on the seeds' Qwen3.6-27B-shaped hybrid target, shape (a), with the
#          flash-linear-attention kernels (wheels carried in .whl) and without (~7 min)
#   hybrid-eval: flashdraft bench eval on an 8-layer cut of the Qwen3.6-27B hybrid (fla carried), lossless check
#   probe: SDPA per-shape setup cost and generate() step times (~1.5 min; benchmarks/sdpa_decode_probe.py)
# The device image lacks nvidia-ml-py: `pip install --target .gpu/pydeps nvidia-ml-py` here, carry [".gpu"].
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/.gpu/pydeps PYTHONUNBUFFERED=1
out=${OUT:-/tmp/flashdraft-gpu}
mkdir -p "$out"
case "${1:-tests}" in
  tests)
    python3 -m pytest -m gpu tests -q -p no:cacheprovider --durations=5 2>&1 | tee "$out/gpu_tests.log" | tail -8
    python3 -c "
from flashdraft.config import load_config
from flashdraft.run.doctor import print_checks, run_checks
from flashdraft.run.monitor import gpu_usage
print_checks(run_checks(load_config(None, ['model.target=/nonexistent', 'data.train=[/nonexistent]'])))
print('NVML:', gpu_usage())
" 2>&1 | tee "$out/doctor.log" | grep -E "GPUs|flex_attention|NVML" ;;
  eval)
    python3 -m flashdraft bench eval --out "$out/eval_h200.json" > "$out/bench_eval.log" 2>&1
    cp /tmp/flashdraft-bench-eval/eval.png "$out/" 2>/dev/null
    grep -v -i warn "$out/bench_eval.log" | tail -25 ;;
  probe)
    python3 benchmarks/sdpa_decode_probe.py --out "$out/sdpa_decode_probe_h200.json" 2>&1 | grep -v -i warn | tail -40 ;;
  hybrid-eval)
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/fla python3 -m flashdraft bench eval --target qwen3.6-27b --target-layers 8 \
      --samples 256 --steps 120 --prompts 4 --max-new-tokens 96 --out "$out/eval_h200_27b_hybrid.json" \
      > "$out/bench_eval_hybrid.log" 2>&1
    grep -v -i warn "$out/bench_eval_hybrid.log" | tail -25 ;;
  hybrid)
    python3 -m flashdraft bench train --target qwen3.6-27b --shape a --out "$out/train_h200_27b_torch_fallback.json" 2>&1 \
      | grep -v -i warn | tail -3
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/fla python3 -m flashdraft bench train --target qwen3.6-27b --shape a \
      --out "$out/train_h200_27b_fla.json" 2>&1 | grep -v -i warn | tail -3 ;;
  train)
    python3 -m flashdraft bench train --out "$out/train_h200.json" 2>&1 | grep -v -i warn | tail -5 ;;
esac
