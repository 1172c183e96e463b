#!/usr/bin/env bash
# one-off device run (not committed)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export BENCH_OUT=$OUT/results PYTHONUNBUFFERED=1
mkdir -p $BENCH_OUT
L=$OUT/log.txt
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv >> $L
(timeout 120 python3 -m pytest -q -m gpu tests/chunked/test_frozen_head.py -p no:cacheprovider 2>&1 | tail -5) >> $L
echo "== diag frozen" >> $L; timeout 150 python3 -m benchmark.experiments.diag_frozen_head >> $L 2>&1
echo "== bench frozen" >> $L; timeout 60 python3 -m benchmark.bench_fused_linear_ce --frozen --quick --providers ours,gemms,liger-kernel >> $L 2>&1
echo "== 8B grpo" >> $L; timeout 150 python3 -m benchmark.bench_trainer --full --cases llama8b-L8_grpo_full_16x1024 --rounds 1 --name trainer_matrix_grpo8b >> $L 2>&1
echo "== grpo sweep" >> $L; timeout 140 python3 -m benchmark.bench_grpo --quick --sweep --cases none --providers ours,ours_logprobs,trl_fused,gemms >> $L 2>&1
cd $OUT && tar czf results.tgz results && rm -rf results
