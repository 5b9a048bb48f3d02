"""Randomized store corruption vs the clean result: a fixed, CI-sized seed set.

Every random corruption of a small store is either refused with a ``StoreFormatError`` naming a
file of the store, provably harmless (every record equal, tensors byte for byte), or the
documented crash recovery (the last record of one partition missing, with a warning naming
the file); and ``repair`` never makes up or duplicates a record. The engine and a larger run:
``tests/fuzz/store_fuzz.py``.
"""

from __future__ import annotations

import collections

from tests.fuzz.store_fuzz import run_cases

SEEDS = range(150)


def test_random_store_corruptions_are_detected_or_harmless(tmp_path):
    results = run_cases(SEEDS, tmp_path)
    fails = [r for r in results if r["verdict"] == "FAIL"]
    assert not fails, "\n".join(f"seed {r['seed']}: {r['what']}: {r['detail']}" for r in fails)
    verdicts = collections.Counter(r["verdict"] for r in results)
    # the seed set exercises every outcome, so the test cannot pass vacuously
    assert verdicts["detected"] > 100 and verdicts["harmless"] > 10 and verdicts["recovered"] > 0
    kinds = {r["what"].split()[0] for r in results}
    assert len(kinds) == 13, kinds  # every corruption kind
