#!/usr/bin/env bash
# On the GPU machine: is the decode step's host time bimodal because the Python thread
# shares a physical core (SMT sibling) with a busy MLX/CUDA thread? Prints the CPU
# topology, then runs the same profile (no CUPTI) unpinned and pinned to one logical
# CPU per physical core, and shows the busiest threads of a running process.
#   bash bench/gpu/cpu_pin.sh 1b bf16 1,8
set -uo pipefail
m=${1:-1b} q=${2:-bf16} batches=${3:-1,8}
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA node" || true
one_per_core=$(python3 - <<'PY'
import glob
seen, keep = set(), []
for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"),
                   key=lambda p: int(p.split("/cpu")[2].split("/")[0])):
    sib = open(path).read().strip()
    if sib not in seen:
        seen.add(sib)
        keep.append(path.split("/cpu")[2].split("/")[0])
print(",".join(keep))
PY
)
echo "one logical CPU per core: $one_per_core"
P="python3 bench/gpu/profile_step.py --model $m --quant $q --batches $batches --variants default --steps 64 --repeat 3 --no-profile"
for how in plain pinned plain2 pinned2; do
    pre=""
    case $how in pinned*) pre="taskset -c $one_per_core" ;; esac
    $pre $P --out "$OUT/pin-$how-$m-$q.json" > "/tmp/pin-$how.log" 2>&1 &
    pid=$!
    sleep 25
    echo "--- $how: busiest threads 25 s in"
    ps -L -o tid,psr,pcpu,comm -p $pid --sort=-pcpu 2>/dev/null | head -6
    wait $pid
    grep -E "tok/s" "/tmp/pin-$how.log"
done
