#!/bin/bash
# make demo, the attention kernel before (7580fc8) and after (081db7c), alternated
# (the old tree: git worktree add /tmp/wt_7580fc8 7580fc8)
cd /work/main
for i in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then dir=/tmp/wt_7580fc8; else dir=/work/main; fi
    out=/tmp/demo_ab_${v}_$i
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m rl_integration demo --quiet --out $out) > $out.log 2>&1
    echo "$v $i: $(grep -E 'rollout speedup' $out.log)"
    grep -E "^ +[0-9]+ +[0-9]\." $out.log
  done
done
