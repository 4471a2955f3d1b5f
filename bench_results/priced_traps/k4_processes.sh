#!/bin/bash
# k4_processes.py from the session's first commit (old: 9c8e2a4, a worktree at /tmp/s47/old) and
# from main (new), one process each, alternated
for i in 1 2 3; do
  for v in old new; do
    d=/work/main; [ $v = old ] && d=/tmp/s47/old
    (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python /work/main/bench_results/priced_traps/k4_processes.py $v 2>&1 | grep -E "^(old|new) ")
  done
done
uptime
