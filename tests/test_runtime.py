"""Multi-process tests of the core runtime: real etcd, real processes, real sockets."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import litz
from litz.ps.server import ServerNode
from litz.runtime.transport import Endpoint
from tests import testapps
from tests.conftest import processes_mentioning


def test_consistency_rule_across_processes_with_cache(etcd) -> None:
    # Rule 1, many times over: a task dispatched after the driver saw another's completion
    # reads that task's updates, though executors on two processes share cached rows.
    app = testapps.causal_app(keys=6, tasks=800, inflight=8, executors=8)
    res = litz.run(app, workers=2, servers=2, etcd=etcd.url)
    out = res.value
    assert out["violations"] == []
    assert sum(out["completed"]) == 800
    # every increment applied exactly once
    assert out["final"] == [2.0 * 0 + c for c in out["completed"]]
    assert res.total("tasks_run", "worker") >= 800


def test_prefetch_hints_keep_the_consistency_rule(etcd) -> None:
    # 24 tasks in flight over 4 executors: tasks wait in queues, and their hinted rows are fetched
    # at their versions before they start. Rule 1 and exact sums must hold all the same, and
    # broken hints (an unknown table, a hint that raises) are ignored.
    app = testapps.causal_app(keys=6, tasks=600, inflight=24, executors=4,
                              executor=testapps.PrefetchingCausalExecutor)
    res = litz.run(app, workers=2, servers=2, etcd=etcd.url)
    out = res.value
    assert out["violations"] == []
    assert out["final"] == [2.0 * 0 + c for c in out["completed"]]
    assert res.total("prefetches", "worker") > 0


def test_cache_is_used_when_allowed(etcd) -> None:
    app = litz.App(testapps.RoundsDriver, testapps.RoundsExecutor,
                   tables=[litz.Table("w", (16,), "float32", num_rows=4)], num_executors=16,
                   config={"rounds": 10})
    res = litz.run(app, workers=2, servers=1, etcd=etcd.url)
    reads = res.value["reads"]
    assert reads == 10 * 16 * 8
    fetched = res.total("fetches", "worker")
    hits = res.total("cache_hits", "worker")
    # 16 executors of one version on 2 processes: about 2 fetches per key per round,
    # concurrent misses coalesced, and every second read a hit
    assert fetched < reads / 6, (fetched, reads)
    assert hits >= reads / 2
    assert res.total("coalesced", "worker") > 0
    # with the cache off every read is a fetch
    off = litz.run(app, workers=2, servers=1, etcd=etcd.url, options={"cache": False})
    assert off.total("fetches", "worker") == reads
    assert off.total("cache_hits", "worker") == 0


@pytest.mark.parametrize("update_log", [True, False])
def test_update_sums_exact(etcd, update_log: bool) -> None:
    app = testapps.sum_app(rows=20, tasks=300, executors=6)
    res = litz.run(app, workers=2, servers=3, etcd=etcd.url, options={"update_log": update_log})
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    assert res.total("update_errors", "worker") == 0
    if update_log:  # the log merged updates: fewer rows left the workers than were logged
        assert res.total("update_rows_sent", "worker") < res.total("updates_logged", "worker")


def test_reads_and_updates_cut_into_frames_stay_exact(etcd) -> None:
    # frame_bytes of one row: every read and update of the 40 rows travels as 40 items, each its
    # own frame. Rule 1 still holds (round r sees the 6 increments of every earlier round), every
    # increment lands once, and get_many fills the buffer it was given.
    rows, rounds, executors = 40, 5, 6
    app = litz.App(testapps.FramesDriver, testapps.FramesExecutor, num_executors=executors,
                   tables=[litz.Table("f", (8,), "float64", num_rows=rows)], config={"rows": rows, "rounds": rounds})
    res = litz.run(app, workers=2, servers=2, etcd=etcd.url, options={"frame_bytes": 64})
    results = res.value["results"]
    assert len(results) == rounds * executors
    for r in results:
        assert r["seen"] >= r["round"] * executors
        assert r["same_buffer"]
        assert r["refused"] == ("table 'f': get_many(out=...) needs a writeable float64 array of shape (40, 8), "
                                "got float64 (40, 7)")
    np.testing.assert_array_equal(res.value["final"], np.full((rows, 8), rounds * executors))
    assert res.total("update_errors", "worker") == 0


def test_crashing_run_task_stops_job_cleanly(etcd) -> None:
    app = litz.App(testapps.CrashDriver, testapps.CrashExecutor, num_executors=4, config={"crash_on": 2},
                   tables=[litz.Table("t", (1,))])
    job = f"crash-{time.time_ns()}"
    with pytest.raises(litz.TaskError) as info:
        litz.run(app, workers=2, servers=1, etcd=etcd.url, job=job)
    err = info.value
    assert err.executor_id == 2
    assert err.args_ == {"n": 2, "crash": True}
    assert "ZeroDivisionError: boom in run_task" in err.traceback
    assert "executor 2" in str(err)
    assert processes_mentioning(job) == []


@pytest.mark.parametrize("update_log", [True, False])
def test_bad_update_is_refused_and_the_failed_tasks_updates_are_discarded(etcd, update_log: bool) -> None:
    """Tasks 7 and 33 make 5 valid updates, then an invalid one: they fail, naming the key and the
    shapes, and none of their updates reach the table (the driver does not count them; before,
    they stayed applied), while every other task's do."""
    app = testapps.sum_app(rows=10, tasks=60, executors=4, bad=(7, 33))
    res = litz.run(app, workers=2, servers=2, etcd=etcd.url, options={"update_log": update_log})
    failures = res.value["failures"]
    assert sorted(f[1]["seed"] for f in failures) == [7, 33]
    assert all("table 's': update of key 0 has shape (7,), expected (3,)" in f[2] for f in failures)
    assert all("the 5 row updates it made were discarded" in f[2] for f in failures)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])


