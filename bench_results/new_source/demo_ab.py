"""make demo as it is (new) or with a run's draft sources ignored (old: the code before), one
process each; run alternately: python demo_ab.py old|new"""
import sys
import rollout.controller as rc
from rl_integration.cli import main
if sys.argv[1] == "old":
    orig = rc.AdaptiveController.new_run
    rc.AdaptiveController.new_run = lambda self, sources=frozenset(): orig(self, frozenset())
sys.exit(main(["demo"]))
