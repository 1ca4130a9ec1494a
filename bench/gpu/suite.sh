#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend (docs/gpu-development.md):
# measurement stages, run in the order given. Each python run has its own time limit and a
# hard timeout, so one slow stage cannot hold up the rest. Results: $OUT/<stage>.json and
# .log (OUT defaults to bench/results/gpu, git-ignored), merged into $OUT/all.json.
#
#   bash bench/gpu/suite.sh table                 # the performance table: compiled PyTorch,
#                                                 # the engine as served, report.py over both
#   bash bench/gpu/suite.sh test kernel-test      # the GPU tests that gate the later stages
#   TABLE_CONFIGS=8b:q4 TABLE_BATCHES=1 bash bench/gpu/suite.sh engine-table
#   PROFILE_CONFIGS=8b:q4 PROFILE_BATCHES=1 bash bench/gpu/suite.sh profile
#
# Stages: the engine as served (engine-table, table, engine-ab, engine-1b, engine-1b-cold,
# first-request, prefill-together); tests (test, kernel-test, mma-test, attn-test, qs-test,
# prefill-test, qgemm-test, b1-test, stage-check); kernels alone (attn-bench, attn-tc,
# q4-bench, qgemm-sweep, qgemm-sk, wgmma, b128-nx, b128-we, dequant, mma-peak, read-bw,
# b1-read, b1-q4, pool, sampler); prefill (prefill-ab, prefill-async, prefill-small,
# prefill-profile, prefill-stages, rope-ab, cudnn); the step's kernels and host time
# (profile, b1-profile, b1-graph, worker-timeline); MLX itself (1b-bf16, 1b-q4, 8b-bf16,
# 8b-q4, env, matmul, ragged-1b, ragged-8b, ab, plans); save-ptx (the PTX cache as a tgz).
set -uo pipefail
source bench/gpu/env.sh
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
B="python3 bench/gpu/bench_decode.py --gpu-name=${GPU// /_}"
E="python3 bench/gpu/bench_engine.py --gpu-name=${GPU// /_}"
# engine-1b's model; a CPU dry run of the stage: ENGINE_MODEL=tiny ENGINE_QUANT=f32
EM="--model ${ENGINE_MODEL:-1b} --quant ${ENGINE_QUANT:-bf16}"
# copies of the PTX and CUDA driver caches as they are now, one per run of a pair,
# so that the first run's compiles cannot help the second
snapshot_caches() {
    local nv=${CUDA_CACHE_PATH:-$HOME/.nv/ComputeCache}
    for w in "$@"; do
        rm -rf "/tmp/ptx-$w" "/tmp/nv-$w"
        mkdir -p "/tmp/ptx-$w" "/tmp/nv-$w"
        cp -r "$MLX_PTX_CACHE_DIR"/. "/tmp/ptx-$w/" 2>/dev/null || true
        cp -r "$nv"/. "/tmp/nv-$w/" 2>/dev/null || true
    done
}
# TABLE_PIN=1: the table's processes on one logical CPU per physical core (cpu_pin.sh)
PIN=""
if [ "${TABLE_PIN:-0}" = 1 ]; then
    PIN="taskset -c $(python3 -c 'import glob; print(",".join(sorted({open(p).read().strip().split(",")[0].split("-")[0] for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list")}, key=int)))')"
fi
# attn-bench's winner (MARKBASE_GPU_ATTN_*, ATTN_BEST), for the later stages and for
# later calls on the same warm machine; ATTN_ENV=0 leaves the code's default shape
if [ "${ATTN_ENV:-1}" = 1 ] && [ -f /tmp/attn.env ]; then
    source /tmp/attn.env
