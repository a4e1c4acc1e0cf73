#!/usr/bin/env bash
# Nsight Compute on one benchmark case (run on the H200 from the repo root, cubins carried):
# a summary of K1 and K2 (speed of light, occupancy, warp stalls) and K2's hottest SASS
# instructions by stall samples. Usage: bash scripts/gpu_profile.sh "B1_T8192_H64" [head_dim]
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
CASE=${1:-B1_T8192_H64}
HD=${2:-128}
ncu --clock-control none -k regex:kda --launch-skip 4 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section LaunchStats --section SourceCounters \
  --print-details all -o "$OUT/profile" -f \
  python3 bench/probes/profile_case.py "$CASE" --head-dim "$HD" > "$OUT/ncu_run.log" 2>&1
ncu -i "$OUT/profile.ncu-rep" --print-details all > "$OUT/ncu_summary.txt" 2>&1
ncu -i "$OUT/profile.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
python3 scripts/sass_hot.py "$OUT/ncu_sass.csv" | tee "$OUT/ncu_hot.txt"