def test_a_retried_task_counts_once(etcd) -> None:
    """``Driver.retry`` of tasks that failed after valid updates: each update of a retried task
    lands exactly once (its failed run's are discarded), with executors sharing a worker's log."""
    app = testapps.sum_app(rows=10, tasks=60, executors=4, bad=(3, 7, 33, 58), retry=True)
    res = litz.run(app, workers=2, servers=2, etcd=etcd.url)
    assert sorted(f[1]["seed"] for f in res.value["failures"]) == [3, 7, 33, 58]
    assert res.tasks_completed == 60
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])


def test_unknown_table_is_a_precise_task_error(etcd) -> None:
    app = litz.App(testapps.CrashDriver, testapps.UnknownTableExecutor, num_executors=1,
                   config={"crash_on": -1}, tables=[litz.Table("t", (1,))])
    with pytest.raises(litz.TaskError) as info:
        litz.run(app, workers=1, servers=1, etcd=etcd.url)
    assert "unknown table 'no_such_table'" in info.value.traceback


def test_a_combiner_that_cannot_warm_up_stops_the_job_before_it_starts_and_names_the_table(etcd) -> None:
    """Servers and workers warm every table's combiner when they receive the tables (its kernel is
    then not loaded on the first update's path); a failure there is a start-up error naming the table."""
    app = litz.App(testapps.CrashDriver, testapps.SumExecutor, num_executors=1, config={"crash_on": -1},
                   tables=[litz.Table("ok", (1,)), litz.Table("fragile", (3,), combiner=testapps.BrokenWarmUp())])
    with pytest.raises(litz.LitzError) as info:
        litz.run(app, workers=1, servers=1, etcd=etcd.url)
    message = str(info.value)
    assert "table 'fragile'" in message and "failed to warm up" in message and "kernel library missing" in message
    assert processes_mentioning(f"--etcd {etcd.url}") == []  # the job's processes are gone


