#!/usr/bin/env bash
# The compiled paths' CPU tests under the GPU machine's torch (2.11, transformers 5.17), on this CPU machine,
# before a device call spends GPU time on them. CI and the README run torch 2.13, whose dynamo differs: at
# dec2d08 the FP8 layers' matmul, called through a layer attribute, compiled under 2.13 and failed under 2.11
# ("GetAttrVariable(AutogradFunctionVariable(), setup_context) has no type"), found only by the GPU suite.
# The same failure shows here on the CPU. Its venv is made once under VENV (default /tmp/flashdraft-torch211;
# ~5.4 GB: torch 2.11's only build is the CUDA one, whose libraries it loads but never uses on the CPU).
# transformers 5.17 is checked too: it builds GGUF tokenizers unlike 5.25 (docs/real-target.md, "The tokenizer
# of a GGUF file"); the whole CPU suite under these versions is the README's test command with this venv's python.
# Usage: bash benchmarks/torch211_cpu.sh [pytest arguments; default: the compiled paths' test files]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/flashdraft-torch211}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # numpy below 2.4: torch 2.11's Triton (3.6) interpreter takes int() of one-element arrays, which 2.4 refuses
  "$venv/bin/pip" install -q torch==2.11.0 "transformers==5.17.*" "numpy<2.4"
  "$venv/bin/pip" install -q -e ".[test,fp8]"  # torch>=2.6 keeps 2.11
  "$venv/bin/pip" install -q --no-deps dflash==0.1.0  # the decoding oracle some of these tests import
fi
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
default=(
  tests/train/test_recompile.py tests/distributed/test_compile_target.py tests/distributed/test_float8.py
  tests/infer/test_fast_engine_compiled.py tests/train/test_compile_report.py tests/train/test_loss_kernels.py
  tests/train/test_losses.py tests/train/test_real_eval.py tests/model/test_gguf_tokenizer.py
)
if [ $# -gt 0 ]; then default=("$@"); fi
exec "$venv/bin/python" -m pytest -m "not gpu" -q -p no:cacheprovider "${default[@]}"
