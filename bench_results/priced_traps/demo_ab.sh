#!/bin/bash
# make demo at the session's start (old: 9c8e2a4) and now (new), alternated, one process each
for i in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then d=/tmp/s47/old; else d=/work/main; fi
    echo "== $v round $i $(uptime)"
    (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python -m rl_integration.cli demo 2>&1 | grep -aE "^ +[0-9]+ +[0-9]\.|speedup over" )
  done
done
