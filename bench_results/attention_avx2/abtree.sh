#!/bin/bash
# usage: abtree.sh ROUNDS NPROB BATCH CONFIGS
export SPECTAIL_CACHE=/work/main/.cache/spectail OMP_WAIT_POLICY=PASSIVE
for r in $(seq $1); do
  for tree in old new; do
    if [ $tree = old ]; then dir=/tmp/s42/wt; else dir=/work/main; fi
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python /tmp/s42/plainab.py $2 $3 $4 2>/dev/null | grep RESULT | sed "s/RESULT/$tree/")
  done
done
uptime
