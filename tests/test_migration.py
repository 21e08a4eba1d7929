"""Executor migration while a job runs (DESIGN.md §4): nothing lost, nothing run twice, sums exact."""

from __future__ import annotations

import numpy as np

import litz
from tests import testapps


def test_hundreds_of_random_executor_migrations_keep_sums_and_state_exact(etcd) -> None:
    app = testapps.migrating_app(tasks=1500, executors=12, move_prob=0.25)
    res = litz.run(app, workers=3, servers=2, etcd=etcd.url)
    out = res.value
    assert out["moves"] >= 200, out["moves"]
    assert res.total("migrations_in", "worker") >= 200
    np.testing.assert_array_equal(out["final"], out["truth"])
    # each executor's state counted its tasks in order: none lost, none run twice, state carried along
    for seqs in out["done_seq"]:
        assert sorted(seqs) == list(range(len(seqs))), seqs
    assert sum(len(s) for s in out["done_seq"]) == 1500