def test_a_process_stuck_in_its_initialisation_is_named_with_its_stack(etcd) -> None:
    """A process that registered but never answers the initialisation is not waited for for ever:
    the error names it and shows where it is stuck (its stack, printed into its log on SIGUSR1)."""
    from litz.runtime.master import StartupTimeout

    app = litz.App(testapps.CrashDriver, testapps.SumExecutor, num_executors=1, config={"crash_on": -1},
                   tables=[litz.Table("slow", (3,), combiner=testapps.StuckWarmUp())])
    job = f"stuck-{time.time_ns()}"
    with pytest.raises(StartupTimeout) as info:
        litz.run(app, workers=1, servers=1, etcd=etcd.url, job=job, startup_timeout=3)
    message = str(info.value)
    assert info.value.silent == ["s0"] and "no answer from s0)" in message
    assert "the log of s0 ends with" in message and "in warm_up" in message  # its stack, down to the sleep
    assert processes_mentioning(job) == []


def test_an_init_that_overtakes_the_masters_registration_event_is_answered(etcd) -> None:
    """ZeroMQ can deliver the master's init before etcd's watch delivers the master's registration
    (the process took its snapshot of the registrations before the master registered, as when the
    processes start while etcd comes up): the process reads the registrations then, and its answer
    reaches the master instead of failing for want of an address."""
    import cloudpickle

    from litz.ps.server import ServerNode
    from litz.runtime.membership import Membership
    from litz.runtime.node import proc_key
    from litz.runtime.protocol import Message
    from litz.runtime.transport import Endpoint

    job = f"overtake-{time.time_ns()}"
    node = ServerNode("s0", job, etcd.url)
    node.start()  # its snapshot of the registrations holds no master
    master = Endpoint("master")
    try:
        with Membership(etcd.url, job) as mem:
            mem.register(proc_key("master", "master"), {"id": "master", "addr": master.address, "role": "master"})
            assert "master" not in node.endpoint.peers  # the loop is not running: the watch event waits
            node.membership.poll_events()  # (taken away: the init overtakes it)
            node.dispatch(Message("init_server", {"tables": cloudpickle.dumps([litz.Table("t", (2,))]),
                                                  "shards": [0, 1], "num_shards": 2, "master": "master"}, "master"))
            _expect_ready(node, master, 5, "the answer never came")  # the look-up is made off the loop
    finally:
        master.close()
        node.close()


def _expect_ready(node: ServerNode, master: Endpoint, timeout: float, why: str) -> None:
    """Turn ``node``'s loop until ``master`` has its answer to ``init_server``: ``ready``, no error."""
    deadline = time.monotonic() + timeout
    while not master.router.poll(0):
        assert time.monotonic() < deadline, why
        node.poll(20)
    reply = master.recv()
    assert reply is not None and reply.type == "ready" and reply.get("error") is None


def test_a_message_from_an_unknown_sender_in_an_etcd_outage_waits_for_its_address(tmp_path) -> None:  # noqa: ANN001
    """The master's init overtakes its registration event, and etcd is away: the look-up of the
    master's address is made off the loop (which does not wait: before, it held the loop for the
    call deadline, 5 s, stalling every task), the init waits, the look-up is tried again, and once
    etcd is back the init is handled and answered. Before, the sender was marked looked up before
    the read failed, the init was handled without the master's address, and its answer was lost."""
    import cloudpickle

    from litz.ps.server import ServerNode
    from litz.runtime.etcd_server import LocalEtcd
    from litz.runtime.membership import Membership
    from litz.runtime.node import proc_key
    from litz.runtime.protocol import Message
    from litz.runtime.transport import Endpoint

    job = f"lookup-outage-{time.time_ns()}"
    server = LocalEtcd()
    server.start()
    node = ServerNode("s0", job, server.url)
    master = Endpoint("master")
    try:
        node.start()
        with Membership(server.url, job) as mem:
            mem.register(proc_key("master", "master"), {"id": "master", "addr": master.address, "role": "master"})
            time.sleep(0.2)
            node.membership.poll_events()  # (taken away: the init overtakes the registration event)
            server._stop_process()
            started = time.monotonic()
            node.dispatch(Message("init_server", {"tables": cloudpickle.dumps([litz.Table("t", (2,))]),
                                                  "shards": [0, 1], "num_shards": 2, "master": "master"}, "master"))
            assert time.monotonic() - started < 0.5, "the look-up held the loop"
            while time.monotonic() - started < 7.0:  # past the first look-up's deadline (5 s): it failed
                node.poll(20)
            assert not master.router.poll(0) and "master" in node._lookup_retry
            server._launch(15.0)
            _expect_ready(node, master, 20, "the init was never answered")
    finally:
        master.close()
        node.close()
        server.stop()


