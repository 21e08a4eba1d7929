"""Executor migration while a job runs (DESIGN.md §4): nothing lost, nothing run twice, sums exact."""

from __future__ import annotations

import numpy as np
import pytest

import litz
from tests import testapps


def test_hundreds_of_random_executor_migrations_keep_sums_and_state_exact(etcd) -> None:
    # a move is refused while its executor still moves: on a loaded machine about half of them
    app = testapps.migrating_app(tasks=1500, executors=12, move_prob=0.3)
    res = litz.run(app, workers=3, servers=2, etcd=etcd.url)
    out = res.value
    assert out["moves"] >= 200, out["moves"]
    assert res.total("migrations_in", "worker") >= 200
    np.testing.assert_array_equal(out["final"], out["truth"])
    # each executor's state counted its tasks in order: none lost, none run twice, state carried along
    for seqs in out["done_seq"]:
        assert sorted(seqs) == list(range(len(seqs))), seqs
    assert sum(len(s) for s in out["done_seq"]) == 1500


def test_failed_migration_stops_the_job_with_a_precise_error(etcd) -> None:
    app = litz.App(testapps.MoveOnceDriver, testapps.OneLoadPerProcessExecutor, num_executors=2,
                   tables=[litz.Table("t", (1,))])
    with pytest.raises(litz.LitzError, match="(?s)executor migration failed on w.*shared storage unreachable"):
        litz.run(app, workers=2, servers=1, etcd=etcd.url)


def test_hundreds_of_shard_and_executor_migrations_lose_and_double_no_update(etcd) -> None:
    # shards move between 3 servers while executors read and update them (requests that reach
    # an old owner are forwarded, possibly over several hops) and executors move too
    app = testapps.migrating_app(tasks=1500, executors=8, move_prob=0.1, shard_move_prob=0.3, seed=3)
    res = litz.run(app, workers=2, servers=3, etcd=etcd.url)
    out = res.value
    assert out["shard_moves"] >= 200, out["shard_moves"]
    assert res.total("shards_in", "server") >= 200
    assert res.total("forwarded", "server") > 0  # some requests did reach an old owner
    np.testing.assert_array_equal(out["final"], out["truth"])
    for seqs in out["done_seq"]:
        assert sorted(seqs) == list(range(len(seqs)))
