#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export BENCH_OUT=$OUT/results PYTHONUNBUFFERED=1
mkdir -p $BENCH_OUT
L=$OUT/log.txt
(timeout 100 python3 -m pytest -q -m gpu tests/chunked/test_frozen_head.py -p no:cacheprovider 2>&1 | tail -3) >> $L
echo "== diag frozen" >> $L; timeout 160 python3 -m benchmark.experiments.diag_frozen_head >> $L 2>&1
echo "== bench frozen" >> $L; timeout 60 python3 -m benchmark.bench_fused_linear_ce --frozen --quick --providers ours,gemms,liger-kernel >> $L 2>&1
echo "== trainer profiles" >> $L; timeout 200 python3 -m benchmark.bench_trainer --cases llama1b_sft_full_2x2048 qwen1.5b_dpo_full_2x1024 --rounds 1 --cprofile --profile --name trainer_profiles >> $L 2>&1
cd $OUT && tar czf results.tgz results && rm -rf results