def test_embedded_cluster_starts_and_stops_its_own_etcd() -> None:
    job = f"embedded-{time.time_ns()}"
    res = litz.run(testapps.sum_app(rows=4, tasks=20, executors=2), workers=1, servers=1, job=job)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    assert processes_mentioning(job) == []


def test_an_embedded_etcd_that_cannot_start_is_reported_and_nothing_is_left(tmp_path, monkeypatch) -> None:
    """The job's processes start while its private etcd comes up; if etcd then fails, the error
    quotes etcd's log and the processes already started are stopped at once."""
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\nsleep 0.3\necho 'etcdmain: listen tcp: address already in use' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    job = f"no-etcd-{time.time_ns()}"
    started = time.monotonic()
    with pytest.raises(litz.ConfigError) as info:
        litz.run(testapps.sum_app(rows=4, tasks=20, executors=2), workers=2, servers=1, job=job)
    assert "exited with code 3" in str(info.value) and "address already in use" in str(info.value)
    assert time.monotonic() - started < 4.5  # not the processes' own 5 s wait for etcd
    assert processes_mentioning(job) == []


def test_server_survives_malformed_and_bad_messages(etcd) -> None:
    import cloudpickle
    import zmq

    from litz.runtime.launcher import LocalCluster
    from litz.runtime.membership import Membership
    from litz.runtime.node import proc_key
    from litz.runtime.transport import Endpoint

    job = f"garbage-{time.time_ns()}"
    with LocalCluster(job, workers=1, servers=1, etcd=etcd.url) as cluster, Membership(etcd.url, job) as mem:
        me = Endpoint("tester")
        mem.register(proc_key("tester", "tester"), {"id": "tester", "addr": me.address, "role": "tester"})
        deadline = time.monotonic() + 20
        while "procs/server/s0" not in mem.get_prefix("procs/"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        addr = mem.get("procs/server/s0")["addr"]
        me.connect("s0", addr)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(addr)
        for junk in ([b"\x00\xff garbage"], [b"\x92\xa3get\x80"], [b"\x92\xa4nope\x80", b"x"]):
            raw.send_multipart(junk)

        def reply() -> object:
            assert me.router.poll(10_000), "the server stopped answering"
            return me.recv()

        tables = cloudpickle.dumps([litz.Table("s", (2,), "float64")])
        me.send("s0", "init_server", tables=tables, shards=list(range(4)), num_shards=4, master="tester")
        assert reply().type == "ready"
        me.send("s0", "update", rid=1, items=[["s", [1], np.ones((1, 2))], ["zz", [1], np.ones((1, 2))],
                                             ["s", [2], np.ones((1, 5))]])
        ack = reply()
        assert ack["errors"][0] is None
        assert "unknown table 'zz'" in ack["errors"][1] and "shape (1, 5)" in ack["errors"][2]
        me.send("s0", "get", rid=2, items=[["s", [1, 2]]])
        got = reply()
        assert got["values"][0].tolist() == [[1.0, 1.0], [0.0, 0.0]]  # the good update, and only it
        me.send("s0", "stats_request", rid=3)
        assert reply()["stats"]["bad_messages"] == 3
        cluster.check()  # still alive
        me.send("s0", "shutdown", reason="test over")
        assert reply().type == "bye"
        me.close()
        raw.close(0)


def test_unsendable_result_fails_only_its_task(etcd) -> None:
    app = litz.App(testapps.CountingDriver, testapps.UnsendableExecutor, num_executors=4, config={"crash_on": 1},
                   tables=[litz.Table("t", (1,))])
    res = litz.run(app, workers=1, servers=1, etcd=etcd.url)
    assert res.value["values"] == [0, 2, 3]
    [(eid, reason)] = res.value["failures"]
    assert eid == 1 and "cannot be sent to the driver" in reason


def test_bad_values_fail_only_their_own_task_naming_it(etcd) -> None:
    """Each of these failed more than its task before: a result that does not load on the master
    dropped the whole ``done`` message (every completion in it: the job waited for ever); an object
    array travelled as raw pointers (the same) and a structured one lost its fields; one key's
    initializer raising failed the task reading a good key fetched with it, and the error named
    that task; a string key that is not valid text killed the worker as it flushed its updates."""
    res = litz.run(testapps.bad_values_app(), workers=1, servers=1, etcd=etcd.url)
    out = res.value["by_executor"]
    assert "fetch of table 't' key 5 failed" in out[0] and "no row 5" in out[0], out[0]
    assert "does not load on the master" in out[1] and "ValueError" in out[1], out[1]
    objects, records = out[2]
    assert objects.dtype == object and objects.tolist() == [{"a": 1}, None]
    assert records.dtype.names == ("i", "x") and records.tolist() == [(1, 2.5)]
    assert out[3] == 7.0  # fetched with key 5, whose failure is not its own
    assert "TableError" in out[4] and "is not valid Unicode text" in out[4], out[4]
    assert res.tasks_completed == 2 and res.total("tasks_failed", "worker") == 2  # (1's failed on the master)


@pytest.mark.parametrize("change, message", [
    ({"num_executors": 0}, "App.num_executors must be a positive int (None: 4 per worker), got 0"),
    ({"num_executors": 2.5}, "App.num_executors must be a positive int (None: 4 per worker), got 2.5"),
    ({"driver": object}, "App.driver must be a subclass of litz.Driver, got <class 'object'>"),
    ({"executor": testapps.CountingDriver}, "App.executor must be a subclass of litz.Executor"),
])
def test_an_app_no_job_can_run_is_refused_before_anything_starts(change: dict, message: str) -> None:
    """Before, ``App(num_executors=0)`` silently ran with the default, and the others failed once the
    processes had started, with an AttributeError or a TypeError naming nothing of the app."""
    import dataclasses

    app = dataclasses.replace(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), **change)
    with pytest.raises(litz.ConfigError, match=re.escape(message)):
        litz.run(app)


