#!/usr/bin/env bash
# On the device machine (cubins carried): the experimental f16 configs' GPU tests, then their
# speed against the shipped configs (bench.py --sweep, kernel_times.py). Output to stdout.
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_wide_chunk.py \
  tests/test_gpu_prep.py -k "f16" 2>&1 | tail -4
F16=kda_recur_wgmma_k128_v128_c16_bv64_t128_s4_f16
for cfg in "" "--config $F16"; do
  timeout 40 python3 bench/kernel_times.py B1_T8192_H64 B32_T256_H32 --head-dim 128 $cfg 2>&1 \
    | grep -v -i warn | grep -v "^ *$" | sed 's/kernel_cutlass_kernel_kernels//; s/_object_at.*//'
done
timeout 100 python3 bench/bench.py --no-fla --sweep --head-dims 128 --out /tmp/sweep.json \
  --cases B1_T8192_H64,varlen_8x1024_H64,B32_T256_H32,B8_T1024_H32,varlen_mix_H64 2>&1 \
  | grep " K128 \|sweep" | sed 's/ fla nan.*//'
