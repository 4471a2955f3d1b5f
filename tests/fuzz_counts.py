"""Example counts of the property-based tests, printed in the test log's summary (tests/conftest.py),
so a run shows how many examples each fuzz test drew and how they ended."""
from collections import Counter, defaultdict

COUNTS: defaultdict = defaultdict(Counter)  # test name -> outcome -> examples


def count(test: str, outcome: str) -> None:
    COUNTS[test][outcome] += 1


def summary_lines() -> list[str]:
    return [f"{test}: {sum(c.values())} ({', '.join(f'{k} {v}' for k, v in sorted(c.items()))})"
            for test, c in sorted(COUNTS.items())]