def test_a_checkpoint_period_in_iterations_needs_a_driver_that_counts_them(tmp_path) -> None:  # noqa: ANN001
    """Before, ``--checkpoint-every 5`` with a driver whose ``iteration`` is None never took a
    checkpoint, without a word (a lost worker's executors then came back from scratch)."""
    app = litz.App(testapps.CountingDriver, testapps.UnsendableExecutor, num_executors=2, config={"crash_on": -1})
    with pytest.raises(litz.ConfigError, match=re.escape("--checkpoint-every 5 counts the driver's iterations, "
                                                         "and CountingDriver counts none")):
        litz.run(app, checkpoint_dir=str(tmp_path), checkpoint_every="5")


def test_a_progress_that_raises_or_is_not_text_is_shown_not_fatal() -> None:
    """``Driver.progress`` only feeds ``litz status``: before, one that raised (an attribute not set
    yet) or returned a NumPy float ended the job."""
    from litz.runtime.master import Master

    class Early(litz.Driver):
        def progress(self) -> str:
            return f"loss {self.loss:.3f}"

    class Numeric(litz.Driver):
        def progress(self) -> str:
            return np.float32(0.5)  # type: ignore[return-value]

    m = Master(testapps.migrating_app(tasks=10, executors=2, move_prob=0.0), "j", None,  # type: ignore[arg-type]
               workers=1, servers=1, num_executors=2)
    try:
        m.driver = Early()
        assert m._status("running")["progress"] == "progress() raised AttributeError: 'Early' object has no " \
                                                   "attribute 'loss'"
        m.driver = Numeric()
        assert m._status("running")["progress"] == "0.5"
    finally:
        m.endpoint.close()


