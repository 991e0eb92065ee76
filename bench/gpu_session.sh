#!/usr/bin/env bash
# One GPU-machine call: carried wheels, then the named stages, each writing JSONL and logs under $OUT.
#   bash bench/gpu_session.sh tests kernels checkpoint housekeeping perf7b peers attention
#   bash bench/gpu_session.sh adamw   # issue 18: the fused update kernel's GPU tests and bandwidth
#   bash bench/gpu_session.sh adamwab adamwablate # the same against .whl/base.tar (git archive <base> -o
#     .whl/base.tar), one lease; then the kernel variants of bench/ablate_adamw_update.py, base included
#   bash bench/gpu_session.sh formattests capacity14; bash bench/gpu_session.sh capacity32   # issue 18, full depth
#   bash bench/gpu_session.sh quality # issue 18: qwen0_5b in three state formats side by side, 16.06M tokens each
#   bash bench/gpu_session.sh qualitypaths # issue 18: fp32 through torch and through the kernel, bf16 + bf16, halves
#     (QUALITY_FORMATS= a subset, QUALITY_S= the seconds they get, QUALITY_SEED= another seed,
#     QUALITY_DETERMINISTIC=1 train.deterministic)
#   bash bench/gpu_session.sh streamtests dettests   # stream == reference on the GPU; train.deterministic repeats
#   bash bench/gpu_session.sh workertests   # train.compile_in_process: no compile workers, their memory measured
#   bash bench/gpu_session.sh sweep128k   # issue 7: the model-size sweep's qwen7b and qwen72b at 128K tokens per step
#     (SWEEP_MODELS= others, SWEEP_S= its time limit), where four 72B layers' host AdamW no longer outlasts their
#     forward
#   bash bench/gpu_session.sh context modelsize   # issue 5 (qwen7b, one sequence per step), issue 7 (4 layers each)
#   bash bench/gpu_session.sh moe; bash bench/gpu_session.sh nvme   # issue 8 (needs H200), issue 7 (qwen14b fp32)
#   JOB_S=210 bash bench/gpu_session.sh moetests moe20 moe120 moe30   # issue 8 one job a stage (moe120, moe30: H200)
#   NVME_S=520 bash bench/gpu_session.sh nvmerun   # issue 7: the qwen14b fp32 NVMe job alone (H200), records back
#   bash bench/gpu_session.sh nvmeab   # issue 7: qwen7b fp32 with the moments of 0 and 4 layers on disk (H100 too)
#   bash bench/gpu_session.sh attnab   # issue 5: Triton vs SDPA in the compiled qwen7b layer at 32K
#   bash bench/gpu_session.sh dptests dp9   # issue 9, on a multi-GPU kind: 2 GPUs == 1 (NCCL), then 1..8 GPUs
#   bash bench/gpu_session.sh calibrate ctxsweep   # issue 5: qwen7b 4K-128K, one sequence a step, rows + plot
#   PLANNER_ONLY=qwen3b bash bench/gpu_session.sh calibrate planner17   # issue 17: calibrate (with the other layer
#     widths of WIDTH_MODELS, default qwen3b,qwen14b,qwen72b; WIDTH_MODELS= for none), then the qwen3b planner jobs
#   MOE_MODEL=gptoss20b bash bench/gpu_session.sh calibrate   # the profile with a MoE layer's figures too (the
#     compiled MoE layer has not yet run on a GPU: a failure there fails the whole calibration, so opt in)
#   bash bench/gpu_session.sh ctx512; WAIT_S=560 bash bench/gpu_session.sh ctx512wait   # issue 5: qwen7b at 512K
#     (H200), in its own process session: call ctx512wait again in back-to-back calls until the run ends
#   BASE_SHA=<sha> bash bench/gpu_session.sh recomputeab   # planner17's qwen3b 32K and qwen7b 64K jobs from this tree
#     and from .whl/base.tar (`git archive <sha>`), alternating, in one lease (AB_JOBS= other jobs of that grid)
#   bash bench/gpu_session.sh calibrate compare3b streamtests planner17 perf17 kept17   # issue 17 (calibrate
#   writes $OUT/<card>.yaml for the card it runs on, h100 or h200, to be committed by hand; the later stages of the
#   same call plan with it)
# Each stage's full log is kept under $OUT (gpu_tests.log; logs.tgz holds every engine job's log).
# Needs .whl/ carried (hydra/omegaconf/antlr wheels; .whl/peers/ for DeepSpeed) and STREAMTRAIN_GIT_SHA set.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
copy_quality_logs() {  # each quality run's log and metrics in one file (at most 8 files come back from a call)
  (cd /tmp/quality && tar czf "$OUT/quality.tgz" *.log */metrics.jsonl)
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 420 python3 -m pytest -v -s -m gpu -p no:cacheprovider tests \
             > "$OUT/gpu_tests.log" 2>&1; tail -30 "$OUT/gpu_tests.log" ;;
    adamw) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 200 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
             tests/kernels/test_adamw_update.py > "$OUT/gpu_adamw_tests.log" 2>&1; tail -12 "$OUT/gpu_adamw_tests.log"
           timeout 240 python3 bench/bench_adamw_update.py --sweep --out "$OUT/adamw_update.jsonl" 2>&1 | tail -40 ;;
    adamwcheck) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 200 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
                  tests/kernels/test_adamw_update.py > "$OUT/gpu_adamw_tests.log" 2>&1; tail -4 "$OUT/gpu_adamw_tests.log"
                timeout 200 python3 bench/bench_adamw_update.py --out "$OUT/adamw_update.jsonl" 2>&1 | tail -20 ;;
    adamwab) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 200 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
               tests/kernels/test_adamw_update.py > "$OUT/gpu_adamw_tests.log" 2>&1; tail -4 "$OUT/gpu_adamw_tests.log"
             timeout 200 python3 bench/bench_adamw_update.py --out "$OUT/adamw_update.jsonl" 2>&1 | tail -20
             if [ -f .whl/base.tar ]; then  # the same bench from the tree of another commit, same lease
               rm -rf /tmp/base && mkdir -p /tmp/base && tar xf .whl/base.tar -C /tmp/base
               timeout 200 python3 /tmp/base/bench/bench_adamw_update.py --out "$OUT/adamw_update_base.jsonl" \
                 2>&1 | tail -20; fi
             timeout 200 python3 bench/bench_adamw_update.py --models qwen7b --configs 256x1,512x1,512x2,1024x2,1024x4 \
               --out "$OUT/adamw_update_sweep.jsonl" 2>&1 | tail -3 ;;
    adamwablate) timeout 200 python3 bench/ablate_adamw_update.py --out "$OUT/adamw_ablation.jsonl" \
                   $([ -d /tmp/base ] && echo --base-tree /tmp/base) 2>&1 | tail -3 ;;  # after adamwab: with base
    adamwsmall) timeout 280 python3 bench/bench_adamw_update.py --models qwen7b,qwen32b \
                  --configs 256x1,256x2,512x2,512x4,1024x4,1024x8,2048x8,2048x16 --out "$OUT/adamw_update.jsonl" \
                  2>&1 | tail -3 ;;
    kernels) timeout 150 python3 bench/bench_grad_accum.py --out "$OUT/grad_accum.jsonl" 2>&1 | tail -12
             timeout 150 python3 bench/bench_adamw_update.py --out "$OUT/adamw_update.jsonl" 2>&1 | tail -12 ;;
    checkpoint) timeout 300 python3 bench/bench_checkpoint.py --model qwen7b --workdir /tmp/ckpt \
                  --out "$OUT/checkpoint.jsonl" hardware=h200 2>&1 | tail -12; rm -rf /tmp/ckpt ;;
    housekeeping) timeout 500 python3 bench/bench_engine.py --grid housekeeping --out "$OUT/engine.jsonl" \
                    --workdir /tmp/bench --timeout-s 240 2>&1 | tail -10 ;;
    perf7b) timeout 560 python3 bench/bench_engine.py --grid perf7b --out "$OUT/engine.jsonl" \
              --workdir /tmp/bench --timeout-s 200 2>&1 | tail -10 ;;
    attention) timeout 300 python3 bench/bench_attention.py --seq-lens 8192 32768 131072 \
                 --out "$OUT/attention.jsonl" 2>&1 | tail -12 ;;
    streamtests) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 300 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
                   tests/test_stream_gpu.py > "$OUT/gpu_stream_tests.log" 2>&1; tail -30 "$OUT/gpu_stream_tests.log" ;;
    dettests) STREAMTRAIN_ATTN_AUTOTUNE=1 timeout 300 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
                tests/test_deterministic.py tests/kernels/test_attention.py -k deterministic \
                > "$OUT/gpu_deterministic_tests.log" 2>&1; tail -12 "$OUT/gpu_deterministic_tests.log" ;;
    workertests) timeout 300 python3 -m pytest -v -s -m gpu -p no:cacheprovider tests/test_compile_workers.py \
                   > "$OUT/gpu_compile_workers_tests.log" 2>&1; tail -6 "$OUT/gpu_compile_workers_tests.log" ;;
    calibrate) card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00' | tr H h)
               timeout 420 python3 -m engine.calibrate --base conf/hardware/$card.yaml --out "$OUT/$card.yaml" \
                 ${MOE_MODEL:+--moe-model $MOE_MODEL} --width-models "${WIDTH_MODELS-qwen3b,qwen14b,qwen72b}" \
                 --jsonl "$OUT/calibrate.jsonl" 2>&1 | tail -18
               [ -s "$OUT/$card.yaml" ] && cp "$OUT/$card.yaml" conf/hardware/$card.yaml ;;  # later stages plan with it
    recomputeab) for job in ${AB_JOBS:-qwen3b-stream-32k qwen7b-stream-64k-mb4}; do  # this tree, then .whl/base.tar's
                   timeout 230 python3 bench/bench_engine.py --grid planner17 --only $job --out "$OUT/engine.jsonl" \
                     --workdir /tmp/bench --timeout-s 210 2>&1 | tail -3
                   [ -f .whl/base.tar ] || continue
                   [ -d /tmp/base ] || { mkdir -p /tmp/base && tar xf .whl/base.tar -C /tmp/base; }
                   (cd /tmp/base && STREAMTRAIN_GIT_SHA=${BASE_SHA:-base} timeout 230 python3 bench/bench_engine.py \
                      --grid planner17 --only $job --out "$OUT/engine_base.jsonl" --workdir /tmp/bench_base \
                      --timeout-s 210 2>&1 | tail -3)
                 done ;;  # the same jobs from two trees in one lease (BASE_SHA names the base's commit)
    kept17) timeout 560 python3 bench/bench_engine.py --grid kept17 --out "$OUT/engine.jsonl" \
              --workdir /tmp/bench --timeout-s 140 2>&1 | tail -10 ;;
    perf17) timeout 560 python3 bench/bench_engine.py --grid perf17 --out "$OUT/engine.jsonl" \
              --workdir /tmp/bench --timeout-s 170 2>&1 | tail -10 ;;
    planner17) only=(); for job in ${PLANNER_ONLY:-}; do only+=(--only "$job"); done  # e.g. PLANNER_ONLY="qwen3b"
               timeout 560 python3 bench/bench_engine.py --grid planner17 "${only[@]}" --out "$OUT/engine.jsonl" \
                 --workdir /tmp/bench --timeout-s 120 2>&1 | tail -12 ;;
    compare3b) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
                 .whl/peers/*.whl
               for peer in all_on_gpu fsdp2_offload deepspeed_zero3; do
                 timeout 200 python3 bench/peers/$peer.py --model qwen3b --micro-batch-size 8 --grad-accum 1 \
                   --out "$OUT/peers.jsonl" 2>&1 | tail -2
               done
               timeout 200 python3 bench/bench_engine.py --grid compare3b --out "$OUT/engine.jsonl" \
                 --workdir /tmp/bench --timeout-s 150 --peers "$OUT/peers.jsonl" 2>&1 | tail -6 ;;
    formattests) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 240 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
                   tests/test_stream_gpu.py -k format > "$OUT/gpu_format_tests.log" 2>&1
                 tail -8 "$OUT/gpu_format_tests.log" ;;
    capacity14) timeout 420 python3 bench/bench_engine.py --grid capacity18 --only qwen14b --out "$OUT/engine.jsonl" \
                  --workdir /tmp/bench --timeout-s 400 2>&1 | tail -4 ;;
    capacity32) timeout 580 python3 bench/bench_engine.py --grid capacity18 --only qwen32b --out "$OUT/engine.jsonl" \
                  --workdir /tmp/bench --timeout-s 560 2>&1 | tail -4 ;;
    quality1) timeout 585 python3 bench/bench_formats_quality.py --steps 490 --val-every 49 --timeout-s 530 \
                --seed 1 --formats fp32 bf16 --workdir /tmp/quality --out "$OUT/formats_quality.jsonl" 2>&1 | tail -5
              copy_quality_logs ;;
    quality) timeout 585 python3 bench/bench_formats_quality.py --steps 490 --val-every 49 --timeout-s 530 \
               --workdir /tmp/quality --out "$OUT/formats_quality.jsonl" 2>&1 | tail -5
             copy_quality_logs ;;
    qualitypaths) q=${QUALITY_S:-500}  # the bench stops its runs at q s, then waits up to 30 s for them to stop
                  timeout $((q + 50)) python3 bench/bench_formats_quality.py --steps 490 --val-every ${VAL_EVERY:-49} \
                    --timeout-s $q --workdir /tmp/quality --out "$OUT/formats_quality.jsonl" --seed ${QUALITY_SEED:-0} \
                    ${QUALITY_DETERMINISTIC:+--deterministic} \
                    --formats ${QUALITY_FORMATS:-fp32 fp32_kernel bf16 bf16_master bf16_moments} 2>&1 | tail -7
                  copy_quality_logs ;;  # issue 18: is bf16 + bf16's lower loss the update path or a format's?
    context) timeout 560 python3 bench/bench_engine.py --grid context5 --out "$OUT/engine.jsonl" \
               --workdir /tmp/bench --timeout-s 200 2>&1 | tail -8 ;;
    moe) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 240 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
           tests/test_moe_vs_hf.py tests/test_hf_moe.py > "$OUT/gpu_moe_tests.log" 2>&1; tail -6 "$OUT/gpu_moe_tests.log"
         timeout 560 python3 bench/bench_engine.py --grid moe8 --only eager --out "$OUT/engine.jsonl" \
           --workdir /tmp/bench --timeout-s 260 2>&1 | tail -6 ;;
    attnab) timeout 360 python3 bench/bench_engine.py --grid context5 --only ctx32k --out "$OUT/engine.jsonl" \
              --workdir /tmp/bench --timeout-s 170 2>&1 | tail -5 ;;  # issue 5: Triton vs SDPA in the compiled layer
    dptests) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 300 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
               tests/test_distributed.py > "$OUT/gpu_dp_tests.log" 2>&1; tail -6 "$OUT/gpu_dp_tests.log" ;;
    dp9) timeout 580 python3 bench/bench_engine.py --grid dp9 --out "$OUT/engine.jsonl" --workdir /tmp/bench \
           --timeout-s 200 2>&1 | tail -6 ;;  # issue 9: scaling over the GPUs of a multi-GPU kind
    ctxsweep) only=(); for job in ${SWEEP_ONLY:-}; do only+=(--only "$job"); done  # e.g. SWEEP_ONLY="64k 128k"
              timeout 540 python3 bench/bench_engine.py --grid ctxsweep5 "${only[@]}" --out "$OUT/engine.jsonl" \
                --workdir /tmp/bench --timeout-s ${JOB_S:-240} 2>&1 | tail -6
              python3 -m engine.report /tmp/bench/qwen7b-stream-sweep*/ --jsonl "$OUT/context_sweep.jsonl" \
                --png "$OUT/context_sweep.png" 2>&1 | tail -8
              tar czf "$OUT/sweep_rundirs.tgz" -C /tmp/bench $(cd /tmp/bench && ls -d qwen7b-stream-sweep*) ;;
    moetests) STREAMTRAIN_ATTN_AUTOTUNE=0 timeout 100 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
                tests/test_moe_vs_hf.py tests/test_hf_moe.py > "$OUT/gpu_moe_tests.log" 2>&1
              tail -6 "$OUT/gpu_moe_tests.log" ;;
    moe120|moe20|moe30) job=$(case $stage in moe120) echo gptoss120b-4l;; moe20) echo gptoss20b;; *) echo qwen3-30b-a3b;; esac)
                        timeout $((${JOB_S:-280} + 20)) python3 bench/bench_engine.py --grid moe8 \
                          --only "$job-stream-16k-eager" --out "$OUT/engine.jsonl" --workdir /tmp/bench \
                          --timeout-s ${JOB_S:-280} 2>&1 | tail -4 ;;
    # issue 5: qwen7b at 512K in a process of its own session, so that it outlives this call while the machine is
    # held by the next ones (ctx512wait); each call copies the run's log and metrics back
    ctx512) mkdir -p /tmp/bench
            setsid nohup python3 train.py +experiment=qwen7b_512k_h200 logger=none hydra.run.dir=/tmp/bench/ctx512k \
              > /tmp/bench/ctx512k.log 2>&1 < /dev/null &
            echo "started pid $!" ;;
    ctx512wait) end=$((SECONDS + ${WAIT_S:-500}))
                while [ $SECONDS -lt $end ] && pgrep -f "hydra.run.dir=/tmp/bench/ctx512k" > /dev/null; do sleep 5; done
                mkdir -p "$OUT/ctx512k"; cp /tmp/bench/ctx512k.log "$OUT/ctx512k/"
                cp /tmp/bench/ctx512k/*.json* "$OUT/ctx512k/" 2>/dev/null; tail -5 /tmp/bench/ctx512k.log
                nvidia-smi --query-gpu=memory.used --format=csv; free -g | head -2 ;;
    moecompiled) timeout 560 python3 bench/bench_engine.py --grid moe8 --only compiled --out "$OUT/engine.jsonl" \
                   --workdir /tmp/bench --timeout-s 180 2>&1 | tail -8 ;;
    nvme) mkdir -p /tmp/nvme; timeout 120 python3 bench/bench_nvme.py --dir /tmp/nvme --out "$OUT/nvme.jsonl" 2>&1 \
            | tail -3
          timeout 440 python3 bench/bench_engine.py --grid nvme7 --out "$OUT/engine.jsonl" --workdir /tmp/bench \
            --timeout-s 420 2>&1 | tail -4 ;;
    nvmerun) mkdir -p /tmp/nvme /tmp/bench  # the qwen14b job alone, its run dir's records back (NVME_S: time limit)
             timeout ${NVME_S:-520} python3 train.py +experiment=qwen14b_fp32_nvme_h200 hardware.nvme_dir=/tmp/nvme \
               data=stdlib train.steps=3 logger=none hydra.run.dir=/tmp/bench/qwen14b-nvme > "$OUT/qwen14b_nvme.log" 2>&1
             tail -12 "$OUT/qwen14b_nvme.log"
             cp /tmp/bench/qwen14b-nvme/metrics.jsonl /tmp/bench/qwen14b-nvme/summary.json "$OUT/" 2>/dev/null ;;
    nvmeab) mkdir -p /tmp/nvme; timeout 120 python3 bench/bench_nvme.py --dir /tmp/nvme --out "$OUT/nvme.jsonl" 2>&1 \
              | tail -3
            timeout 440 python3 bench/bench_engine.py --grid nvme7ab --out "$OUT/engine.jsonl" --workdir /tmp/bench \
              --timeout-s 210 2>&1 | tail -4 ;;
    modelsize) timeout 560 python3 train.py +sweep=model_size logger=none hydra.sweep.dir=/tmp/msweep \
                 train.steps=3 > "$OUT/model_size_sweep.log" 2>&1; tail -4 "$OUT/model_size_sweep.log"
               python3 -m engine.report /tmp/msweep --x published_params --png "$OUT/model_size.png" \
                 --jsonl "$OUT/model_size.jsonl" 2>&1 | tail -8
               (cd /tmp/msweep && tar czf "$OUT/model_size_logs.tgz" */train.log */summary.json */metrics.jsonl) ;;
    sweep128k) timeout ${SWEEP_S:-480} python3 train.py +sweep=model_size model=${SWEEP_MODELS:-qwen7b,qwen72b} \
                 train.grad_accum=32 logger=none hydra.sweep.dir=/tmp/msweep128 train.steps=3 \
                 > "$OUT/model_size_128k.log" 2>&1
               tail -4 "$OUT/model_size_128k.log"
               python3 -m engine.report /tmp/msweep128 --x published_params --png "$OUT/model_size_128k.png" \
                 --jsonl "$OUT/model_size_128k.jsonl" 2>&1 | tail -8
               (cd /tmp/msweep128 && tar czf "$OUT/model_size_128k_logs.tgz" */train.log */summary.json \
                  */metrics.jsonl) ;;
    peers) timeout 200 python3 bench/peers/all_on_gpu.py --model qwen7b --micro-batch-size 2 --grad-accum 8 \
             --out "$OUT/peers.jsonl" 2>&1 | tail -3 ;;
  esac
done
[ -d /tmp/bench ] && tar czf "$OUT/logs.tgz" -C /tmp/bench $(cd /tmp/bench && ls *.log)
ls "$OUT"
