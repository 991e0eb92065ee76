#!/usr/bin/env bash
# One GPU-machine call: install the carried wheels, then run the named stages in order, each writing JSONL rows and
# logs under $OUT. Run from the repository root:
#   bash bench/gpu_session.sh tests kernels checkpoint perf7b
#   bash bench/gpu_session.sh --list                  # every stage and what it measures
#   bash bench/gpu_session.sh --dry-run calibrate moe # the commands the stages would run, nothing run (or DRY_RUN=1)
# Needs .whl/ carried (hydra/omegaconf/antlr wheels; .whl/peers/ for DeepSpeed) and STREAMTRAIN_GIT_SHA set.
# Stages that compare against another commit read it from .whl/base.tar (`git archive <sha> -o .whl/base.tar`) and
# label its rows with BASE_SHA. The stage table (STAGES below) names what each stage runs; the functions above it
# are the machine's plumbing: environment, logs, copying results back. Knobs read by the stages:
#   JOB_S (per-job time limit of ctxsweep and the moe<N> stages), NVME_S, WAIT_S, SWEEP_S, SWEEP_MODELS,
#   SWEEP_ONLY / PLANNER_ONLY / AB_JOBS (jobs of a grid), MOE_MODELS and WIDTH_MODELS (calibrate), MOE_MICRO_BATCHES (calibratemoe), QUALITY_S,
#   QUALITY_SEED, QUALITY_FORMATS, QUALITY_DETERMINISTIC, VAL_EVERY (qualitypaths), BASE_GRID (recomputeab: the
#   grid's name in the base tree, where it may have another).
set -u
OUT=${OUT:-/tmp/out}
DRY_RUN=${DRY_RUN:-0}
BASE_TREE=/tmp/base

# ---------------------------------------------------------------------------------------------------------------------
# Plumbing

run() {  # every command a stage runs: printed under --dry-run (quoted where the shell needs it), run otherwise
  if [ "$DRY_RUN" != 1 ]; then "$@"; return; fi
  local arg line=()
  for arg in "$@"; do
    if [[ $arg =~ ^[][A-Za-z0-9_./:=+,@%*-]+$ ]]; then line+=("$arg"); else line+=("$(printf '%q' "$arg")"); fi
  done
  echo "${line[*]}"
}

run_logged() {  # run_logged LOG CMD...: the whole output into $OUT/LOG, its end on the console
  local log=$1; shift
  if [ "$DRY_RUN" = 1 ]; then run "$@"; return; fi
  "$@" > "$OUT/$log" 2>&1; tail -30 "$OUT/$log"
}

run_tail() {  # run_tail CMD...: the end of the output on the console (the rows themselves go to $OUT)
  if [ "$DRY_RUN" = 1 ]; then run "$@"; return; fi
  "$@" 2>&1 | tail -15
}

gpu_tests() {  # gpu_tests [--tuned] LOG TIMEOUT PYTEST_ARGS...: the tests marked gpu under the given paths
  local tune=0; if [ "$1" = --tuned ]; then tune=1; shift; fi  # --tuned: attention autotuning on, as in training
  local log=$1 limit=$2; shift 2
  run_logged "$log" env STREAMTRAIN_ATTN_AUTOTUNE=$tune timeout "$limit" python3 -m pytest -v -s -m gpu \
    -p no:cacheprovider "$@"
}

py() {  # py TIMEOUT MODULE ARGS...: a module of this tree
  local limit=$1; shift
  run_tail timeout "$limit" python3 -m "$@"
}

bench() {  # bench TIMEOUT SCRIPT ARGS...: bench.SCRIPT
  local limit=$1 script=$2; shift 2
  py "$limit" "bench.$script" "$@"
}

grid() {  # grid TIMEOUT JOB_TIMEOUT GRID ARGS...: a grid of bench_engine, one fresh train.py process per job
  local limit=$1 job_limit=$2 name=$3; shift 3
  bench "$limit" bench_engine --grid "$name" --out "$OUT/${ENGINE_ROWS:-engine.jsonl}" \
    --workdir "${ENGINE_WORKDIR:-/tmp/bench}" --timeout-s "$job_limit" "$@"
}

