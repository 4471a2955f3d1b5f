"""Benchmarks and studies: scripts, not part of the installed packages. Run them from the
repository root as `python -m benchmarks.NAME` (README.md, Makefile). They may import the
packages; no package imports them (tests/test_import_graph.py).

A benchmark owns its process, so importing this package configures it as spectail's command line
does (rollout/cpu.py): passive OpenMP waiting (before torch loads) and oneDNN capped below AMX.
"""
from rollout import cpu

cpu.configure()
