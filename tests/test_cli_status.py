"""``litz status`` on a running local job: found by name, processes with roles, pids, executors, shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import litz
from litz.errors import LitzError
from tests import testapps
from tests.conftest import run_in_thread

ROOT = Path(__file__).resolve().parent.parent


def test_status_of_a_running_job(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    job = f"status-{time.time_ns()}"
    stop = tmp_path / "stop"
    runner, out = run_in_thread(testapps.slow_app(executors=5, stop_after=30.0, stop_file=str(stop)), workers=2,
                                servers=2, job=job)
    env = dict(os.environ, LITZ_JOBS_DIR=str(tmp_path))
    try:
        deadline = time.monotonic() + 20
        while True:
            proc = subprocess.run([sys.executable, "-m", "litz.cli", "status", "--job", job, "--json"], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=30)
            if proc.returncode == 0:
                st = json.loads(proc.stdout)
                if st["master"].get("phase") == "running":
                    break
            assert time.monotonic() < deadline, proc.stderr
            time.sleep(0.3)
        roles = sorted(p["role"] for p in st["processes"])
        assert roles == ["agent", "master", "server", "server", "worker", "worker"]
        workers = {p["id"]: p for p in st["processes"] if p["role"] == "worker"}
        assert sorted(e for p in workers.values() for e in p["executors"]) == [0, 1, 2, 3, 4]
        servers = [p for p in st["processes"] if p["role"] == "server"]
        assert sorted(s for p in servers for s in p["shards"]) == list(range(64))
        for p in st["processes"]:
            assert isinstance(p["pid"], int) and p["host"]
            if p["role"] in ("worker", "server"):
                assert Path(f"/proc/{p['pid']}").exists()
        assert st["master"]["version"] >= 0 and st["master"]["progress"].startswith("slow job")
        text = subprocess.run([sys.executable, "-m", "litz.cli", "status", "--job", job], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=30).stdout
        assert "executors 0-2 (3)" in text or "executors 0-1 (2)" in text
        # a mistyped name on the job's etcd: no such job, at once, for status and the commands alike
        for cmd in (["status"], ["stop"], ["checkpoint"], ["scale", "--workers", "3"]):
            wrong = subprocess.run([sys.executable, "-m", "litz.cli", *cmd, "--job", f"x{job}", "--etcd", st["etcd"]],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
            assert wrong.returncode == 1 and f"no job named 'x{job}' is running on etcd" in wrong.stderr, (cmd, wrong)
        # without --job: the local jobs; a record whose launcher is gone (kill -9) is stale and pruned
        ghost = {"job": "ghost", "etcd": "http://127.0.0.1:9", "pid": 2**22 + 7}  # above any pid_max
        (tmp_path / "ghost.json").write_text(json.dumps(ghost))
        listing = subprocess.run([sys.executable, "-m", "litz.cli", "status", "--json"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=30)
        rows = json.loads(listing.stdout)
        assert [(r["job"], r["phase"]) for r in rows] == [(job, "running")] and rows[0]["pid"] == os.getpid()
        assert not (tmp_path / "ghost.json").exists()
    finally:
        stop.touch()
        runner.join(60)
    assert out["res"].value == "done"
    # the record is gone with the job: status now says so
    proc = subprocess.run([sys.executable, "-m", "litz.cli", "status", "--job", job], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and f"no local job named {job!r}" in proc.stderr


def test_status_says_what_was_lost_and_how_it_was_recovered() -> None:
    from litz.cli import describe_recovery

    partial = {"lost": "s1", "role": "server", "strategy": "partial", "restored": 21, "onto": ["s0", "s2"],
               "restored_from": "/ck/ckpt-000003", "seconds": 0.125}
    assert describe_recovery(partial) == ("lost server s1: partial recovery, 21 shards onto s0, s2, "
                                          "restored from /ck/ckpt-000003 in 0.12 s")
    partial.update(partials=["/ck/ckpt-000004", "/ck/ckpt-000005"])
    assert describe_recovery(partial) == ("lost server s1: partial recovery, 21 shards onto s0, s2, "
                                          "restored from /ck/ckpt-000003 and the 2 partial checkpoints after it "
                                          "in 0.12 s")
    worker = {"lost": "w2", "role": "worker", "strategy": "partial", "restored": 3, "onto": ["w0", "w1"],
              "restored_from": "/ck/ckpt-000003", "seconds": 0.25,
              "settled": [{"mid": 7, "executors": [4], "on": "w2"}, {"mid": 8, "on": "w0"}]}
    assert describe_recovery(worker) == ("lost worker w2: partial recovery, 3 executors onto w0, w1, restored from "
                                         "/ck/ckpt-000003; migration 7 of executors [4] settled on w2; migration 8 "
                                         "settled on w0 in 0.25 s")
    full = {"lost": "w1", "role": "worker", "strategy": "full", "restored": 2, "onto": ["w0"],
            "restored_from": None, "rolled_back_from_version": 534, "rolled_back_to_version": 0, "seconds": 1.5}
    assert describe_recovery(full) == ("lost worker w1: full recovery, 2 executors onto w0, restored from scratch "
                                       "(no checkpoint yet), everything rolled back from version 534 to 0 in 1.50 s")


def test_status_says_what_a_recovery_in_progress_waits_for() -> None:
    from litz.runtime.master import describe_recovering

    r = {"lost": ["s1", "s3"], "role": "server", "settling": [], "waiting": ["s0", "s2"],
         "restored_from": "s3://b/ck/ckpt-000004", "seconds": 41.25}
    assert describe_recovering(r) == ("recovering from the loss of server s1, s3 for 41.2 s: s0, s2 restoring its "
                                      "shards from s3://b/ck/ckpt-000004")
    r.update(role="worker", lost=["w1"], waiting=["w0"], restored_from=None)
    assert describe_recovering(r) == ("recovering from the loss of worker w1 for 41.2 s: w0 restoring its executors "
                                      "from scratch (no checkpoint yet)")
    r.update(settling=["w2"])
    assert describe_recovering(r).endswith(": w2 settling the migrations it interrupted")
    r.update(settling=[], waiting=[])
    assert describe_recovering(r).endswith(": planning")
    r.update(reading=True)
    assert describe_recovering(r).endswith(": reading the running checkpoint")
    r.update(waiting=["w0"], store_error="w0: cannot read checkpoint file /ck/executors-w1.arrow: timed out")
    assert describe_recovering(r).endswith(": waiting for the checkpoint storage to answer (w0: cannot read "
                                           "checkpoint file /ck/executors-w1.arrow: timed out)")


def test_status_says_when_checkpoints_keep_failing() -> None:
    from litz.cli import describe_checkpoints
    from litz.ft.checkpoint import CheckpointCoordinator

    def record(cid: int, ok: bool, error: str = "") -> dict:
        return {"cid": cid, "kind": "full", "ok": ok, "errors": [error] if error else [],
                "path": f"/ck/ckpt-{cid:06d}", "name": f"/ck/ckpt-{cid:06d}", "seconds": 0.25}

    def lines(records: list[dict]) -> list[str]:  # what the master publishes, as litz status shows it
        ck = CheckpointCoordinator("/ck")
        for r in records:
            ck.add_record(r)
        return describe_checkpoints({"checkpoints": list(ck.completed)[-5:], "last_checkpoint": ck.last_complete(),
                                     "checkpoints_failing": ck.failed_in_a_row()})

    hung = "timed out after 300 s waiting for server-1's part"
    assert lines([]) == []
    assert lines([record(1, True)]) == ["last checkpoint: full /ck/ckpt-000001 (0.25 s)"]
    assert lines([record(1, False, hung), record(2, True)]) == ["last checkpoint: full /ck/ckpt-000002 (0.25 s)"]
    # seven failures in a row: more than the five rounds the status lists, the last complete one still named
    assert lines([record(1, True)] + [record(i, False, hung) for i in range(2, 8)] + [record(8, False, "disk full")]) \
        == ["last checkpoint: full /ck/ckpt-000001 (0.25 s)",
            "checkpoints failing: the last 7 failed, the newest with: disk full"]
    assert lines([record(1, False, hung)]) == [
        "checkpoints failing: the last 1 failed (none complete yet), the newest with: " + hung]
    # the master keeps the newest HISTORY records (a long job finishes hundreds of thousands of rounds),
    # and status still reaches past them
    from litz.ft.checkpoint import HISTORY

    assert lines([record(1, True)] + [record(i, False, hung) for i in range(2, HISTORY + 12)]) == [
        "last checkpoint: full /ck/ckpt-000001 (0.25 s)",
        f"checkpoints failing: the last {HISTORY + 10} failed, the newest with: {hung}"]
    ck = CheckpointCoordinator("/ck")
    for i in range(HISTORY + 5):
        ck.add_record(record(i, True))
    assert len(ck.completed) == HISTORY and ck.completed[0]["cid"] == 5 and ck.last_complete()["cid"] == HISTORY + 4


def test_an_unknown_command_is_named_and_fails(capsys) -> None:
    from litz.cli import main

    assert main(["frob"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frob'" in err and "checkpoint  take a checkpoint" in err
    assert main(["--help"]) == 0
    assert "launch      run an application" in capsys.readouterr().out
    import litz

    assert main(["--version"]) == 0 and capsys.readouterr().out == f"litz {litz.__version__}\n"


def test_a_reader_that_leaves_early_ends_the_command_quietly(monkeypatch, capsys) -> None:
    # `litz status | head -1`: the pipe closes under the command; no traceback, the shell's SIGPIPE status
    import litz.cli

    def leave(argv: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(litz.cli.__dict__, "status", leave)
    with capsys.disabled():
        saved = os.dup(1)
        try:
            assert litz.cli.main(["status"]) == 141
        finally:
            os.dup2(saved, 1)
            os.close(saved)


@pytest.mark.parametrize("source, heading, line", [
    ('raise RuntimeError("boom at import")\n', "cannot load the application", 1),
    ('def helper():\n    raise ValueError("bad option table")\n\n\ndef make_app(argv):\n    helper()\n',
     "make_app failed", 2),
    ("import litz\n\n\nclass D(litz.Driver):\n    def dispatch_initial_tasks(self):\n"
     "        raise KeyError('bad option table')\n\n\ndef make_app(argv):\n"
     "    return litz.App(D, litz.Executor, num_executors=1)\n", "job failed, the driver raised", 6),
    ("import json\n\n\ndef make_app(argv):\n    return json.loads('{')\n", "make_app failed", 5),
    ("this is ( not python\n", "cannot load the application", 1),
])
def test_an_application_that_raises_is_reported_with_its_own_traceback(tmp_path: Path, capsys, source: str,
                                                                        heading: str, line: int) -> None:
    """An app file that fails on import, in make_app or in its driver: exit status 1 and its
    traceback from its own frames on (the line that raised included), not Litz's and importlib's
    frames (before, each came out as a raw traceback through litz/cli.py and the master)."""
    from litz.cli import main

    app = tmp_path / "broken_app.py"
    app.write_text(source)
    assert main(["launch", str(app)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("litz: ") and heading in err, err
    assert f'File "{app}", line {line}' in err, err
    assert any(why in err for why in ("boom at import", "bad option table", "JSONDecodeError", "SyntaxError")), err
    assert "litz/cli.py" not in err and "litz/runtime" not in err and "importlib" not in err, err
    if heading.startswith("cannot load"):  # a half-imported module is not left behind
        assert "broken_app" not in sys.modules
    sys.modules.pop("broken_app", None)


def test_a_command_whose_job_ends_with_its_etcd_is_told_from_an_unreachable_etcd(tmp_path: Path,
                                                                                monkeypatch) -> None:
    """The CLI watches for the master's answer (a job stopping on it takes its private etcd along
    milliseconds later). If the etcd is gone before an answer was read: a job whose local record
    was removed has ended (JobEnded, which `litz stop` counts as done); one still recorded is an
    unreachable etcd, an error."""
    from litz.cli import JobEnded, _command
    from litz.errors import EtcdUnreachable
    from litz.runtime import jobs
    from litz.runtime.etcd_server import LocalEtcd
    from litz.runtime.membership import Membership
    from litz.runtime.node import proc_key

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))

    def master(url: str) -> None:  # registers late (a job starting), then answers the command once it appears
        with Membership(url, "cmd") as m:
            time.sleep(0.5)
            m.put(proc_key("master", "master"), {"role": "master"})
            while (cmd := m.get("commands/stop")) is None:
                time.sleep(0.01)
            m.put(f"commands/result/{cmd['id']}", {"ok": True, "reason": "stopped on request"})

    with LocalEtcd() as etcd, Membership(etcd.url, "cmd") as cli:
        # no such job (no local record, nothing on etcd): said at once, nothing written
        started = time.monotonic()
        with pytest.raises(LitzError, match=f"no job named 'cmd' is running on etcd {etcd.url}"):
            _command(cli, "cmd", "commands/stop", {"id": "a0"}, time.monotonic() + 20)
        assert time.monotonic() - started < 2 and cli.get_prefix("") == {}
        # a job starting (recorded, its master not registered yet): the command waits for the master,
        # which watches for commands before it registers, so none is written where it would be missed
        jobs.claim("cmd", etcd.url)
        answering = threading.Thread(target=master, args=(etcd.url,), daemon=True)
        answering.start()
        answer = _command(cli, "cmd", "commands/stop", {"id": "a1"}, time.monotonic() + 20)
        assert answer is not None and answer["ok"] and answer["reason"] == "stopped on request"
        answering.join(10)
        jobs.forget("cmd")

    for recorded, expected in ((False, JobEnded), (True, EtcdUnreachable)):
        etcd = LocalEtcd()
        etcd.start()
        try:
            jobs.claim("cmd", etcd.url)
            with Membership(etcd.url, "cmd", connect_timeout=1.0) as cli:  # gone etcd: told in 1 s, not 5
                cli.put(proc_key("master", "master"), {"role": "master"})
                if not recorded:
                    jobs.forget("cmd")
                threading.Timer(0.3, etcd.stop).start()  # nobody answers; the etcd goes away
                with pytest.raises(expected) as info:
                    _command(cli, "cmd", "commands/stop", {"id": "a2"}, time.monotonic() + 60)
                assert expected is not JobEnded or "job cmd ended before its answer to command a2" in str(info.value)
        finally:
            etcd.stop()
            jobs.forget("cmd")


def test_a_job_name_in_use_and_a_host_joining_twice_are_refused(tmp_path: Path, monkeypatch, etcd) -> None:
    """A second job may not take the name of a running one: on the same host (one record per name, or
    the first to end would take the other's away from `litz status`), nor on the same etcd from another
    host (the second job's processes would replace the first's keys, and their exit would look to the
    first job like its master's loss: it failed so before). Nor may a host join a job it is already in
    (both agents would start the processes asked of it; the second replaced the first's key). All are
    refused before any process starts, the first job runs on with exact sums and no recovery, and the
    name is free once it ends."""
    import socket

    from litz.cli import job_status
    from litz.errors import ConfigError
    from litz.runtime import jobs
    from tests.conftest import processes_mentioning, run_in_thread, wait_running

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "here"))
    job = f"dup-{time.time_ns()}"
    stop = tmp_path / "stop"
    app = testapps.migrating_app(tasks=10**7, executors=4, move_prob=0.0)
    app.driver = testapps.TimedMigratingDriver
    app.config.update(stop_after=60.0, stop_file=str(stop))
    t, out = run_in_thread(app, workers=1, servers=1, job=job, etcd=etcd.url)
    try:
        wait_running(job, out)
        small = testapps.migrating_app(tasks=20, executors=2, move_prob=0.0)
        with pytest.raises(ConfigError, match=f"a job named '{job}' is already running on this host"):
            litz.run(small, workers=1, servers=1, job=job)  # its own etcd: the record is what collides
        # another host (its own jobs folder) on the same etcd
        # a 1 s lease: a refused launcher tries a taken name again for a lease time-to-live (+1 s) first
        env = dict(os.environ, LITZ_JOBS_DIR=str(tmp_path / "there"), LITZ_LEASE_TTL="1")
        other = subprocess.run([sys.executable, "-m", "litz.cli", "launch", "--job", job, "--etcd", etcd.url,
                                "examples/sum.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert other.returncode == 1, other.stderr
        assert f"a job named '{job}' is already running on etcd {etcd.url}" in other.stderr
        assert f"pid {os.getpid()}" in other.stderr
        # a host joins a job once: a second agent here would also start what the master asks of this host
        joiner = subprocess.run([sys.executable, "-m", "litz.cli", "launch", "--join", "--job", job, "--etcd",
                                 etcd.url, "--workers", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
        assert joiner.returncode == 1, joiner.stderr
        assert f"already takes part in job '{job}' (its agent is pid {os.getpid()}" in joiner.stderr
        assert jobs.lookup(job)["pid"] == os.getpid()  # the refused ones took nothing away
        assert sorted(p["id"] for p in job_status(job)["processes"]) == ["agent-" + socket.gethostname(),
                                                                         "master", "s0", "w0"]
        done = out.get("res")
        assert done is None, "the first job ended early"
    finally:
        stop.touch()
        t.join(60)
    assert "error" not in out, out.get("traceback")
    res = out["res"]
    np.testing.assert_array_equal(res.value["final"], res.value["truth"])
    assert res.stats["master"]["recoveries"] == []
    again = litz.run(small, workers=1, servers=1, job=job, etcd=etcd.url)  # the name is free again
    np.testing.assert_array_equal(again.value["final"], again.value["truth"])
    assert processes_mentioning(job) == []


def test_a_stale_job_record_is_replaced_and_a_refused_launcher_removes_nothing(tmp_path: Path, monkeypatch) -> None:
    """A record whose launcher is gone, or whose pid now belongs to another process (it started at
    another time), is replaced; a live one is kept; forget() with another record's token leaves it.
    A jobs folder that cannot be written is a clear error for a launcher, and an empty list for
    `litz status`."""
    from litz.errors import ConfigError
    from litz.runtime import jobs

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    path = tmp_path / "j.json"
    for stale in ({"job": "j", "etcd": "x", "pid": 2**22 + 7},  # above any pid_max
                  {"job": "j", "etcd": "x", "pid": 1, "started": -1}):  # pid 1 did not start then
        path.write_text(json.dumps(stale))
        token = jobs.claim("j", "http://127.0.0.1:1")
        assert jobs.lookup("j")["token"] == token and jobs.lookup("j")["pid"] == os.getpid()
        with pytest.raises(ConfigError, match="already running on this host"):
            jobs.claim("j", "http://127.0.0.1:2")
        jobs.forget("j", "another token")
        assert jobs.lookup("j")["etcd"] == "http://127.0.0.1:1"
        jobs.forget("j", token)
        assert not path.exists()
    (tmp_path / "file").write_text("")  # a jobs folder that cannot be made: a clear error, and no listing error
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "file" / "jobs"))
    with pytest.raises(ConfigError, match="cannot write the record of job 'j' in .*: set LITZ_JOBS_DIR"):
        jobs.claim("j", "http://127.0.0.1:1")
    assert jobs.local_jobs() == []


def test_an_error_raised_in_a_library_litz_called_is_litz_own() -> None:
    """A standard-library (or pyarrow) error raised under Litz's own code is Litz's error, not the
    application's, even if the application's code called Litz; raised under the app's, it is the app's."""
    import litz.cli as cli

    inside: dict = {}
    exec(compile("import json\n\n\ndef parse():\n    return json.loads('{')\n",
                 str(Path(cli.__file__).parent / "_pretend_module.py"), "exec"), inside)

    def app_calls_litz() -> None:
        inside["parse"]()

    def app_calls_json() -> None:
        json.loads("{")

    for fn, app_owned in ((app_calls_litz, False), (app_calls_json, True)):
        with pytest.raises(json.JSONDecodeError) as info:
            fn()
        frames = cli._app_frames(info.value)
        assert bool(frames) == app_owned
        assert not any(f.filename.endswith("_pretend_module.py") for f in frames)


def test_bad_command_line_values_are_refused_before_anything_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    from litz.cli import main
    from litz.errors import ConfigError
    from litz.runtime.membership import _parse_endpoints

    app_file = ROOT / "examples" / "sum.py"
    for argv, why in ((["launch", "--log-level", "bogus", str(app_file)], "invalid choice: 'BOGUS'"),
                      (["stop", "--job", "j", "--timeout", "0"], "must be a positive number of seconds, got 0"),
                      (["checkpoint", "--job", "j", "--timeout", "-5"], "must be a positive number of seconds"),
                      (["scale", "--job", "j", "--workers", "3", "--timeout", "abc"], "'abc' is not a number")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and why in capsys.readouterr().err, argv
    assert main(["launch", "--job", "a/b", str(app_file)]) == 1  # before any directory is made from the name
    assert "bad job name 'a/b'" in capsys.readouterr().err
    monkeypatch.setenv("LITZ_LOG_LEVEL", "bogus")
    assert main(["launch", str(app_file)]) == 1 and "unknown log level 'bogus'" in capsys.readouterr().err
    monkeypatch.delenv("LITZ_LOG_LEVEL")
    for url in ("notaurl:::", "localhost:abc", "http://127.0.0.1:99999", "http://127.0.0.1:0", "http://a b:1"):
        with pytest.raises(ConfigError, match="is not of the form http://HOST:PORT"):
            _parse_endpoints(url)
    assert _parse_endpoints("http://127.0.0.1:2379, [::1]:2380") == ["127.0.0.1:2379", "[::1]:2380"]
    assert _parse_endpoints("unix:///dev/shm/litz-etcd-x/client:1") == ["unix:///dev/shm/litz-etcd-x/client:1"]
    for url in ("unix://relative/client:1", "unix:///a/client:1,unix:///b/client:1"):
        with pytest.raises(ConfigError, match="is not of the form unix:///ABSOLUTE/PATH"):
            _parse_endpoints(url)
    # an application file is a Python source file, whatever its name ends with
    script = tmp_path / "sum_app.txt"
    script.write_text(app_file.read_text())
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    assert main(["launch", str(script)]) == 0 and "sum 499500" in capsys.readouterr().out
    # a value of Litz's own option that ends in .py is not taken for the application file
    assert main(["launch", "--job", "nightly.py", str(app_file)]) == 0
    assert "job nightly.py finished" in capsys.readouterr().err


def test_scale_wait_says_when_the_size_asked_for_was_not_reached(capsys) -> None:
    from litz.cli import _scale_outcome

    reached = {"seconds": 0.4, "workers": ["w0", "w1", "w2"], "servers": ["s0"], "lost": []}
    assert _scale_outcome("c1", "workers", 3, reached) == 0
    assert "scale c1: done in 0.400 s: 3 workers and 1 servers" in capsys.readouterr().out
    died = {"seconds": 0.4, "workers": ["w0", "w1"], "servers": ["s0"], "lost": ["w2"]}  # the new one died
    assert _scale_outcome("c2", "workers", 3, died) == 1
    assert ("scale c2 ended with 2 workers and 1 servers, not the 3 workers asked for; lost on the way: w2"
            in capsys.readouterr().err)
    assert _scale_outcome("c3", "drain_host", "h", died) == 0  # a drain has no size to reach


def test_a_refusal_of_the_drivers_own_call_says_where_it_was_made(tmp_path: Path, capsys) -> None:
    from litz.cli import main

    app = tmp_path / "bad_driver.py"
    app.write_text("import numpy as np\nimport litz\n\n\nclass D(litz.Driver):\n"
                   "    def dispatch_initial_tasks(self):\n        self.ps.update('t', 0, np.ones(5))\n\n\n"
                   "def make_app(argv):\n    return litz.App(D, litz.Executor, tables=[litz.Table('t', (2,))], "
                   "num_executors=1)\n")
    assert main(["launch", str(app)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"litz: table 't': update of key 0 has shape (5,), expected (2,) (raised at {app}:7, in "
                   "dispatch_initial_tasks)"), err
    sys.modules.pop("bad_driver", None)


def test_status_says_how_many_executors_straggler_relief_moved(monkeypatch, capsys) -> None:
    """Without a job: ``litz status`` prints the master's count of straggler moves and the last one."""
    from litz import cli

    master = {"phase": "running", "version": 9, "completed": 9, "inflight": 1, "straggler_moves": 2,
              "last_straggler_move": {"executor": 6, "from": "w0", "to": "w1", "time": 0.0}}
    monkeypatch.setattr(cli, "job_status", lambda job, etcd=None: {"job": job, "etcd": "x", "master": master,
                                                                   "processes": []})
    assert cli.status(["--job", "j"]) == 0
    assert ("straggler relief: 2 executor(s) moved off slower workers, the last executor 6 from w0 to w1"
            in capsys.readouterr().out)


def test_job_names_records_and_ended_jobs_are_told_at_once(tmp_path: Path, monkeypatch) -> None:
    """Without a job: a name starting with '-' (every process took it for an option, after the job
    had started) or too long for a file name is refused; a record left by a launcher killed with
    ``kill -9`` names no job and is removed (commands said after 5 s that etcd did not answer); a job
    that ended on a shared etcd, where only its status is left, is said to have ended (commands
    waited out their timeout)."""
    from litz.cli import _check_job_runs
    from litz.runtime import jobs

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    for bad in ("-x", "y" * 260):
        with pytest.raises(litz.ConfigError, match="bad job name"):
            jobs.check_name(bad)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "gone.json").write_text(json.dumps({"job": "gone", "etcd": "unix:///nowhere", "pid": dead.pid}))
    with pytest.raises(litz.ConfigError, match=f"its launcher \\(pid {dead.pid}\\) is gone"):
        jobs.lookup("gone")
    assert not (tmp_path / "gone.json").exists()

    class Etcd:
        url = "http://etcd:2379"

        def __init__(self, held: dict) -> None:
            self.held = held

        def get_prefix(self, prefix: str) -> dict:
            return self.held

    with pytest.raises(LitzError, match="job 'gone' on etcd http://etcd:2379 is not running: it ended \\(finished\\)"):
        _check_job_runs(Etcd({"status": {"phase": "finished"}, "commands/result/x": {}}), "gone")
    with pytest.raises(LitzError, match="no job named 'gone' is running"):
        _check_job_runs(Etcd({}), "gone")
    _check_job_runs(Etcd({"launcher": {"pid": 1}, "status": {"phase": "finished"}}), "gone")  # a new run starts


def test_launch_options_that_a_joining_host_or_a_launch_would_ignore_are_refused() -> None:
    """``--join`` took the job's own options (``--executors``, ``--resume``, ...) and did nothing with
    them; ``--straggler-factor`` without ``--relieve-stragglers`` was ignored (and the default's
    value, 1.25, was still taken after the check came: it compared the value with the default)."""
    join = subprocess.run([sys.executable, "-m", "litz.cli", "launch", "--join", "--job", "h", "--etcd",
                           "http://127.0.0.1:1", "--executors", "9", "--resume", "auto"],
                          capture_output=True, text=True, timeout=60)
    assert join.returncode == 2 and "--executors, --resume belong to the job's own launch" in join.stderr
    factor = subprocess.run([sys.executable, "-m", "litz.cli", "launch", "apps/mlr.py", "--straggler-factor", "2"],
                            capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert factor.returncode == 1 and "--straggler-factor needs --relieve-stragglers" in factor.stderr
    default = subprocess.run([sys.executable, "-m", "litz.cli", "launch", "apps/mlr.py", "--straggler-factor", "1.25"],
                             capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert default.returncode == 1 and "--straggler-factor needs --relieve-stragglers" in default.stderr


def test_a_stop_right_after_the_launch_while_the_application_loads_stops_it(tmp_path: Path) -> None:
    """A scheduler's ``litz stop`` (or SIGTERM) while ``litz launch`` still imports the application
    found no job (the record was written once the cluster started), and the job then ran to its
    end; a SIGTERM then killed the launcher with -15. Now the name is recorded as the launch
    begins, and the stop ends it at once with 75, nothing started and no record left."""
    app = tmp_path / "slow_import.py"
    app.write_text("import time\ntime.sleep(30)\n")
    env = dict(os.environ, LITZ_JOBS_DIR=str(tmp_path / "jobs"))
    job = f"loading-{time.time_ns()}"
    launcher = subprocess.Popen([sys.executable, "-m", "litz.cli", "launch", str(app), "--job", job],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "jobs" / f"{job}.json").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        status = subprocess.run([sys.executable, "-m", "litz.cli", "status"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert job in status.stdout and "loading" in status.stdout, status.stdout
        stop = subprocess.run([sys.executable, "-m", "litz.cli", "stop", "--job", job], env=env,
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0 and "stopped before it started" in stop.stdout, (stop.stdout, stop.stderr)
        _, err = launcher.communicate(timeout=20)
        assert launcher.returncode == 75 and f"job {job} was stopped on request (SIGTERM" in err, err
        assert not (tmp_path / "jobs" / f"{job}.json").exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