train() {  # train TIMEOUT LOG OVERRIDES...: train.py in the foreground, its output into $OUT/LOG
  local limit=$1 log=$2; shift 2
  run_logged "$log" timeout "$limit" python3 train.py "$@"
}

only() {  # only VAR: `--only JOB` for each word of $VAR (the jobs of a grid to run)
  local job; for job in ${!1:-}; do printf -- '--only %s ' "$job"; done
}

unpack_base() {  # .whl/base.tar into $BASE_TREE, once per call: a warm machine may hold an older base
  [ -n "${BASE_UNPACKED:-}" ] && return
  run rm -rf "$BASE_TREE"; run mkdir -p "$BASE_TREE"; run tar xf .whl/base.tar -C "$BASE_TREE"; BASE_UNPACKED=1
}

in_base_tree() {  # in_base_tree CMD...: CMD in the tree of .whl/base.tar, its engine rows and runs kept apart
  [ -f .whl/base.tar ] || { echo "no .whl/base.tar: skipped in the base tree: $*"; return; }
  unpack_base
  [ "$DRY_RUN" = 1 ] && echo "in $BASE_TREE with STREAMTRAIN_GIT_SHA=${BASE_SHA:-base}:"
  ( [ "$DRY_RUN" = 1 ] || cd "$BASE_TREE" || exit 1
    STREAMTRAIN_GIT_SHA=${BASE_SHA:-base} ENGINE_ROWS=engine_base.jsonl ENGINE_WORKDIR=/tmp/bench_base "$@")
}

with_base_tree() {  # with_base_tree CMD...: CMD, given `--base-tree DIR` when .whl/base.tar is carried
  if [ -f .whl/base.tar ]; then unpack_base; "$@" --base-tree "$BASE_TREE"; else "$@"; fi
}

gpu_card() {  # h100 or h200: the profile of the card this runs on
  if [ "$DRY_RUN" = 1 ]; then echo "${DRY_RUN_CARD:-h100}"; return; fi
  nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00' | tr H h
}

use_profile() {  # use_profile CARD: the profile just calibrated replaces conf/hardware/CARD.yaml for later stages
  [ "$DRY_RUN" = 1 ] || [ -s "$OUT/$1.yaml" ] && run cp "$OUT/$1.yaml" "conf/hardware/$1.yaml"
}

