#!/bin/bash
# usage: ab.sh ROUNDS THR REPS
export SPECTAIL_CACHE=/work/main/.cache/spectail OMP_WAIT_POLICY=PASSIVE
for r in $(seq $1); do
  for tree in old new; do
    if [ $tree = old ]; then dir=bench_results/host_overhead/wt; else dir=/work/main; fi
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python bench_results/host_overhead/hostab.py $2 $3 2>/dev/null | grep RESULT | sed "s/RESULT/$tree/")
  done
done
uptime
