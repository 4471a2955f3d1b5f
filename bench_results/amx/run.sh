#!/bin/sh
# Each probe with AMX allowed (the user's cap) and with spectail's cap; logs beside.
cd "$(dirname "$0")/../.."
for s in rows_vs_two_row_calls rows_vs_300_row_call chunks_one_thread chunks_two_threads chunks_many_threads capped_threads amx_against_cap_speed; do
  for isa in AVX512_CORE_AMX AVX512_CORE_BF16; do
    echo "== $s ONEDNN_MAX_CPU_ISA=$isa"; uptime
    arg=""; [ $s = capped_threads ] && arg=bfloat16; [ $s = amx_against_cap_speed ] || true
    ONEDNN_MAX_CPU_ISA=$isa PYTHONPATH=. .venv/bin/python bench_results/amx/$s.py $arg
  done
done