pack() {  # pack ARCHIVE DIR PATTERN...: the files of DIR matching the patterns into $OUT/ARCHIVE
  local archive=$1 dir=$2; shift 2
  if [ "$DRY_RUN" = 1 ]; then run tar czf "$OUT/$archive" -C "$dir" "$@"; return; fi
  ( cd "$dir" 2>/dev/null || exit 0
    shopt -s nullglob; files=($*)  # the patterns expand here, in DIR
    [ ${#files[@]} -eq 0 ] || tar czf "$OUT/$archive" "${files[@]}")
}

collect() {  # collect DEST FILE...: the files that exist, copied into $OUT/DEST (.: $OUT itself)
  local dest=$OUT/$1; dest=${dest%/.}; shift
  run mkdir -p "$dest"
  local f; for f in "$@"; do [ "$DRY_RUN" = 1 ] || [ -e "$f" ] && run cp "$f" "$dest/"; done
}

train_detached() {  # train_detached NAME OVERRIDES...: train.py in a process session of its own, which outlives
  local name=$1; shift  # this call while the machine stays held; run dir /tmp/bench/NAME, log /tmp/bench/NAME.log
  run mkdir -p /tmp/bench
  if [ "$DRY_RUN" = 1 ]; then run setsid nohup python3 train.py "$@" "hydra.run.dir=/tmp/bench/$name"; return; fi
  setsid nohup python3 train.py "$@" "hydra.run.dir=/tmp/bench/$name" > "/tmp/bench/$name.log" 2>&1 < /dev/null &
  echo "started pid $!"
}

await_detached() {  # await_detached NAME SECONDS: wait for train_detached's run, then copy its log and records back
  local name=$1 end=$((SECONDS + $2))
  [ "$DRY_RUN" = 1 ] && { echo "wait up to $2 s for hydra.run.dir=/tmp/bench/$name"; return; }
  while [ $SECONDS -lt $end ] && pgrep -f "hydra.run.dir=/tmp/bench/$name" > /dev/null; do sleep 5; done
  collect "$name" "/tmp/bench/$name.log" /tmp/bench/"$name"/*.json*
  tail -5 "/tmp/bench/$name.log"
  nvidia-smi --query-gpu=memory.used --format=csv; free -g | head -2
}

install_wheels() {  # install_wheels DIR: the carried wheels of DIR, no index (the machine has no network)
  run python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$1"/*.whl
}

# ---------------------------------------------------------------------------------------------------------------------
# The stages: name, what it measures, the commands (run by eval, after the knobs above are read)

declare -A STAGE_RUNS STAGE_WHAT
STAGE_ORDER=()
stage() { STAGE_ORDER+=("$1"); STAGE_WHAT[$1]=$2; STAGE_RUNS[$1]=$3; }

# GPU tests, chosen by marker (gpu) and path
stage tests 'every GPU test' \
  'gpu_tests gpu_tests.log 420 tests'
stage streamtests 'the streaming engine equals the reference on the GPU' \
  'gpu_tests gpu_stream_tests.log 300 tests/test_stream_gpu.py'
stage formattests 'the streaming engine in each state format' \
  'gpu_tests gpu_format_tests.log 240 tests/test_stream_gpu.py -k format'
stage dettests 'train.deterministic repeats bit for bit; deterministic attention' \
  'gpu_tests --tuned gpu_deterministic_tests.log 300 tests/test_deterministic.py tests/kernels/test_attention.py \
     -k deterministic'
stage workertests 'train.compile_in_process: no compile workers, their memory measured' \
  'gpu_tests --tuned gpu_compile_workers_tests.log 300 tests/test_compile_workers.py'
stage moetests 'MoE layers and models against transformers' \
  'gpu_tests gpu_moe_tests.log 100 tests/test_moe_vs_hf.py tests/test_hf_moe.py'
stage dptests 'data parallel: 2 GPUs equal 1 (NCCL; a multi-GPU kind)' \
  'gpu_tests gpu_dp_tests.log 300 tests/test_distributed.py'

# kernel benchmarks
stage kernels 'gradient accumulation and fused AdamW update kernels against the copy rate' \
  'bench 150 bench_grad_accum --out $OUT/grad_accum.jsonl
   bench 150 bench_adamw_update --out $OUT/adamw_update.jsonl'
stage adamw 'the fused update kernel: GPU tests, then every format over the launch sweep' \
  'gpu_tests gpu_adamw_tests.log 200 tests/kernels/test_adamw_update.py
   bench 240 bench_adamw_update --sweep --out $OUT/adamw_update.jsonl'
stage adamwcheck 'the fused update kernel: GPU tests, then its shipped launch' \
  'gpu_tests gpu_adamw_tests.log 200 tests/kernels/test_adamw_update.py
   bench 200 bench_adamw_update --out $OUT/adamw_update.jsonl'
stage gradquant 'int8 held gradients: the quantizer and the update reading int8 codes, GPU tests, then timed' \
  'gpu_tests gpu_grad_quant_tests.log 200 tests/kernels/test_grad_quant.py
   bench 200 bench_adamw_update --grad int8 --models qwen7b --out $OUT/adamw_update_int8_grad.jsonl'
stage adamwab 'the fused update kernel against the base tree'"'"'s in one lease, then a qwen7b launch sweep' \
  'gpu_tests gpu_adamw_tests.log 200 tests/kernels/test_adamw_update.py
   bench 200 bench_adamw_update --out $OUT/adamw_update.jsonl
   in_base_tree bench 200 bench_adamw_update --out $OUT/adamw_update_base.jsonl
   bench 200 bench_adamw_update --models qwen7b --configs 256x1,512x1,512x2,1024x2,1024x4 \
     --out $OUT/adamw_update_sweep.jsonl'
stage adamwablate 'patched variants of the update kernel side by side (the base tree'"'"'s too when carried)' \
  'with_base_tree bench 200 ablate_adamw_update --out $OUT/adamw_ablation.jsonl'
stage adamwsmall 'the update kernel'"'"'s small launches at qwen7b and qwen32b layer sizes' \
  'bench 280 bench_adamw_update --models qwen7b,qwen32b \
     --configs 256x1,256x2,512x2,512x4,1024x4,1024x8,2048x8,2048x16 --out $OUT/adamw_update.jsonl'
stage attention 'the Triton attention against each SDPA backend at 8K, 32K and 128K' \
  'bench 300 bench_attention --seq-lens 8192 32768 131072 --out $OUT/attention.jsonl'
stage attention512 'the Triton attention against the cuDNN and the default SDPA backends, qwen7b heads, 32K-512K' \
  'gpu_tests gpu_bench_attention_tests.log 120 tests/test_bench_attention.py tests/kernels/test_attention.py
   bench 420 bench_attention --cases qwen7b --sdpa-backends cudnn default --seq-lens 32768 131072 524288 \
     --out $OUT/attention.jsonl'
stage groupedmm 'MoE expert compute (moe.experts, grouped matmuls alone) against dense ones of its FLOPs, 64K tokens' \
  'bench 300 bench_grouped_mm --out $OUT/grouped_mm.jsonl'
stage leanlayer 'one qwen7b layer'"'"'s engine step, plain (SDPA, Triton) against lean (attention recomputed, kept), 32K and 128K' \
  'gpu_tests gpu_lean_tests.log 150 tests/test_lean_layer.py
   bench 400 bench_lean_layer --seq-lens 32768 131072 --out $OUT/lean_layer.jsonl'
stage leanlayer512 'the same at 512K tokens (the plain layer on the Triton kernel, the lean layer both ways)' \
  'bench 560 bench_lean_layer --seq-lens 524288 --variants lean kept triton --out $OUT/lean_layer.jsonl'
stage leansdpa 'the lean layer on cuDNN'"'"'s fused attention: the lean GPU tests, then its step against SDPA and the Triton lean layer at 32K' \
  'gpu_tests gpu_lean_tests.log 300 tests/test_lean_attention.py tests/test_lean_layer.py -k cudnn
   bench 240 bench_lean_layer --seq-lens 32768 --variants sdpa kept kept_sdpa --out $OUT/lean_layer.jsonl'
stage leansdpa512 'the lean layer at 512K tokens, kept attention output, on the Triton kernel and on cuDNN'"'"'s' \
  'bench 560 bench_lean_layer --seq-lens 524288 --variants kept_sdpa kept --out $OUT/lean_layer.jsonl'
stage checkpoint 'HF write, engine build, import and export of a qwen7b-shaped model' \
  'bench 300 bench_checkpoint --model qwen7b --workdir /tmp/ckpt --out $OUT/checkpoint.jsonl hardware=h200
   run rm -rf /tmp/ckpt'

# the planner's profile
stage calibrate 'the profile of this card ($OUT/<card>.yaml, to commit by hand; later stages plan with it)' \
  'card=$(gpu_card)
   py 540 engine.calibrate --base conf/hardware/$card.yaml --out $OUT/$card.yaml \
     ${MOE_MODELS:+--moe-models $MOE_MODELS} --width-models "${WIDTH_MODELS-qwen3b,qwen14b,qwen72b}" \
     --attn-points ${ATTN_POINTS-triton:32768 triton:131072 triton:524288 sdpa:131072 sdpa:524288} \
     --jsonl $OUT/calibrate.jsonl
   use_profile $card'
stage calibratemoe 'the MoE layers of this card'"'"'s profile alone (MOE_MODELS at MOE_MICRO_BATCHES x 4096, compiled; later stages plan with it)' \
  'card=$(gpu_card)
   py 540 engine.calibrate --moe-only --moe-models ${MOE_MODELS-gptoss20b,qwen3_30b_a3b} \
     --moe-micro-batches ${MOE_MICRO_BATCHES-2,4} --modes compiled --base conf/hardware/$card.yaml \
     --out $OUT/$card.yaml --jsonl $OUT/calibrate.jsonl
   use_profile $card'

# engine jobs, by grid of bench/bench_engine.py
stage perf7b 'the planner'"'"'s placement at 64K and 16K tokens per step' \
  'grid 560 200 perf7b'
stage stream_vs_reference 'qwen7b streamed next to the compiled reference at 64K and 16K tokens per step' \
  'grid 560 170 stream_vs_reference'
stage planner_unseen 'the planner on configurations its calibration never saw (PLANNER_ONLY: a subset)' \
  'grid 560 120 planner_unseen $(only PLANNER_ONLY)'
stage kept_layers 'layers whose forward graph is kept, next to the planner'"'"'s default' \
  'grid 560 140 kept_layers'
stage capped_host_grads 'a 24 GB cap; gradients on the host with every unit updated by the host AdamW' \
  'grid 500 240 capped_host_grads'
stage recomputeab 'planner_unseen jobs (AB_JOBS) from this tree and the base tree, alternating, in one lease' \
  'for job in ${AB_JOBS:-qwen3b-stream-32k qwen7b-stream-64k-mb4}; do
     grid 230 210 planner_unseen --only $job
     in_base_tree grid 230 210 ${BASE_GRID:-planner_unseen} --only $job
   done'
stage compare3b 'qwen3b streamed next to the peers (all on GPU, FSDP2 offload, DeepSpeed ZeRO-3) of this call' \
  'install_wheels .whl/peers
   for peer in all_on_gpu fsdp2_offload deepspeed_zero3; do
     bench 200 peers.$peer --model qwen3b --micro-batch-size 8 --grad-accum 1 --out $OUT/peers.jsonl
   done
   grid 200 150 compare3b --peers $OUT/peers.jsonl'
stage moepeer 'gpt-oss-20b next to DeepSpeed ZeRO-3 offload of this call: full depth (its host pre-flight says why not), then 3 of 24 layers, 64K tokens per step' \
  'install_wheels .whl/peers
   bench 40 peers.deepspeed_zero3 --model gptoss20b --micro-batch-size 4 --grad-accum 4 --out $OUT/peers.jsonl
   bench 290 peers.deepspeed_zero3 --model gptoss20b --layers 3 --micro-batch-size 4 --grad-accum 4 \
     --out $OUT/peers.jsonl
   grid 220 200 moepeer --peers $OUT/peers.jsonl'
stage peers 'the all-on-GPU peer at qwen7b, 64K tokens per step' \
  'bench 200 peers.all_on_gpu --model qwen7b --micro-batch-size 2 --grad-accum 8 --out $OUT/peers.jsonl'
stage capacity14 'full-depth qwen14b in bf16 master + int8 moments + bf16 gradients' \
  'grid 420 400 capacity_bf16_int8 --only qwen14b'
stage capacity32 'full-depth qwen32b in bf16 master + int8 moments + bf16 gradients' \
  'grid 580 560 capacity_bf16_int8 --only qwen32b'
stage context 'qwen7b, one sequence per step, Triton attention and SDPA from 8K to 128K' \
  'grid 560 200 context_attention'
stage attnab 'Triton against SDPA in the compiled qwen7b layer at 32K' \
  'grid 360 170 context_attention --only ctx32k'
stage ctxsweep 'qwen7b from 4K to 256K, one sequence per step (SWEEP_ONLY: jobs; ~15 min in all: split over calls), rows and plot' \
  'grid 540 ${JOB_S:-240} context_sweep $(only SWEEP_ONLY)
   py 300 engine.report /tmp/bench/qwen7b-stream-sweep*/ --jsonl $OUT/context_sweep.jsonl \
     --png $OUT/context_sweep.png
   pack sweep_rundirs.tgz /tmp/bench "qwen7b-stream-sweep*"'
stage finetune7b 'qwen7b fine-tuned with the defaults from an HF checkpoint written here, on a chat jsonl' \
  'py 300 engine.quickstart --model qwen7b --out /tmp/ft --records 3000
   train 560 finetune7b.log experiment=finetune_qwen7b_$(gpu_card) model.init=hf:/tmp/ft/qwen7b \
     data.path=/tmp/ft/chat.jsonl train.steps=4 train.val_every=2 train.export_hf=false logger=none \
     hydra.run.dir=/tmp/bench/finetune7b
   collect finetune7b /tmp/bench/finetune7b/summary.json /tmp/bench/finetune7b/metrics.jsonl'
stage qwen32b 'python train.py model=qwen32b with the defaults, 3 steps (an H200: the H100 host cannot hold it)' \
  'train 590 qwen32b_defaults.log model=qwen32b train.steps=3 logger=none hydra.run.dir=/tmp/bench/qwen32b
   collect qwen32b /tmp/bench/qwen32b/summary.json /tmp/bench/qwen32b/metrics.jsonl'
stage packedattn 'document masking in the Triton attention: GPU tests, then packed rows against per-document calls' \
  'gpu_tests gpu_attention_tests.log 300 tests/kernels/test_attention.py
   bench 300 bench_attention --docs --doc-lens 512 2048 8192 --out $OUT/attention_docs.jsonl'
stage ctx512 'qwen7b at 512K (this card'"'"'s recipe), started in a process session of its own: then ctx512wait; a later ctxsweep reports it with the sweep' \
  'train_detached qwen7b-stream-sweep512k experiment=bench_qwen7b_512k_$(gpu_card) logger=none'
stage ctx512wait 'waits WAIT_S for ctx512'"'"'s run, then copies its log and records (call again until it ends)' \
  'await_detached qwen7b-stream-sweep512k ${WAIT_S:-500}'
stage moe 'MoE GPU tests, then the eager MoE jobs' \
  'gpu_tests gpu_moe_tests.log 240 tests/test_moe_vs_hf.py tests/test_hf_moe.py
   grid 560 260 moe --only eager'
stage moecompiled 'the compiled MoE jobs' \
  'grid 560 180 moe --only compiled'
stage moe64k 'gpt-oss-20b at full depth, 64K tokens a step, held gradients partly on the host: eager, compiled' \
  'grid 580 280 moe64k'
stage autotokens 'qwen7b at 4K tokens a micro-batch: 1 micro-batch a step, then the count train.grad_accum=-1 takes' \
  'grid 400 180 autotokens'
stage moetokens 'gpt-oss-20b at full depth, compiled, 128K, 192K and train.grad_accum=-1 tokens a step (AB_JOBS: some)' \
  'grid 580 ${JOB_S:-280} moetokens $(only AB_JOBS)'
stage moeint8grads 'Qwen3-30B-A3B and gpt-oss-20b, full depth, compiled, 64K tokens a step, int8 held gradients' \
  'grid 580 ${JOB_S:-270} moeint8grads $(only AB_JOBS)'
stage normpass 'the norm pass: gpt-oss-20b 64K held int8 gradients vs norm pass, gpt-oss-120b 4 layers (AB_JOBS: some)' \
  'grid 590 ${JOB_S:-190} normpass $(only AB_JOBS)'
stage moe20 'gpt-oss-20b at full depth, eager (JOB_S: its time limit)' \
  'grid $((${JOB_S:-280} + 20)) ${JOB_S:-280} moe --only gptoss20b-stream-16k-eager'
stage moe30 'Qwen3-30B-A3B at full depth, eager (H200)' \
  'grid $((${JOB_S:-280} + 20)) ${JOB_S:-280} moe --only qwen3-30b-a3b-stream-16k-eager'
stage moe120 'gpt-oss-120b, 4 layers at its width, eager (H200)' \
  'grid $((${JOB_S:-280} + 20)) ${JOB_S:-280} moe --only gptoss120b-4l-stream-16k-eager'
stage nvme 'the disk alone, then qwen14b fp32 with moments in the NVMe tier (H200)' \
  'run mkdir -p /tmp/nvme
   bench 120 bench_nvme --dir /tmp/nvme --out $OUT/nvme.jsonl
   grid 440 420 nvme_qwen14b'
stage nvmerun 'the qwen14b fp32 NVMe job alone, its run dir'"'"'s records back (NVME_S: its time limit; H200)' \
  'run mkdir -p /tmp/nvme /tmp/bench
   train ${NVME_S:-520} qwen14b_nvme.log experiment=bench_qwen14b_fp32_nvme_h200 hardware.nvme_dir=/tmp/nvme \
     data=stdlib train.steps=3 logger=none hydra.run.dir=/tmp/bench/qwen14b-nvme
   collect . /tmp/bench/qwen14b-nvme/metrics.jsonl /tmp/bench/qwen14b-nvme/summary.json'
stage nvmeab 'the disk alone, then qwen7b fp32 with the moments of 0 and 4 layers on disk' \
  'run mkdir -p /tmp/nvme
   bench 120 bench_nvme --dir /tmp/nvme --out $OUT/nvme.jsonl
   grid 440 210 nvme_vs_ram'
stage data_parallel 'qwen7b over 1, 2, 4, 8 GPUs of one host (a multi-GPU kind)' \
  'grid 580 200 data_parallel'

# sweeps of train.py, and training quality
stage modelsize 'the model-size sweep (conf/sweep/model_size.yaml), rows and plot' \
  'train 560 model_size_sweep.log +sweep=model_size logger=none hydra.sweep.dir=/tmp/msweep train.steps=3
   py 300 engine.report /tmp/msweep --x published_params --png $OUT/model_size.png --jsonl $OUT/model_size.jsonl
   pack model_size_logs.tgz /tmp/msweep "*/train.log" "*/summary.json" "*/metrics.jsonl"'
stage sweep128k 'the model-size sweep'"'"'s SWEEP_MODELS at 128K tokens per step (SWEEP_S: its time limit)' \
  'train ${SWEEP_S:-480} model_size_128k.log +sweep=model_size model=${SWEEP_MODELS:-qwen7b,qwen72b} \
     train.grad_accum=32 logger=none hydra.sweep.dir=/tmp/msweep128 train.steps=3
   py 300 engine.report /tmp/msweep128 --x published_params --png $OUT/model_size_128k.png \
     --jsonl $OUT/model_size_128k.jsonl
   pack model_size_128k_logs.tgz /tmp/msweep128 "*/train.log" "*/summary.json" "*/metrics.jsonl"'
stage quality 'qwen0_5b in three state formats side by side on real text, 16M tokens each' \
  'bench 585 bench_formats_quality --steps 490 --val-every 49 --timeout-s 530 --workdir /tmp/quality \
     --out $OUT/formats_quality.jsonl
   pack quality.tgz /tmp/quality "*.log" "*/metrics.jsonl"'
stage quality1 'fp32 and bf16 state side by side, seed 1' \
  'bench 585 bench_formats_quality --steps 490 --val-every 49 --timeout-s 530 --seed 1 --formats fp32 bf16 \
     --workdir /tmp/quality --out $OUT/formats_quality.jsonl
   pack quality.tgz /tmp/quality "*.log" "*/metrics.jsonl"'
stage qualitypaths 'fp32 through torch and the kernel, bf16 + bf16 and each half alone (QUALITY_* knobs)' \
  'bench $((${QUALITY_S:-500} + 50)) bench_formats_quality --steps 490 --val-every ${VAL_EVERY:-49} \
     --timeout-s ${QUALITY_S:-500} --workdir /tmp/quality --out $OUT/formats_quality.jsonl \
     --seed ${QUALITY_SEED:-0} ${QUALITY_DETERMINISTIC:+--deterministic} \
     --formats ${QUALITY_FORMATS:-fp32 fp32_kernel bf16 bf16_master bf16_moments}
   pack quality.tgz /tmp/quality "*.log" "*/metrics.jsonl"'

# ---------------------------------------------------------------------------------------------------------------------
# The call

stages=()
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --list) for s in "${STAGE_ORDER[@]}"; do printf '%-20s %s\n' "$s" "${STAGE_WHAT[$s]}"; done; exit 0 ;;
    *) [ -n "${STAGE_RUNS[$arg]+set}" ] || { echo "unknown stage: $arg (bash $0 --list)" >&2; exit 2; }
       stages+=("$arg") ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || { echo "usage: bash $0 [--dry-run] [--list] STAGE..." >&2; exit 2; }

run mkdir -p "$OUT"
install_wheels .whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
for stage in "${stages[@]}"; do
  echo "=== $stage $(date +%T)"
  eval "${STAGE_RUNS[$stage]}"
done
[ "$DRY_RUN" = 1 ] || { [ -d /tmp/bench ] && pack logs.tgz /tmp/bench "*.log"; ls "$OUT"; }