@pytest.mark.parametrize("sizes, message", [
    ({"workers": 0}, "at least one worker and one server (got 0 and 1)"),
    ({"servers": 0}, "at least one worker and one server (got 2 and 0)"),
    ({"num_executors": 0}, "at least one executor (--executors), got 0"),
    ({"servers": 9, "options": {"num_shards": 8}}, "9 servers for 8 shards would leave servers idle"),
])
def test_bad_job_sizes_are_refused_before_anything_starts(sizes: dict, message: str) -> None:
    """Before, ``num_executors=0`` (``--executors 0``) silently meant the default, and servers
    beyond the shards started and held nothing (``litz scale`` refused them)."""
    app = testapps.migrating_app(tasks=10, executors=2, move_prob=0.0)
    with pytest.raises(litz.ConfigError, match=re.escape(message)):
        litz.run(app, **sizes)


def test_no_process_loads_pyarrow_before_its_first_checkpoint() -> None:
    # pyarrow costs every process 35-60 ms at start; only checkpoints and restores need it
    code = ("import sys, litz.runtime.worker, litz.ps.server, litz.runtime.master, litz.runtime.launcher, litz.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('pyarrow')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


_FAULTS = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from litz.runtime.node import keep_freed_memory
    assert keep_freed_memory()
def cycle():  # three arrays of 1 MB, written, then freed: what a round's buffers do
    arrays = [np.ones(1 << 18, np.float32) for _ in range(3)]
    del arrays
for _ in range(3):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_and_servers_reuse_freed_buffers_instead_of_faulting_them_in_again(monkeypatch) -> None:
    """Buffers of a few MB freed every round stay mapped in worker and server processes
    (``keep_freed_memory``, called by their ``main``): allocating them again costs no page fault.
    With glibc's defaults the heap is trimmed and each round faults every page in again."""
    def faults(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return float(out.stdout)

    assert faults("default") >= 256  # 3 MB trimmed and faulted in again per cycle (768 pages)
    assert faults("keep") < 8
    from litz.errors import ConfigError
    from litz.runtime import node

    calls: list[int] = []
    monkeypatch.setattr(node, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(node.security, "configure", lambda *a, **kw: None)

    class Refused(node.Node):  # stops main right after its set-up
        role = "worker"

        def __init__(self, *args: object) -> None:
            raise ConfigError("refused")

    assert node.main(Refused, ["--id", "w9", "--job", "j", "--etcd", "127.0.0.1:1"]) == 2
    assert calls == [1]


def test_an_update_a_server_cannot_apply_stops_the_job_before_its_tasks_count(etcd) -> None:
    """A combiner that raises on the server loses the update: the job stops, naming the table, the
    keys and the worker, and the driver is never handed the tasks whose updates were lost."""
    testapps.RefusedUpdateDriver.seen = []
    with pytest.raises(litz.LitzError) as info:
        litz.run(testapps.refused_update_app(), workers=2, servers=1, etcd=etcd.url)
    message = str(info.value)
    assert re.search(r"updates sent by w\d were refused, so the tables lack them and the job stops: update refused "
                     r"by s0: table 't' keys \[0\]: RuntimeError: combiner boom", message), message
    assert testapps.RefusedUpdateDriver.seen == []
    assert processes_mentioning(f"--etcd {etcd.url}") == []


def test_a_get_state_that_raises_fails_the_checkpoint_and_the_job_goes_on(tmp_path) -> None:
    app = testapps.migrating_app(tasks=300, executors=4, move_prob=0.0)
    app.executor = testapps.StatelessExecutor
    app.driver = testapps.CheckpointingDriver
    app.config.update(checkpoint_at=50)
    res = litz.run(app, workers=2, servers=1, checkpoint_dir=str(tmp_path))
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])  # every task ran once, exactly
    [failed] = res.stats["master"]["checkpoints"]
    assert not failed["ok"] and re.search(r"worker w\d: executor \d's state cannot be saved: RuntimeError: "
                                          r"get_state boom on executor \d", "; ".join(failed["errors"])), failed
    assert list(tmp_path.glob("*/MANIFEST.json")) == []


def test_a_get_state_that_raises_during_a_migration_stops_the_job_and_names_the_executor() -> None:
    app = testapps.migrating_app(tasks=400, executors=4, move_prob=0.3)
    app.executor = testapps.StatelessExecutor
    started = time.monotonic()
    with pytest.raises(litz.LitzError) as info:
        litz.run(app, workers=2, servers=1)
    assert time.monotonic() - started < 30
    assert re.search(r"executor migration failed on w\d: migration \d+ of executors \[(\d)\] to w\d: executor \1's "
                     r"state cannot be saved: RuntimeError: get_state boom on executor \1", str(info.value)), info.value


def test_a_job_that_finishes_with_a_task_still_running_ends_promptly() -> None:
    """A task blocking its worker cannot answer the end of the job; the master waits for it only
    briefly (``ABANDONED_GRACE``, 1 s, for its statistics, then for its goodbye), and the launcher
    kills it rather than wait for it to leave: ``litz.run`` returns about 2 s after the driver
    finished. Before, the launcher waited 5 s more for the blocked worker."""
    app = litz.App(testapps.AbandoningDriver, testapps.SleepExecutor, tables=[litz.Table("t", (1,))],
                   num_executors=2, config={"sleep": 120.0})
    res = litz.run(app, workers=2, servers=1)
    assert res.value["executor"] == 0 and time.monotonic() - res.value["at"] < 4.5, time.monotonic() - res.value["at"]
    assert "w0" in res.stats or "w1" in res.stats  # the idle worker's counters are there


def test_a_joined_hosts_agent_stops_at_once_the_processes_that_never_joined() -> None:
    """When the job ends, a joined host's agent terminates at once the processes the master's last
    status names as never joined (a host without the job secret, say): no goodbye reaches them,
    and the agent's stop waited 5 s for each. The others are left to leave on their own."""
    from litz.runtime.launcher import LocalCluster

    cluster = LocalCluster("unjoined", workers=2, servers=0, etcd="http://127.0.0.1:1", join=True)
    sleepers = {i: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for i in ("w3", "w4")}
    cluster.children.update(sleepers)
    try:
        cluster.stop_unjoined(None)  # no status (etcd gone with the job): nothing is known, nothing stopped
        cluster.stop_unjoined({"phase": "finished", "unjoined": ["w4", "w9"]})
        assert sleepers["w4"].wait(5) == -15 and sleepers["w3"].poll() is None
    finally:
        for proc in sleepers.values():
            proc.kill()
            proc.wait()
        cluster.rundir.rmdir()


def test_stray_messages_from_outside_the_job_are_dropped_and_the_job_finishes_exactly() -> None:
    app = testapps.migrating_app(tasks=300, executors=4, move_prob=0.1)
    app.driver = testapps.StrayMessagesDriver
    res = litz.run(app, workers=2, servers=1)
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    for seqs in res.value["done_seq"]:  # w0 did not leave: every executor's tasks ran, once, in order
        assert sorted(seqs) == list(range(len(seqs)))
    assert sum(len(s) for s in res.value["done_seq"]) == 300
    assert res.value["deferred"] == []  # nothing held for ever (the stall check would never fire)


def test_a_result_is_sent_as_returned_and_rows_read_are_read_only() -> None:
    """Five tasks queued on one executor, each returning its state array, which the next changes:
    each result is the array as its task left it. A row read cannot be written into (other tasks
    of the process share it through the cache)."""
    app = litz.App(testapps.QueueFiveDriver, testapps.AliasingExecutor, tables=[litz.Table("t", (1,), "float64")],
                   num_executors=1)
    res = litz.run(app, workers=1, servers=1).value
    assert [res[i]["state"].tolist() for i in range(5)] == [[k + 1.0] * 3 for k in range(5)]
    assert not any(res[i]["wrote"] for i in range(5))



def test_an_executor_that_cannot_start_is_named() -> None:
    app = litz.App(testapps.CrashDriver, testapps.BadInputExecutor, tables=[litz.Table("t", (1,))], num_executors=2,
                   config={"crash_on": -1})
    with pytest.raises(litz.LitzError) as info:
        litz.run(app, workers=1, servers=1)
    message = str(info.value)
    assert "worker w0 failed to initialise executor 1:" in message
    assert "FileNotFoundError: no partition 1 on this host" in message and "in load_input" in message