fi
for stage in "$@"; do
    echo "=== $stage ($(date +%T))"
    case "$stage" in
    test)
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/backends/cuda/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
        ;;
    1b-bf16)
        timeout 200 $B --models 1b --quants bf16 --variants async,fused,fused_async,worker \
            --variant-batches 1,8,32,128 --chunk 0 --time-limit-s 170 --out "$OUT/1b-bf16.json"
        ;;
    1b-q4)
        timeout 150 $B --models 1b --quants q4 --variants async,fused_async \
            --variant-batches 1,8,32,128 --chunk 0 --time-limit-s 120 --out "$OUT/1b-q4.json"
        ;;
    env)  # MLX's CUDA-graph knobs: one graph per step, and no graphs at all
        MLX_MAX_OPS_PER_BUFFER=4000 MLX_MAX_MB_PER_BUFFER=100000 timeout 90 $B --models 1b --quants bf16 \
            --batches 1,32,128 --variants async --variant-batches 1,32,128 --prefill 0 --time-limit-s 70 \
            --tag ops4000 --out "$OUT/env-ops4000.json"
        MLX_USE_CUDA_GRAPHS=0 timeout 90 $B --models 1b --quants bf16 \
            --batches 1,32,128 --variants async --variant-batches 1,32,128 --prefill 0 --time-limit-s 70 \
            --tag nographs --out "$OUT/env-nographs.json"
        ;;
    matmul)
        timeout 60 $B --matmul --models 1b --quants bf16,q4 --batches 1,8,32,128 --out "$OUT/matmul.json"
        ;;
    8b-bf16)
        timeout 200 $B --models 8b --quants bf16 --variants async,fused_async --variant-batches 1,32 \
            --chunk 0 --time-limit-s 170 --out "$OUT/8b-bf16.json"
        ;;
    8b-q4)
        timeout 150 $B --models 8b --quants q4 --batches 1,8,32 --steps 64 --variants async \
            --variant-batches 1,32 --chunk 0 --time-limit-s 120 --out "$OUT/8b-q4.json"
        ;;
    ragged-1b)  # rows of different lengths (a mask every step), the real worker, and fixes
        timeout 240 $B --models 1b --quants bf16 --batches 1,8,32,128 --variant-batches 8,32,128 \
            --variants ragged,ragged+gqa,ragged+gqa+fused,ragged+gqa+fused+async,fused+async,worker,worker+gqa,worker+gqa+fused \
            --prefill 0 --time-limit-s 210 --out "$OUT/ragged-1b.json"
        ;;
    ragged-8b)
        timeout 150 $B --models 8b --quants bf16 --batches 32,128 --variant-batches 32,128 \
            --variants ragged,ragged+gqa,ragged+gqa+fused+async,fused+async \
            --prefill 0 --time-limit-s 120 --out "$OUT/ragged-8b.json"
        ;;
    ab)  # the main variants interleaved three times in one process: how large is the noise?
        timeout 200 $B --models 1b --quants bf16 --batches 1,32,128 --variant-batches 1,32,128 --repeat 3 \
            --variants async,fused,fused+async,ragged,ragged+gqa,ragged+gqa+fused+async \
            --prefill 0 --time-limit-s 170 --out "$OUT/ab.json"
        ;;
    plans)  # which formulation of the decode products wins per row count (engine/backends/cuda/linear.py);
        # later stages of this call run with the winners (exported)
        timeout ${PLANS_TIMEOUT:-200} python3 bench/gpu/matmul_rows.py --rows ${PLAN_ROWS:-1,8,32,128} \
            --out "$OUT/matmul_rows.json" --plans "$OUT/plans.env"
        [ -f "$OUT/plans.env" ] && source "$OUT/plans.env" && cat "$OUT/plans.env"
        ;;
    engine-table)  # the engine as served (ModelWorker: fused step, GQA under masks, pipelined
        # loop, ragged rows), 1b/8b x bf16/q4 at B=1,8,32,128, plus a 2k-token prefill
        for mq in ${TABLE_CONFIGS:-1b:bf16 1b:q4 8b:bf16 8b:q4}; do
            m=${mq%%:*} q=${mq##*:} steps=128
            [ "$q" = q4 ] && [ "$m" = 8b ] && steps=48  # ~100+ ms steps
            timeout ${TABLE_TIMEOUT:-150} $PIN $B --models "$m" --quants "$q" --batches 1 --variants worker \
                --variant-batches "${TABLE_BATCHES:-1,8,32,128}" --steps $steps --chunk 0 \
                --time-limit-s $(( ${TABLE_TIMEOUT:-150} - 20 )) --out "$OUT/table-$m-$q${PIN:+-pinned}${TABLE_TAG:+-$TABLE_TAG}.json"
        done
        ;;
    table)  # the performance table in one command: compiled PyTorch (static cache, CUDA
        # graphs, the copy bandwidth for the floor) first, then the engine as served for
        # 1b/8b x bf16/4-bit at B=1,8,32,128 with 2k prefill, then report.py over both
        timeout ${TORCH_TIMEOUT:-240} python3 bench/gpu/torch_ref.py --models 8b,1b \
            --batches "${TABLE_BATCHES:-1,8,32,128}" --out "$OUT/torch.json" 2>&1 | grep -v -i warn
        cp "$OUT/torch.json" /tmp/table-torch.json
        TABLE_BATCHES=${TABLE_BATCHES:-1,8,32,128} bash "$0" engine-table
        python3 bench/gpu/report.py "$OUT/all.json" /tmp/table-torch.json | tee "$OUT/table.md"
        ;;
    engine-ab)  # the fused step with the hidden state [B, 1, D] vs [B, D]
        # (the GPU default), ragged rows, interleaved in one process per model; the
        # per-layer pieces under mx.compile ("compiled2d"); bf16 also with the float plan
        # wxt at 8-31 rows ("wxt8")
        for mq in ${AB_CONFIGS:-1b:q4 8b:q4 1b:bf16 8b:bf16}; do
            m=${mq%%:*} q=${mq##*:} v=${AB_VARIANTS:-fused3d,fused2d,compiled2d} to=${AB_TIMEOUT:-110}
            [ "$q" = bf16 ] && v=$v,wxt8
            [ "$mq" = 1b:q4 ] && to=$(( to + 60 ))  # first 4-bit kernels JIT-compile here
            timeout $to $E ab --model "$m" --quant "$q" --batches "${AB_BATCHES:-1,8,32,128}" \
                --variants $v --shapes ragged --repeat "${AB_REPEAT:-2}" --steps "${AB_STEPS:-32}" \
                --time-limit-s $(( to - 25 )) --out "$OUT/ab-$m-$q.json"
        done
        ;;
    engine-1b)  # the engine's fused decode step vs unfused (ModelRunner), then warm-up off/on
        timeout 70 $E ab $EM --batches 1,8,32 --repeat 3 --time-limit-s 40 \
            --out "$OUT/engine-ab.json"
        snapshot_caches off on  # both runs start from the caches the A/B run left
        for w in off on; do
            MLX_PTX_CACHE_DIR=/tmp/ptx-$w CUDA_CACHE_PATH=/tmp/nv-$w timeout 35 $E first-request \
                --warmup $w $EM --out "$OUT/engine-first-$w.json"
        done
        cp -rn /tmp/ptx-on/. "$MLX_PTX_CACHE_DIR"/ 2>/dev/null || true
        ;;
    engine-1b-cold)  # the same pair from empty caches: a machine's very first start
        for w in cold-off cold-on; do
            rm -rf "/tmp/ptx-$w" "/tmp/nv-$w"
            MLX_PTX_CACHE_DIR=/tmp/ptx-$w CUDA_CACHE_PATH=/tmp/nv-$w timeout 90 $E first-request \
                --warmup "${w#cold-}" $EM --out "$OUT/engine-first-$w.json"
        done
        ;;
    kernel-test)  # the attention kernel against grouped attention, then the
        # end-to-end GPU test; if they fail, the later stages run MLX's attention
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/backends/cuda/test_gpu_attention.py \
            tests/backends/cuda/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
        if [ "${PIPESTATUS[0]}" -ne 0 ]; then
            echo "kernel tests FAILED: MARKBASE_GPU_ATTENTION=mlx for the later stages"
            export MARKBASE_GPU_ATTENTION=mlx
        fi
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/backends/cuda/test_gpu_gemv.py tests/backends/cuda/test_gpu_mma.py 2>&1 \
            | tee "$OUT/test_gpu_gemv.log"
        if [ "${PIPESTATUS[0]}" -ne 0 ]; then
            echo "product kernel tests FAILED: MLX's products (plans 1:xwt, 1:qmm) for the later stages"
            export MARKBASE_GPU_FLOAT_PLAN=1:xwt MARKBASE_GPU_QUANT_PLAN=1:qmm
        fi
        ;;
    mma-test)  # the tensor-core product kernels against float32 products, and
        # the host time per call of each product formulation; if the tests fail, the
        # later stages keep the products off the new kernels
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/backends/cuda/test_gpu_mma.py 2>&1 \
            | tee "$OUT/test_gpu_mma.log"
        if [ "${PIPESTATUS[0]}" -ne 0 ]; then
            echo "mma tests FAILED: the later stages leave them out"
            export MARKBASE_NO_MMA=1
        fi
        timeout 120 python3 bench/gpu/call_cost.py --out "$OUT/call_cost.json" 2>&1 | tee "$OUT/call_cost.log"
        ;;
    attn-test)  # the attention kernel's tests, every loop shape (before attn-bench)
        timeout 400 python3 -m pytest -q -p no:cacheprovider tests/backends/cuda/test_gpu_attention.py 2>&1 \
            | tee "$OUT/test_attn.log"
        ;;
    attn-bench)  # the attention kernel alone per loop shape (CUPTI); the best
        # shape over all shapes goes to /tmp/attn.env, which the later stages use
        to=${ATTN_TIMEOUT:-220}
        timeout $to python3 bench/gpu/attn_bench.py --time-limit-s $(( to - 40 )) \
            ${ATTN_VARIANTS:+--variants $ATTN_VARIANTS} ${ATTN_SHAPES:+--shapes $ATTN_SHAPES} \
            --out "$OUT/attn.json" --env /tmp/attn.env 2>&1 | tee "$OUT/attn.log"
        if [ -f /tmp/attn.env ]; then
            source /tmp/attn.env
            cat /tmp/attn.env
        fi
        ;;
    qs-test)  # the streamed 1-row 4-bit kernels' tests
        timeout ${QS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_qstream.py 2>&1 | tee "$OUT/test_qs.log"
        ;;
    prefill-test)  # the prefill attention kernel and the dequantize route
        timeout ${PT_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_prefill_attention.py tests/backends/cuda/test_gpu_prefill.py 2>&1 | tee "$OUT/test_prefill.log"
        ;;
    prefill-ab)  # the prefill attention kernel's forms alone against MLX's; then
        # 2048-token prefill with engine/backends/cuda/attention/prefill.py and engine/backends/cuda/prefill.py
        # on and off (both on by default); then qmm vs deq by row count
        timeout ${PK_TIMEOUT:-90} python3 bench/gpu/prefill_attn_bench.py --out "$OUT/prefill_attn.json" \
            2>&1 | tee "$OUT/prefill_attn.log"
        for v in on off; do
            env="MARKBASE_GPU_PREFILL_ATTENTION=kernel MARKBASE_GPU_PREFILL_DEQ_ROWS=256"
            [ $v = off ] && env="MARKBASE_GPU_PREFILL_ATTENTION=mlx MARKBASE_GPU_PREFILL_DEQ_ROWS=0"
            env $env timeout ${PA_TIMEOUT:-150} $B --models ${PA_MODELS:-1b,8b} --quants bf16,q4 \
                --batches 1 --variants "" --steps 8 --prefill 2048 --chunk 512 \
                --time-limit-s $(( ${PA_TIMEOUT:-150} - 20 )) --tag prefill-$v --out "$OUT/prefill-$v.json"
        done
        timeout ${PR_TIMEOUT:-120} python3 bench/gpu/matmul_rows.py --models 8b,1b \
            --rows ${PR_ROWS:-64,128,256,512,2048} --forms xwt,qmm,deq --reps 3 --out "$OUT/prefill_rows.json"
        ;;
    qgemm-test)  # engine/backends/cuda/products/qgemm.py's tests, then its products per layer
        # against gpu_mma's (qmma) at 33-128 rows
        timeout ${QG_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_qgemm.py 2>&1 | tee "$OUT/test_qgemm.log"
        timeout ${QR_TIMEOUT:-120} python3 bench/gpu/matmul_rows.py --models 8b,1b \
            --rows 33,64,128 --forms qmma,qgemm --reps 3 --out "$OUT/qgemm_rows.json"
        ;;
    qgemm-sweep)  # gpu_qgemm's geometry, stages and m-tiles a warp per product
        # (bench/gpu/qgemm_sweep.py), after the two-m-tile form's tests
        timeout ${QS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_qgemm.py -k "two_m_tiles or exact" 2>&1 | tee "$OUT/test_qgemm_mt.log"
        timeout ${QW_TIMEOUT:-150} python3 bench/gpu/qgemm_sweep.py --time-limit-s $(( ${QW_TIMEOUT:-150} - 20 )) \
            --out "$OUT/qgemm_sweep.json" 2>&1 | grep -v -i warn | tee "$OUT/qgemm_sweep.log"
        ;;
    mma-peak)  # mma.sync's and the dequantization's own rates here
        timeout ${MP_TIMEOUT:-120} python3 bench/gpu/mma_peak.py --out "$OUT/mma_peak.json" 2>&1 \
            | grep -v -i warn | tee "$OUT/mma_peak.log"
        ;;
    dequant)  # engine/backends/cuda/products/dequant.py (MARKBASE_GPU_DEQUANT=1): its tests
        # (mx.dequantize's weights bit for bit), the kernel alone against MLX's per product,
        # then 2048-token 4-bit prefill (one chunk and chunks of 512) with it on and off
        timeout ${DQ_TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_dequant.py 2>&1 | tail -8 | tee "$OUT/test_dequant.log"
        timeout ${DQ_TIMEOUT:-120} python3 bench/gpu/dequant_bench.py --out "$OUT/dequant.json" 2>&1 \
            | grep -v -i warn | tee "$OUT/dequant.log"
        for v in 1 0; do
            MARKBASE_GPU_DEQUANT=$v timeout ${PA_TIMEOUT:-150} $B --models ${PA_MODELS:-1b,8b} --quants q4 \
                --batches 1 --variants "" --steps 8 --prefill 2048 --chunk 512 \
                --time-limit-s $(( ${PA_TIMEOUT:-150} - 20 )) --tag dequant-$v --out "$OUT/prefill-dequant-$v.json"
        done
        ;;
    prefill-small)  # prompt chunks under 256 rows on MLX's quantized_matmul
        # or gpu_mma's kernel (MARKBASE_GPU_PREFILL_SMALL=qmma): its tests, then one-chunk
        # prefill of 24 / 100 / 200 tokens each way (tok/s, and the first call's compile)
        timeout ${PS_TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_prefill.py 2>&1 | tail -6 | tee "$OUT/test_prefill_small.log"
        for v in mlx qmma; do
            for n in ${PS_TOKENS:-24 100 200}; do
                MARKBASE_GPU_PREFILL_SMALL=$v timeout ${PS_TIMEOUT:-90} $B --models ${PS_MODELS:-8b,1b} \
                    --quants q4 --batches 1 --variants "" --steps 4 --prefill $n --chunk 0 \
                    --time-limit-s $(( ${PS_TIMEOUT:-90} - 15 )) --tag small-$v-$n \
                    --out "$OUT/prefill-small-$v-$n.json" 2>&1 | grep -E "prefill|rror"
            done
        done
        ;;
    prefill-together)  # whole new prompts of a step in one forward
        # (ModelRunner.prefill_together): its GPU tests, then the first-request run's bursts
        # (8 and 48 requests of 256-token prompts) with it on and off
        timeout ${PG_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_prefill.py tests/engine/test_runner_prefill.py tests/engine/test_prefill_groups.py 2>&1 \
            | tail -6 | tee "$OUT/test_prefill_together.log"
        for v in 1 0; do
            MARKBASE_PREFILL_TOGETHER=$v timeout ${PG_TIMEOUT:-150} $E first-request --warmup on $EM \
                --lengths 97,300 --out "$OUT/first-together-$v.json" 2>&1 | grep -E "burst|start"
        done
        ;;
    worker-timeline)  # the served engine's step, host phases and GPU
        # kernels on one clock (bench/gpu/worker_timeline.py): does the host bind at B=128?
        for mqb in ${TL_CONFIGS:-8b:q4:128 1b:q4:128}; do
            m=${mqb%%:*} rest=${mqb#*:} q=${rest%%:*} b=${rest##*:}
            timeout ${TL_TIMEOUT:-150} python3 bench/gpu/worker_timeline.py --model "$m" --quant "$q" \
                --batch "$b" --out "$OUT/timeline-$m-$q-$b.json" 2>&1 | grep -v -i "warn\|USDT" \
                | tee -a "$OUT/timeline.log"
        done
        ;;
    qgemm-sk)  # gpu_qgemm's stream-K form (MARKBASE_GPU_QGEMM_SK): its
        # tests (exact, deterministic, counters left at zero, the decode step), then every
        # product of the 8b and 1b models at 64 and 128 rows, one tile a block vs stream-K
        timeout ${QT_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_qgemm.py -k "stream_k or decode_step or warm" 2>&1 | tail -15 \
            | tee "$OUT/test_qgemm_sk.log"
        timeout ${QW_TIMEOUT:-280} python3 bench/gpu/qgemm_sweep.py --time-limit-s $(( ${QW_TIMEOUT:-280} - 20 )) \
            --rows ${QW_ROWS:-128,64} --forms ${QW_FORMS:-r:2:0,s:2:0,r:2:0:0:w8,s:2:0:0:w8} \
            --products ${QW_PRODUCTS:-qkv,o,gate_up,down,lm_head} \
            --out "$OUT/qgemm_sk.json" 2>&1 | grep -v -i warn | tee "$OUT/qgemm_sk.log"
        ;;
    b1-test)  # the 1-row products' early loads, the L2 prefetch
        timeout ${B1_TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_prefetch.py tests/backends/cuda/test_gpu_qstream.py -k "prefetch or early or decode_step" \
            2>&1 | tail -25 | tee "$OUT/test_b1.log"
        ;;
    b1-read)  # the fastest one read kernel gets through each 8b product
        timeout ${B1_READ_TIMEOUT:-150} python3 bench/gpu/read_bw.py --sizes-mb 9.0,13.5,31.5,63.0,281.8 \
            --out "$OUT/read_sizes.json" 2>&1 | grep -v -i warn | tee "$OUT/read_sizes.log"
        ;;
    b1-profile)  # 8b 4-bit one row, the step's kernels (CUPTI) with
        # the early loads (-qe), the L2 prefetch (-pf<MB>) and the RMSNorm folded in (-qn1)
        PROFILE_CONFIGS=8b:q4 PROFILE_BATCHES=1 PROFILE_TIMEOUT=${B1_TIMEOUT:-300} \
            PROFILE_VARIANTS=${B1_VARIANTS:-default-wc,default-wc-qe,default-wc-pf12,default-wc-qe-pf12,default-wc-qe-qn1,default-wc-qe-qn1-pf12} \
            bash "$0" profile
        ;;
    b1-q4)  # each 8b 1-row product alone (CUPTI): as now, its first
        # loads early (e), and the stream without the math (a: issue-bound or not?)
        Q4_VARIANTS=${B1_Q4:-qi,qie,qia,qiea} bash "$0" q4-bench
        ;;
    b1-graph)  # the same with one CUDA graph a step (MLX commits one
        # every 100 nodes or 1,000 MB of inputs on sm_90: ~5 a step at 8b 4-bit)
        PROFILE_TAG=graph MLX_MAX_OPS_PER_BUFFER=2000 MLX_MAX_MB_PER_BUFFER=100000 B1_VARIANTS=${B1_GRAPH_VARIANTS:-default-wc} \
            bash "$0" b1-profile
        ;;
    b128-nx)  # gpu_wgmma with x copied 2-3 steps ahead (4 warpgroups):
        # exactness, then 8b gate/up and the output layer
        # at 128 rows, then the engine at 8b 4-bit B=128 with 5 buffers and with 3
        timeout ${NX_CHECK_TIMEOUT:-100} python3 bench/gpu/wgmma_bench.py --check-only \
            --check-forms 4:4,5:4 2>&1 | grep -v -i warn | tail -32 | tee "$OUT/wgmma_nx_check.log"
        timeout ${NX_TIMEOUT:-150} python3 bench/gpu/wgmma_bench.py --skip-check --models 8b \
            --rows 128 --forms 3:4,4:4,5:4 --products gate_up,lm_head --reps 3 --calls 10 \
            --time-limit-s $(( ${NX_TIMEOUT:-150} - 30 )) --out "$OUT/wgmma_nx.json" 2>&1 | grep -v -i warn | tee "$OUT/wgmma_nx.log"
        for nx in ${NX_ENGINE:-5 3}; do
            MARKBASE_GPU_WGMMA_NX=$nx TABLE_CONFIGS=8b:q4 TABLE_BATCHES=128 TABLE_TAG=nx$nx \
                bash "$0" engine-table
        done
        ;;
    pool)  # what one scalar read out of MLX's pool of tiny arrays
        # (managed memory) costs a read kernel of o_proj's size, with and without the host
        # reading that pool between evaluations
        timeout ${POOL_TIMEOUT:-60} python3 bench/gpu/pool_cost.py --out "$OUT/pool_cost.json" \
            2>&1 | grep -v -i warn | tee "$OUT/pool_cost.log"
        ;;
    prefill-stages)  # a prompt chunk's forward queued at some layers
        # (engine/backends/cuda/prefill_stages.py) so the GPU starts while the host builds the rest,
        # against none (the profile showed the GPU idle ~3.3 ms of an 11 ms 1b chunk),
        # interleaved in one process; then the 1b 4-bit default with the RoPE offset as
        # MLX's pool scalar (MARKBASE_GPU_ROPE_DEVICE_OFFSET=0): compare its rope kernel
        timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/backends/cuda/test_prefill_stages.py \
            2>&1 | grep -v -i warn | tail -4 | tee "$OUT/test_stages.log"  # staged = unstaged, on the GPU
        timeout ${PS_TIMEOUT:-150} python3 bench/gpu/profile_prefill.py --models ${PS_MODELS:-1b,8b} \
            --quants ${PS_QUANTS:-bf16,q4} --variants ${PS_VARIANTS:-unstaged,default,unstaged,default} \
            --time-limit-s $(( ${PS_TIMEOUT:-150} - 30 )) --out "$OUT/prefill_stages.json" 2>&1 \
            | grep -v -i warn | tee "$OUT/prefill_stages.log"
        MARKBASE_GPU_ROPE_DEVICE_OFFSET=0 timeout ${PS_ROPE_TIMEOUT:-60} python3 bench/gpu/profile_prefill.py \
            --models 1b --quants q4 --variants default --time-limit-s 40 --out "$OUT/prefill_rope0.json" 2>&1 \
            | grep -v -i warn | tee "$OUT/prefill_rope0.log"
        ;;
    stage-check)  # staged prompt chunks on the GPU: the differences, unstaged
        # twice and staged vs unstaged (all 0 on an H100), then the stages' test in full
        timeout ${SC_TIMEOUT:-120} python3 bench/gpu/stage_check.py 2>&1 | grep -v -i warn \
            | tee "$OUT/stage_check.log"
        timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=long -x tests/backends/cuda/test_prefill_stages.py \
            2>&1 | grep -v -i warn | tail -60 > "$OUT/test_stages_long.log"
        ;;
    sampler)  # engine/sampler.py's batched draw on the GPU against a per-row form and
        # mlx-lm's make_sampler, llama-3 vocabulary, B=1..128, bf16 logits as the output
        # layer gives them (engine/backends/cuda/sampler.py's kernel at every B: MIN_ROWS 1);
        # the sampler's tests first
        timeout ${SAMPLER_TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/engine/test_sampler.py 2>&1 | grep -v -i warn | tail -12 | tee "$OUT/test_sampler.log"
        MARKBASE_GPU_SAMPLER_MIN_ROWS=1 \
            timeout ${SAMPLER_TIMEOUT:-120} python3 bench/cpu/sampler_bench.py --vocab 128256 \
            --dtype ${SAMPLER_DTYPE:-bfloat16} --batches 1,8,32,128 --reps 10 2>&1 \
            | grep -v -i warn | tee "$OUT/sampler.md"
        ;;
    rope-ab)  # prompt chunks' RoPE offsets in device memory
        # (engine/backends/cuda/rope_offsets.py) or as mx.fast.rope's pool scalar: 2k prefill and B=1,
        # off/on twice, one process each
        for v in 0 1 0 1; do
            MARKBASE_GPU_ROPE_DEVICE_OFFSET=$v TABLE_CONFIGS="${ROPE_CONFIGS:-1b:q4}" TABLE_BATCHES=1 \
                TABLE_TIMEOUT=${ROPE_TIMEOUT:-80} TABLE_TAG=rope$v bash "$0" engine-table 2>&1 | grep -E "prefill|worker "
        done
        ;;
    b128-we)  # gpu_wgmma with each k-step's weight loads right after
        # its wgmma (MARKBASE_GPU_WGMMA_WEARLY=1): exactness, the 8b products at 128 rows,
        # then the engine at 8b 4-bit B=128 with it and without
        timeout ${WE_CHECK_TIMEOUT:-100} python3 bench/gpu/wgmma_bench.py --check-only \
            --check-forms 3:4w 2>&1 | grep -v -i warn | tail -17 | tee "$OUT/wgmma_we_check.log"
        timeout ${WE_TIMEOUT:-150} python3 bench/gpu/wgmma_bench.py --skip-check --models 8b \
            --rows 128 --forms 3:4,3:4w,4:4w --products gate_up,lm_head --reps 3 --calls 10 \
            --time-limit-s $(( ${WE_TIMEOUT:-150} - 30 )) --out "$OUT/wgmma_we.json" 2>&1 | grep -v -i warn | tee "$OUT/wgmma_we.log"
        for we in ${WE_ENGINE:-1 0}; do
            MARKBASE_GPU_WGMMA_WEARLY=$we TABLE_CONFIGS=8b:q4 TABLE_BATCHES=128 TABLE_TAG=we$we \
                bash "$0" engine-table
        done
        ;;
    wgmma)  # engine/backends/cuda/products/wgmma.py (Hopper warpgroup MMA for the 4-bit
        # products of 33-128 rows): the exactness table of every form (both descriptor
        # readings, both x pipelines), its tests, then each 8b/1b product at 128 and 64 rows
        # against the kernel the step uses now
        timeout ${WG_CHECK_TIMEOUT:-120} python3 bench/gpu/wgmma_bench.py --check-only \
            --out "$OUT/wgmma_check.json" 2>&1 | grep -v -i warn | tee "$OUT/wgmma_check.log"
        [ "${WG_TEST:-1}" = 1 ] && timeout ${WG_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
            --tb=short -x tests/backends/cuda/test_gpu_wgmma.py 2>&1 | tail -15 | tee "$OUT/test_wgmma.log"
        timeout ${WG_TIMEOUT:-200} python3 bench/gpu/wgmma_bench.py --time-limit-s $(( ${WG_TIMEOUT:-200} - 40 )) \
            --rows ${WG_ROWS:-128,64} --forms ${WG_FORMS:-3:2,4:2,3:4} --models ${WG_MODELS:-8b,1b} \
            --skip-check --out "$OUT/wgmma.json" 2>&1 | grep -v -i warn | tee "$OUT/wgmma.log"
        ;;
    attn-tc)  # engine/backends/cuda/attention/decode_tc.py's tests, then the kernel alone against
        # the CUDA-core shapes at the batch sizes it would take (unsplit launches)
        timeout ${TC_TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/backends/cuda/test_gpu_attention.py -k "tensor_core or cp100000 or cs" 2>&1 | tail -15 | tee "$OUT/test_attn_tc.log"
        to=${TC_TIMEOUT:-150}
        timeout $to python3 bench/gpu/attn_bench.py --time-limit-s $(( to - 30 )) \
            --variants ${TC_VARIANTS:-auto,tcw4k16,tcw2k32,tcw8k16,tcw4k32,tcsw8k16,tcsw4k32,tcsw4k16} \
            --shapes ${TC_SHAPES:-8b:128:512,1b:128:512,8b:64:512,8b:1:600,8b:8:600,1b:1:600,8b:1:2000} \
            --out "$OUT/attn_tc.json" 2>&1 | grep -v -i warn | tee "$OUT/attn_tc.log"
        ;;
    prefill-async)  # MARKBASE_PREFILL_ASYNC=0/1 (engine/runner.py): an 8192-token
        # prompt in chunks of 512, each chunk waited on (0) or queued (1)
        for v in 0 1; do
            MARKBASE_PREFILL_ASYNC=$v timeout ${PS_TIMEOUT:-120} $B --models ${PS_MODELS:-1b,8b} \
                --quants bf16,q4 --batches 1 --variants "" --steps 8 --prefill 8192 --chunk 512 \
                --time-limit-s $(( ${PS_TIMEOUT:-120} - 20 )) --tag prefill-async$v --out "$OUT/prefill-async$v.json"
        done
        ;;
    prefill-profile)  # a 2048-token chunk's kernels (CUPTI): bf16 vs 4-bit, the
        # dequantize route vs quantized_matmul, the prompt attention kernel vs MLX's
        timeout ${PP_TIMEOUT:-200} python3 bench/gpu/profile_prefill.py --models ${PP_MODELS:-1b,8b} \
            --time-limit-s $(( ${PP_TIMEOUT:-200} - 30 )) --out "$OUT/prefill_profile.json" 2>&1 \
            | grep -v Warn | tee "$OUT/prefill_profile.log"
        ;;
    read-bw)  # what an MLX kernel reads from HBM here, device vs managed memory,
        # against PyTorch's sum and copy in the same process
        timeout ${READ_TIMEOUT:-150} python3 bench/gpu/read_bw.py --out "$OUT/read_bw.json" 2>&1 \
            | grep -v Warn | tee "$OUT/read_bw.log"
        ;;
    q4-bench)  # 1-row 4-bit products per launch shape (u = loads in flight a
        # lane, w = warps a block, p1 = PIN), CUPTI
        timeout ${Q4_TIMEOUT:-200} python3 bench/gpu/q4_bench.py --model ${Q4_MODEL:-8b} \
            --time-limit-s $(( ${Q4_TIMEOUT:-200} - 40 )) ${Q4_VARIANTS:+--variants $Q4_VARIANTS} \
            --out "$OUT/q4.json" 2>&1 | tee "$OUT/q4.log"
        ;;
    profile)  # kernels and GPU busy time per step (CUPTI), attention kernel vs MLX's
        for mq in ${PROFILE_CONFIGS:-8b:q4 1b:bf16 8b:bf16 1b:q4}; do
            m=${mq%%:*} q=${mq##*:} to=${PROFILE_TIMEOUT:-100}
            timeout $to python3 bench/gpu/profile_step.py --model "$m" --quant "$q" \
                --batches "${PROFILE_BATCHES:-1,8,32,128}" \
                --variants "${PROFILE_VARIANTS:-default${ATTN_BEST:+,default-at$ATTN_BEST}}" \
                --steps "${PROFILE_STEPS:-48}" --repeat "${PROFILE_REPEAT:-2}" \
                --time-limit-s $(( to - 20 )) --out "$OUT/profile-$m-$q${PROFILE_TAG:+-$PROFILE_TAG}.json"
        done
        ;;
    first-request)  # the first request after start, warm-up off and on (fresh processes,
        # each from a copy of the caches as they are now)
        snapshot_caches off on cudnn0
        for w in off on; do
            MLX_PTX_CACHE_DIR=/tmp/ptx-$w CUDA_CACHE_PATH=/tmp/nv-$w timeout ${FR_TIMEOUT:-150} $E first-request \
                --warmup $w $EM --out "$OUT/engine-first-$w.json"
        done
        # MLX's cuDNN attention off: prefill attention without a per-shape cuDNN graph
        MLX_CUDA_USE_CUDNN_SDPA=0 MLX_PTX_CACHE_DIR=/tmp/ptx-cudnn0 CUDA_CACHE_PATH=/tmp/nv-cudnn0 \
            timeout ${FR_TIMEOUT:-150} $E first-request --warmup on $EM --out "$OUT/engine-first-on-cudnn0.json"
        ;;
    cudnn)  # prefill with MLX's cuDNN attention on (MLX's default) and off
        # (markbase's default): what avoiding cuDNN's per-shape graph costs prefill
        for v in 1 0; do
            MLX_CUDA_USE_CUDNN_SDPA=$v timeout 120 $B --models ${CUDNN_MODELS:-1b,8b} --quants bf16 \
                --batches 1 --variants "" --steps 16 --prefill 2048 --chunk 512 --time-limit-s 100 \
                --tag cudnn$v --out "$OUT/cudnn$v.json"
        done
        ;;
    save-ptx)  # the PTX cache as $OUT/ptx.tgz, to restore on a fresh machine (env.sh)
        tar czf "$OUT/ptx.tgz" -C "$(dirname "$MLX_PTX_CACHE_DIR")" "$(basename "$MLX_PTX_CACHE_DIR")"
        ls -l "$OUT/ptx.tgz"
        ;;
    *) echo "unknown stage $stage" ;;
    esac
done
# one file for all stages; a later suite.sh with the same OUT adds to it rather than
# overwriting it
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
files = sorted(f for f in glob.glob(f"{out}/*.json") if not f.endswith("/all.json"))
path = f"{out}/all.json"
docs = json.load(open(path)) if os.path.exists(path) else []
docs += [dict(json.load(open(f)), stage=os.path.basename(f)[:-5]) for f in files]
json.dump(docs, open(path, "w"), indent=1)
for f in files:
    os.remove(f)
PY
echo "=== done ($(date +%T))"
