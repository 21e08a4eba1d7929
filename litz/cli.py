"""The ``litz`` command.

``litz launch APP.py [--workers N] [--servers M] [--executors E] [--job NAME] [--etcd URL] [app args]``
runs an application file on an embedded local cluster (or on the etcd named by ``--etcd``).
``litz stop --job NAME [--checkpoint]`` ends it (then ``litz launch`` exits with status 75).
The application file defines ``make_app(argv) -> litz.App`` (its own options are parsed
there, so ``litz launch APP.py --help`` shows them) or a module-level ``app``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import re
import sys
import traceback
from collections.abc import Iterator
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

from litz.api import App
from litz.errors import ConfigError, JobStopped, LitzError, TaskError
from litz.ft.checkpoint import DEFAULT_TIMEOUT
from litz.runtime.stragglers import DEFAULT_FACTOR

#: ``litz launch``'s exit status when ``litz stop`` ended the job (sysexits' EX_TEMPFAIL: it may be resumed)
EXIT_STOPPED = 75


#: Litz's own package: its frames are never the application's.
_PACKAGE = Path(__file__).resolve().parent


def _library_dirs() -> list[Path]:
    """Where Python's standard library and installed packages live."""
    import sysconfig

    paths = sysconfig.get_paths()
    return sorted({Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _within(path: str, roots: list[Path]) -> bool:
    parents = Path(path).resolve().parents
    return any(root in parents for root in roots)


def _code_frames(exc: BaseException) -> tuple[list[traceback.FrameSummary], list[traceback.FrameSummary]]:
    """``exc``'s traceback without importlib's frames, and those of its frames that are code of
    this program: not a library's (the standard library, installed packages: json, pyarrow, ...)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    libraries = _library_dirs()
    return frames, [f for f in frames if not _within(f.filename, libraries)]


def _app_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``exc``'s traceback that are the application's: not Litz's, not importlib's;
    none if the innermost frame of code that is not a library is Litz's, for then Litz called the
    library, and the error is Litz's own, whatever frames of the application led to it."""
    frames, code = _code_frames(exc)
    if code and _within(code[-1].filename, [_PACKAGE]):
        return []
    return [f for f in frames if not _within(f.filename, [_PACKAGE])]


def _app_location(exc: BaseException) -> str:
    """`` (raised at FILE:LINE, in FUNCTION)`` for the application's innermost frame in ``exc``'s
    traceback (the driver's ``ps.update`` of a wrong shape, say), else nothing."""
    own = [f for f in _code_frames(exc)[1] if not _within(f.filename, [_PACKAGE])]
    return f" (raised at {own[-1].filename}:{own[-1].lineno}, in {own[-1].name})" if own else ""


def _app_error(what: str, exc: Exception) -> LitzError:
    """An application's own exception as a LitzError, with the traceback of the app's frames.

    The frames of Litz and of importlib say nothing about the app's bug and bury it, so they are
    left out; the app's frames and the exception (with its causes) are kept. An exception with
    no frame of the app's is Litz's own: its whole traceback is kept."""
    te = traceback.TracebackException.from_exception(exc)
    own = _app_frames(exc)
    if own:
        te.stack = traceback.StackSummary.from_list(own)
    elif isinstance(exc, SyntaxError) and exc.filename and not _within(exc.filename, [_PACKAGE]):
        # the app's file does not parse: its line says it all
        te.stack = traceback.StackSummary.from_list([])
    return LitzError(f"{what}:\n{''.join(te.format()).rstrip()}")


def _lease_seconds(text: str) -> int:
    """``--lease-ttl``: what ``$LITZ_LEASE_TTL`` takes (every process reads it from there)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 1, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    """A command's ``--timeout``: it must leave the master time to answer."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def load_app_module(path: str) -> ModuleType:
    """Import an application file so that worker processes can import it too.

    A file inside a package (e.g. ``apps/mlr.py`` next to ``apps/__init__.py``) is imported
    by its dotted name, with the package's root put on ``sys.path``, so that its classes
    and Numba kernels are pickled by reference (and the kernels' cache is shared). A
    stand-alone script is imported under its own name and shipped by value.
    """
    file = Path(path).resolve()
    if not file.is_file():
        raise LitzError(f"no application file {path!r}")
    parts = [file.stem]
    root = file.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    name = ".".join(parts)
    try:
        if len(parts) > 1:
            return importlib.import_module(name)
        # by its path whatever it is called (``app.txt``, a script without suffix): a source file
        spec = importlib.util.spec_from_file_location(name, file, loader=SourceFileLoader(name, str(file)))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise _app_error(f"cannot load the application {path}", exc) from exc
    cloudpickle.register_pickle_by_value(module)
    return module


def app_from_module(module: ModuleType, argv: list[str]) -> App:
    if hasattr(module, "make_app"):
        try:
            app = module.make_app(argv)
        except LitzError:  # the app's own refusal (ConfigError: a bad option), already precise
            raise
        except Exception as exc:
            raise _app_error(f"{module.__name__}.make_app failed", exc) from exc
    elif hasattr(module, "app"):
        if argv:
            raise LitzError(f"{module.__name__} takes no options (it defines `app`, not `make_app(argv)`)")
        app = module.app
    else:
        raise LitzError(f"{module.__name__} defines neither make_app(argv) nor app")
    if not isinstance(app, App):
        raise LitzError(f"{module.__name__}: make_app must return a litz.App, got {type(app).__name__}")
    return app


def _launch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="litz launch", add_help=False,
                                description="Run an application on an embedded local cluster.")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default 2; with --join 1)")
    p.add_argument("--servers", type=int, default=None, help="parameter-server processes (default 1; with --join 0)")
    p.add_argument("--join", action="store_true",
                   help="add this host's processes to the running job --job on --etcd (no APP.py): "
                        "its master moves executors and shards onto them")
    p.add_argument("--executors", type=int, default=None,
                   help="logical executors (default: the app's, else 4 per worker)")
    p.add_argument("--job", default=None, help="job name (default: generated)")
    p.add_argument("--etcd", default=None, help="etcd URL; default: start a private one on Unix sockets "
                                                 "only this user can reach")
    p.add_argument("--no-cache", action="store_true", help="disable the process cache (for comparison)")
    p.add_argument("--no-update-log", action="store_true",
                   help="no update log: each ps.update call of a task is its own message, sent when the "
                        "task returns (for comparison)")
    p.add_argument("--log-level", default=None, type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="log level of the Litz processes (default WARNING)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="job secret: authenticate and encrypt all traffic with ZeroMQ CURVE (default "
                        "$LITZ_SECRET_FILE; create one with: litz secret PATH)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="take consistent checkpoints under DIR (a path or a pyarrow URI such as s3://...)")
    p.add_argument("--checkpoint-every", default=None, metavar="C",
                   help="checkpoint every C iterations of the driver (5) or seconds (30s); also on demand "
                        "with litz checkpoint --job NAME")
    p.add_argument("--checkpoint", default="full", choices=["full", "priority", "round-robin", "random"],
                   dest="checkpoint_policy",
                   help="full checkpoints every C, or (SCAR) after a full one a fraction r of the rows every r*C: "
                        "those farthest from their saved value (priority), the longest unsaved, or at random")
    p.add_argument("--checkpoint-fraction", type=float, default=1.0, metavar="R",
                   help="the fraction r of rows a partial checkpoint saves (default 1)")
    p.add_argument("--checkpoint-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"a checkpoint that waits longer than this for one of its steps (a hung store) fails "
                        f"and training goes on; a recovery asks a store that fails to answer again for as long "
                        f"(default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--checkpoint-keep", type=int, default=None, metavar="N",
                   help="keep the newest N full checkpoints (and the partial ones after them) and remove older "
                        "ones after each full checkpoint (default: keep everything)")
    p.add_argument("--recovery", default=None, choices=["partial", "full"],
                   help="survive the loss of a worker or server: partial (SCAR) restores only what it held "
                        "from the running checkpoint onto the survivors; full rolls the whole job back to "
                        "its last full checkpoint")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="start from the newest complete checkpoint in DIR (or the checkpoint DIR itself); "
                        "'auto': go on from the run that last ran in --checkpoint-dir (its newest complete "
                        "checkpoint, as its TIMELINE.json records), else from scratch (one command line for "
                        "the first start and every restart)")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address the job's processes listen on (default 127.0.0.1); "
                        "an address beyond loopback requires --secret-file")
    p.add_argument("--relieve-stragglers", action="store_true",
                   help="move executors off workers that run their tasks slower than the others (a busy or "
                        "slower host) until every worker takes about as long for one task of each of its executors")
    p.add_argument("--straggler-factor", type=float, default=None, metavar="F",  # None: not given (1.25 is)
                   help=f"with --relieve-stragglers: move only when that shortens the slowest worker's time "
                        f"by this factor at least (default {DEFAULT_FACTOR:g})")
    p.add_argument("--lease-ttl", default=None, metavar="SECONDS", type=_lease_seconds,
                   help="a process silent this long is declared lost (default $LITZ_LEASE_TTL, else 5); "
                        "more avoids false alarms on a heavily loaded machine")
    return p


#: A value that starts like a negative number (``-5s``, ``-0.5``, ``-.5``), not like an option name.
_NEGATIVE = re.compile(r"-\.?\d")


def _split_launch_args(argv: list[str]) -> tuple[str, argparse.Namespace, list[str]] | str:
    """``(APP.py, litz options, app options)`` of ``litz launch`` arguments, or what is wrong.

    Litz options may come before the application file as well as after it (``litz launch --job
    x app.py --epochs 3``); after it, what Litz does not know is the application's."""
    parser = _launch_parser()
    takes_value = {name for action in parser._actions for name in action.option_strings if action.nargs != 0}
    known = {name for action in parser._actions for name in action.option_strings}
    # a negative number (``--checkpoint-every -5s``) is the option's value, not an option of its own:
    # argparse would say "expected one argument", and Litz's own check says what is wrong. Nothing
    # that looks like an option name is taken for a value (``--job --epochs 3`` lacks the job's
    # name), nor anything after ``--`` (the application's, untouched)
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    for i in range(end - 2, -1, -1):
        if argv[i] in takes_value and _NEGATIVE.match(argv[i + 1]) and argv[i + 1].split("=")[0] not in known:
            argv[i:i + 2] = [f"{argv[i]}={argv[i + 1]}"]
    candidates, i = [], 0
    while i < len(argv):  # arguments that are neither options nor the values of Litz's options
        if argv[i] in takes_value:
            i += 2
            continue
        if not argv[i].startswith("-"):
            candidates.append(i)
        i += 1
    if not candidates:
        return f"name the application file (APP.py) to run; got only options {' '.join(argv)}"
    # the first .py file (an unknown option's value may come before it), else the first candidate
    at = next((c for c in candidates if argv[c].endswith(".py")), candidates[0])
    before, unknown = parser.parse_known_args(argv[:at])
    if unknown:
        return (f"unknown option(s) before {argv[at]}: {' '.join(unknown)} (the application's own options "
                "go after its file)")
    opts, app_argv = parser.parse_known_args(argv[at + 1:], namespace=before)
    return argv[at], opts, app_argv


def _process_env(opts: argparse.Namespace) -> None:
    """Settings every process of this host reads from its environment (they inherit it)."""
    import os

    if opts.log_level:
        os.environ["LITZ_LOG_LEVEL"] = opts.log_level
    if opts.lease_ttl is not None:
        os.environ["LITZ_LEASE_TTL"] = str(opts.lease_ttl)


def launch(argv: list[str]) -> int:
    """``litz launch``: returns the exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: litz launch APP.py [litz options] [app options]\n")
        _launch_parser().print_help()
        return 0
    if "--join" in argv:
        return _join(argv)
    parsed = _split_launch_args(argv)
    if isinstance(parsed, str):
        print(f"litz launch: {parsed}", file=sys.stderr)
        return 2
    path, opts, app_argv = parsed
    opts.workers = 2 if opts.workers is None else opts.workers
    opts.servers = 1 if opts.servers is None else opts.servers
    _process_env(opts)
    logging.basicConfig(level=(opts.log_level or "WARNING").upper(),
                        format="%(asctime)s master %(levelname)s %(name)s: %(message)s")
    from litz.runtime import jobs
    from litz.runtime.launcher import run

    early: str | None = None  # the token of the record taken while the application loads
    try:
        if not opts.relieve_stragglers and opts.straggler_factor is not None:  # (as the checkpoint
            raise ConfigError("--straggler-factor needs --relieve-stragglers")  # options need --checkpoint-dir)
        if opts.job:  # from now on `litz stop` finds the job, while its application loads (seconds, or a
            early = jobs.claim(opts.job, None)  # reference clustering's minutes): it stops it with SIGTERM
        with _stop_while_loading(opts.job or "(unnamed)"):
            module = load_app_module(path)
            app = app_from_module(module, app_argv)
        options: dict[str, Any] = {"cache": not opts.no_cache, "update_log": not opts.no_update_log}
        if opts.relieve_stragglers:  # True: the default factor
            options["straggler_relief"] = True if opts.straggler_factor is None else opts.straggler_factor
        result = run(app, workers=opts.workers, servers=opts.servers, num_executors=opts.executors,
                     job=opts.job, etcd=opts.etcd, options=options, secret_file=opts.secret_file,
                     host=opts.host, checkpoint_dir=opts.checkpoint_dir, checkpoint_every=opts.checkpoint_every,
                     resume=opts.resume, recovery=opts.recovery, checkpoint_policy=opts.checkpoint_policy,
                     checkpoint_fraction=opts.checkpoint_fraction, checkpoint_timeout=opts.checkpoint_timeout,
                     checkpoint_keep=opts.checkpoint_keep)
    except TaskError as exc:
        print(f"litz: job failed: {exc}", file=sys.stderr)
        return 1
    except JobStopped as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except _StoppedLoading as exc:
        print(f"litz: {JobStopped(str(exc), None, 'SIGTERM, while its application loaded')}", file=sys.stderr)
        return EXIT_STOPPED
    except LitzError as exc:  # Litz refused something: where the application's code asked for it, if it did
        print(f"litz: {exc}{_app_location(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("litz: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the app's driver raised in the master, or Litz has a bug (processes are shut down)
        what = "job failed, the driver raised" if _app_frames(exc) else "job failed on an error of Litz's own"
        print(f"litz: {_app_error(what, exc)}", file=sys.stderr)
        return 1
    finally:
        if early is not None:  # (once the job ran, its cluster replaced the record and removed its own)
            jobs.forget(opts.job, early)
    print(f"litz: job {result.job} finished in {result.elapsed:.1f} s, "
          f"{result.tasks_completed} micro-tasks", file=sys.stderr)
    return 0


#: The options of ``litz launch --join``: the host's part; every other one is the job's launcher's.
_JOIN_OPTIONS = frozenset({"join", "workers", "servers", "job", "etcd", "log_level", "secret_file", "host",
                           "lease_ttl"})


class _StoppedLoading(BaseException):  # noqa: N818 - a signal, not an error
    """SIGTERM while the application loads: a BaseException, so that the loading's own error
    handling (any exception of the application's import or ``make_app``) does not take it for a
    failure of the application."""


@contextlib.contextmanager
def _stop_while_loading(job: str) -> Iterator[None]:
    """SIGTERM while the application loads (``litz stop``, or a scheduler, right after the launch)
    ends the launch at once, as a stopped job does (exit 75): nothing has started, nothing is lost.
    Before, the signal's default action killed the launcher (-15), and a ``litz stop`` found no job."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stopped(signum: int, frame: object) -> None:
        raise _StoppedLoading(job)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _job_url(job: str, etcd: str | None) -> str:
    """The etcd of ``job``: ``etcd`` if given, else its local record's; LitzError if the job is
    still loading its application (it has no etcd yet)."""
    from litz.runtime import jobs

    url = etcd or jobs.lookup(job)["etcd"]
    if url is None:
        raise LitzError(f"job {job} is starting: its application is still loading (try again in a moment)")
    return url


def _join(argv: list[str]) -> int:
    """``litz launch --join --job NAME --etcd URL [--workers N] [--servers M] [--host ADDR]``."""
    opts, extra = _launch_parser().parse_known_args(argv)
    if extra:
        print(f"litz: launch --join takes no application or app options (got {' '.join(extra)})", file=sys.stderr)
        return 2
    if not opts.job or not opts.etcd:
        print("litz: launch --join needs --job NAME and --etcd URL of the running job", file=sys.stderr)
        return 2
    defaults = vars(_launch_parser().parse_args([]))
    ignored = sorted(f"--{name.replace('_', '-')}" for name, value in vars(opts).items()
                     if name not in _JOIN_OPTIONS and value != defaults[name])
    if ignored:  # they are the job's, set by its launcher: taken here in silence, they did nothing
        mine = ", ".join(sorted("--" + o.replace("_", "-") for o in _JOIN_OPTIONS - {"join"}))
        print(f"litz: launch --join takes only {mine}; {', '.join(ignored)} belong to the job's own launch",
              file=sys.stderr)
        return 2
    _process_env(opts)
    logging.basicConfig(level=(opts.log_level or "WARNING").upper(),
                        format="%(asctime)s agent %(levelname)s %(name)s: %(message)s")
    from litz.runtime.launcher import join

    try:
        return join(opts.job, opts.etcd, workers=1 if opts.workers is None else opts.workers,
                    servers=opts.servers or 0, host=opts.host, secret_file=opts.secret_file)
    except LitzError as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("litz: interrupted", file=sys.stderr)
        return 130


def job_status(job: str, etcd: str | None = None) -> dict[str, Any]:
    """The status of a running job, read from etcd: its processes and the master's summary."""
    from litz.runtime.master import STATUS_KEY
    from litz.runtime.membership import Membership
    from litz.runtime.node import PROCS

    url = _job_url(job, etcd)
    with Membership(url, job) as mem:
        procs = mem.get_prefix(PROCS)
        status = mem.get(STATUS_KEY) or {}
        if not procs and not status:  # (an ended job's last status is shown, as it ended)
            _check_job_runs(mem, job)
    executors = status.get("executors", {})
    shards = status.get("shards", {})
    processes = []
    for value in sorted(procs.values(), key=lambda v: (v.get("role", ""), v.get("id", ""))):
        entry = {"role": value.get("role"), "id": value.get("id"), "host": value.get("host"),
                 "pid": value.get("pid"), "addr": value.get("addr")}
        if entry["role"] in ("worker", "server"):
            # "joining": registered but not (yet) admitted by the master, e.g. still starting;
            # "unjoined": its join timed out or failed (a host without the job secret, say), the
            # job went on without it; "lost": declared lost, its work recovered elsewhere (its
            # registration lasts until its lease ends); "left": retired by a scale-in, its
            # registration still there (its lease ends by itself if etcd was down as it left)
            held = executors if entry["role"] == "worker" else shards
            entry["state"] = ("lost" if entry["id"] in status.get("lost", ()) else
                              "left" if entry["id"] in status.get("left", ()) else
                              "member" if entry["id"] in held else
                              "unjoined" if entry["id"] in status.get("unjoined", ()) else "joining")
            entry["executors" if entry["role"] == "worker" else "shards"] = held.get(entry["id"], [])
        processes.append(entry)
    summary = {k: v for k, v in status.items() if k not in ("executors", "shards", "lost", "left", "unjoined")}
    return {"job": job, "etcd": url, "master": summary, "processes": processes}


def _ranges(ids: list[int]) -> str:
    """Compact integer list: [0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_recovery(rec: dict[str, Any]) -> str:
    """One line of ``litz status``: what was lost and how it was recovered."""
    what = "shards" if rec["role"] == "server" else "executors"
    source = rec["restored_from"] or "scratch (no checkpoint yet)"
    text = (f"lost {rec['role']} {rec['lost']}: {rec.get('strategy', 'partial')} recovery, {rec['restored']} {what} "
            f"onto {', '.join(rec['onto']) or '-'}, restored from {source}")
    if rec.get("partials"):
        text += f" and the {len(rec['partials'])} partial checkpoints after it"
    for mig in rec.get("settled", []):  # migrations it died in: where their items turned out to be
        items = " ".join(f"{k} {v}" for k, v in mig.items() if k in ("executors", "shards"))
        text += f"; migration {mig['mid']}{' of ' + items if items else ''} settled on {mig['on']}"
    if rec.get("strategy") == "full":
        text += (f", everything rolled back from version {rec['rolled_back_from_version']} "
                 f"to {rec['rolled_back_to_version']}")
    return text + f" in {rec['seconds']:.2f} s"


def describe_checkpoints(master: dict[str, Any]) -> list[str]:
    """``litz status``'s lines on a job's checkpoints, from the master's status: the last
    complete one, and, if every round since it failed, how many and why the newest did (a full
    disk, a store that hangs): an operator must learn that a recovery would go back further
    than the policy says, and why."""
    lines = []
    last, failed = master.get("last_checkpoint"), master.get("checkpoints_failing", 0)
    if last:
        lines.append(f"last checkpoint: {last['kind']} {last.get('name') or last['path']} ({last['seconds']:.2f} s)")
    if failed:
        newest = (master.get("checkpoints") or [{}])[-1]
        lines.append(f"checkpoints failing: the last {failed} failed{'' if last else ' (none complete yet)'}, "
                     f"the newest with: {'; '.join(newest.get('errors') or ['no reason given'])}")
    return lines


def status(argv: list[str]) -> int:
    """``litz status [--job NAME] [--etcd URL] [--json]``: one job, or without ``--job`` the local ones."""
    import json

    p = argparse.ArgumentParser(prog="litz status", description="Show a running job's processes and progress; "
                                                                   "without --job, list the jobs launched here.")
    p.add_argument("--job", default=None)
    p.add_argument("--etcd", default=None, help="etcd URL (default: the one the local launcher recorded)")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    args = p.parse_args(argv)
    if args.job is None:
        return _list_jobs(args.json)
    try:
        st = job_status(args.job, args.etcd)
    except LitzError as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    m = st["master"]
    print(f"job {st['job']}  (etcd {st['etcd']})  {m.get('phase', 'unknown')}  version {m.get('version', '-')}  "
          f"tasks completed {m.get('completed', '-')}  in flight {m.get('inflight', '-')}")
    if m.get("progress"):
        print(f"progress: {m['progress']}")
    for rec in m.get("recoveries", []):
        print(describe_recovery(rec))
    if m.get("recovering"):
        from litz.runtime.master import describe_recovering

        print(describe_recovering(m["recovering"]))
    for line in describe_checkpoints(m):
        print(line)
    if m.get("straggler_moves"):
        last = m["last_straggler_move"]
        print(f"straggler relief: {m['straggler_moves']} executor(s) moved off slower workers, the last "
              f"executor {last['executor']} from {last['from']} to {last['to']}")
    for proc in st["processes"]:
        extra = ""
        if "executors" in proc:
            extra = f"executors {_ranges(proc['executors'])} ({len(proc['executors'])})"
        elif "shards" in proc:
            extra = f"shards {_ranges(proc['shards'])} ({len(proc['shards'])})"
        if proc.get("state") in ("joining", "unjoined", "lost", "left"):
            extra += f" {proc['state']}"
        print(f"  {proc['role']:<7} {proc['id']:<16} host {proc['host']:<16} pid {proc['pid']:<8} {extra}")
    return 0


def _list_jobs(as_json: bool) -> int:
    """The jobs launched on this host that still run, each with its phase and progress from etcd."""
    import json

    from litz.runtime import jobs
    from litz.runtime.master import STATUS_KEY
    from litz.runtime.membership import Membership

    rows = []
    for rec in jobs.local_jobs():
        row = {"job": rec["job"], "etcd": rec["etcd"], "pid": rec["pid"], "phase": "unreachable", "progress": ""}
        if rec["etcd"] is None:  # its launcher still loads the application
            rows.append({**row, "phase": "loading"})
            continue
        try:
            with Membership(rec["etcd"], rec["job"]) as mem:
                st = mem.get(STATUS_KEY) or {}
            row.update(phase=st.get("phase", "starting"), progress=st.get("progress", ""))
        except LitzError:
            pass
        rows.append(row)
    if as_json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no job launched here is running (records in {jobs.jobs_dir()})")
    else:
        for row in rows:
            print(f"{row['job']:<32} {row['phase']:<11} pid {row['pid']:<8} etcd {row['etcd']}  {row['progress']}")
    return 0


class JobEnded(LitzError):
    """The job ended after a command was written, before its answer could be read."""


def _check_job_runs(mem: Any, job: str) -> None:
    """LitzError unless ``job`` runs or starts: a local record names it, or etcd holds its launcher's
    hold or its processes. A job that ended on a shared etcd leaves only its last status there
    (and answers): commands to it waited out their whole timeout, then blamed the master."""
    from litz.runtime import jobs
    from litz.runtime.launcher import LAUNCHER_KEY
    from litz.runtime.master import STATUS_KEY
    from litz.runtime.node import PROCS

    try:
        jobs.lookup(job)
        return
    except LitzError:
        held = mem.get_prefix("")  # asked once: it reads everything under the job's name
    if LAUNCHER_KEY in held or any(key.startswith(PROCS) for key in held):
        return
    phase = (held.get(STATUS_KEY) or {}).get("phase")
    if phase is not None:
        raise LitzError(f"job {job!r} on etcd {mem.url} is not running: it ended ({phase})")
    raise LitzError(f"no job named {job!r} is running on etcd {mem.url}")


def _master_registered(mem: Any, job: str, deadline: float) -> dict[str, Any] | None:
    """Wait until the job's master is registered and return its record (None if not before
    ``deadline``): it watches for commands before it registers, so a command written earlier,
    while the job starts, would be missed. LitzError at once if there is no such job at all (a
    mistyped name), or it ended; JobEnded if it ends meanwhile (its etcd gone with it)."""
    import time

    from litz.errors import EtcdUnreachable
    from litz.runtime.node import MASTER_KEY

    try:
        if (record := mem.get(MASTER_KEY)) is not None:
            return record
        _check_job_runs(mem, job)
        while (record := mem.get(MASTER_KEY)) is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
    except EtcdUnreachable:  # a local job that ended as the command came?
        _ended_if_gone(job, "before it could take the command")
        raise
    return record


def _ended_if_gone(job: str, when: str) -> None:
    """JobEnded if ``job``'s local record is gone (its launcher removes it before it stops the job's
    private etcd): an etcd that no longer answers then means the job ended ``when``, not a failure."""
    from litz.runtime import jobs

    try:
        jobs.lookup(job)
    except LitzError:
        raise JobEnded(f"job {job} ended {when} (its etcd is gone)") from None


def _command(mem: Any, job: str, key: str, command: dict[str, Any], deadline: float,
             secret_file: str | None = None) -> dict[str, Any] | None:
    """Write a command for the master (``command["id"]`` names it) and wait for its answer
    under ``commands/result/<id>``; None if none came before ``deadline``.

    A secured job's master (its registration says ``secured``) takes only commands signed with the
    job secret (``security.sign_command``): ``secret_file`` (``--secret-file``, default
    ``$LITZ_SECRET_FILE``) must name it, else LitzError says so before anything is written.

    The answer is watched, not polled: a job that stops on the command takes its private etcd
    with it a few milliseconds after answering. Should the answer still be missed, a local
    job's etcd gone and its record removed (the launcher removes it before stopping etcd) mean
    the job ended: JobEnded, so ``litz stop`` can tell that from a job that does not answer."""
    import os
    import time

    from litz.errors import EtcdUnreachable
    from litz.runtime import security
    from litz.runtime.elastic import RESULTS

    answer = f"{RESULTS}{command['id']}"
    master = _master_registered(mem, job, deadline)
    if master is None:
        return None
    secret = None
    if master.get("secured"):
        secret_file = secret_file or os.environ.get("LITZ_SECRET_FILE") or None
        if secret_file is None:
            raise LitzError(f"job {job} is secured: its master takes only commands signed with the job secret; "
                            "pass --secret-file PATH (a copy of the job's secret file) or set $LITZ_SECRET_FILE")
        secret = security.load_secret(secret_file)
    mem.watch_prefix(answer)
    mem.put(key, security.sign_command(secret, key, command))
    while True:
        for ev in mem.wait_events(max(0.0, min(0.5, deadline - time.monotonic()))):
            if ev.key == answer and ev.kind == "put" and ev.value:
                return ev.value
        try:
            if (result := mem.get(answer)) is not None:  # a missed event, or a watch that lost its etcd
                return result
        except EtcdUnreachable:
            _ended_if_gone(job, f"before its answer to command {command['id']} could be read")
            raise
        if time.monotonic() > deadline:
            return None


def scale(argv: list[str]) -> int:
    """``litz scale --job NAME (--workers N | --servers M | --drain-host HOST) [--etcd URL] [--wait]``."""
    import secrets as _secrets
    import time

    from litz.runtime.elastic import SCALE_KEY
    from litz.runtime.master import STATUS_KEY
    from litz.runtime.membership import Membership

    p = argparse.ArgumentParser(prog="litz scale", description="Scale a running job in or out; it keeps training.")
    p.add_argument("--job", required=True)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--workers", type=int, help="the number of worker processes wanted")
    size.add_argument("--servers", type=int, help="the number of server processes wanted")
    size.add_argument("--drain-host", metavar="HOST",
                      help="move every executor and shard off HOST (as litz status names it); its processes exit")
    p.add_argument("--etcd", default=None, help="etcd URL (default: the one the local launcher recorded)")
    p.add_argument("--wait", action="store_true", help="return only when the job has reached the new size")
    p.add_argument("--timeout", type=_positive_seconds, default=60.0)
    _secret_option(p)
    args = p.parse_args(argv)
    cid = _secrets.token_hex(4)
    try:
        url = _job_url(args.job, args.etcd)
        with Membership(url, args.job) as mem:
            kind, want = next((k, v) for k, v in (("workers", args.workers), ("servers", args.servers),
                                                   ("drain_host", args.drain_host)) if v is not None)
            deadline = time.monotonic() + args.timeout
            result = _command(mem, args.job, SCALE_KEY, {"id": cid, kind: want}, deadline, args.secret_file)
            if result is None or not result["ok"]:
                print(f"litz: scale refused: {result['reason']}" if result else
                      f"litz: the master did not answer scale command {cid} in {args.timeout:.0f} s", file=sys.stderr)
                return 1
            print(f"scale {cid}: {result['reason']}")
            while args.wait:
                st = mem.get(STATUS_KEY) or {}
                done = [h for h in st.get("scale_history") or [] if h.get("command") == cid]
                if done:
                    return _scale_outcome(cid, kind, want, done[0])
                if time.monotonic() > deadline:
                    print(f"litz: scale command {cid} did not complete in {args.timeout:.0f} s", file=sys.stderr)
                    return 1
                time.sleep(0.1)
    except LitzError as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return 1
    return 0


def _scale_outcome(cid: str, kind: str, want: Any, entry: dict[str, Any]) -> int:
    """Print how a scale operation ended (``--wait``); 1 if the job did not reach the size asked
    for (a new process died, or never joined: a host without the job secret, say)."""
    sizes = f"{len(entry.get('workers', []))} workers and {len(entry.get('servers', []))} servers"
    lost = f"; lost on the way: {', '.join(entry['lost'])}" if entry.get("lost") else ""
    if kind in ("workers", "servers") and len(entry.get(kind, [])) != want:
        print(f"litz: scale {cid} ended with {sizes}, not the {want} {kind} asked for{lost} (see the job's log)",
              file=sys.stderr)
        return 1
    print(f"scale {cid}: done in {entry.get('seconds', float('nan')):.3f} s: {sizes}{lost}")
    return 0


def _ask_master(job: str, etcd: str | None, key: str, fields: dict[str, Any],
                timeout: float, secret_file: str | None = None) -> tuple[str, dict[str, Any] | None]:
    """Send the job's master a command (``key``: which) and wait for its answer: ``(command id,
    answer or None if none came within timeout)``. Raises LitzError if the job cannot be found."""
    import secrets as _secrets
    import time

    from litz.runtime.membership import Membership

    cid = _secrets.token_hex(4)
    url = _job_url(job, etcd)
    with Membership(url, job) as mem:
        return cid, _command(mem, job, key, {"id": cid, **fields}, time.monotonic() + timeout, secret_file)


def _secret_option(p: argparse.ArgumentParser) -> None:
    """``--secret-file`` of the commands sent to a running job: a secured job takes only signed ones."""
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the job secret, for a job launched with one: its master takes only commands signed "
                        "with it (default $LITZ_SECRET_FILE)")


def _answered(result: dict[str, Any] | None, *, late: str, refused: str, done: str) -> int:
    """Print the master's answer to a command (``{reason}`` in ``done`` replaced by its reason); the exit code."""
    if result is None:
        print(f"litz: {late}", file=sys.stderr)
        return 1
    if not result["ok"]:
        print(f"litz: {refused}: {result['reason']}", file=sys.stderr)
        return 1
    print(done.replace("{reason}", str(result["reason"])))  # not format(): a job name may hold braces
    return 0


def checkpoint(argv: list[str]) -> int:
    """``litz checkpoint --job NAME [--etcd URL] [--timeout S]``: take a checkpoint now and wait for it."""
    from litz.runtime.master import CHECKPOINT_KEY

    p = argparse.ArgumentParser(prog="litz checkpoint",
                                description="Take a consistent checkpoint of a running job (launched with "
                                            "--checkpoint-dir).")
    p.add_argument("--job", required=True)
    p.add_argument("--etcd", default=None, help="etcd URL (default: the one the local launcher recorded)")
    p.add_argument("--timeout", type=_positive_seconds, default=120.0)
    _secret_option(p)
    args = p.parse_args(argv)
    try:
        _, result = _ask_master(args.job, args.etcd, CHECKPOINT_KEY, {}, args.timeout, args.secret_file)
    except LitzError as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return 1
    return _answered(result, late=f"no checkpoint within {args.timeout:.0f} s", refused="checkpoint failed",
                     done="checkpoint written: {reason}")


def stop(argv: list[str]) -> int:
    """``litz stop --job NAME [--checkpoint] [--etcd URL] [--timeout S]``: end a running job.

    With ``--checkpoint`` the job first takes a consistent checkpoint (it needs a
    ``--checkpoint-dir``), so that ``litz launch --resume`` continues it later: what a cluster
    scheduler does before it takes the machines back. The job's ``litz launch`` exits with
    status 75 (``EX_TEMPFAIL``: stopped, may be resumed) and names the checkpoint.
    """
    from litz.runtime.master import STOP_KEY

    p = argparse.ArgumentParser(prog="litz stop", description="Stop a running job, optionally after a checkpoint.")
    p.add_argument("--job", required=True)
    p.add_argument("--checkpoint", action="store_true",
                   help="take a consistent checkpoint first (the job needs --checkpoint-dir); resume with --resume")
    p.add_argument("--etcd", default=None, help="etcd URL (default: the one the local launcher recorded)")
    p.add_argument("--timeout", type=_positive_seconds, default=120.0)
    _secret_option(p)
    args = p.parse_args(argv)
    try:
        if args.etcd is None and _signal_a_loading_launcher(args.job):
            return 0
        cid, result = _ask_master(args.job, args.etcd, STOP_KEY, {"checkpoint": args.checkpoint}, args.timeout,
                                  args.secret_file)
    except JobEnded as exc:  # what was asked for: the job no longer runs (its own answer was lost with its etcd)
        print(f"litz: {exc}")
        return 0
    except LitzError as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return 1
    return _answered(result, late=f"the job did not stop within {args.timeout:.0f} s (command {cid})",
                     refused="stop refused", done=f"job {args.job} " + "{reason}")


def _signal_a_loading_launcher(job: str) -> bool:
    """Stop a local job whose launcher still loads its application (its record has no etcd yet: no
    master to ask) with SIGTERM, which ends that launch at once (exit 75); whether it was one."""
    import os
    import signal

    from litz.runtime import jobs

    rec = jobs.lookup(job)
    if rec.get("etcd") is not None:
        return False
    os.kill(int(rec["pid"]), signal.SIGTERM)  # (lookup checked that this pid is still its launcher)
    print(f"litz: job {job} stopped before it started (its application was still loading)")
    return True


def secret(argv: list[str]) -> int:
    """``litz secret PATH``: create a job secret file (32 random bytes, mode 600) for cluster mode."""
    from litz.runtime.security import generate_secret_file

    p = argparse.ArgumentParser(prog="litz secret", description="Create a job secret file for --secret-file.")
    p.add_argument("path")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = p.parse_args(argv)
    try:
        generate_secret_file(args.path, overwrite=args.force)
    except (LitzError, OSError) as exc:
        print(f"litz: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a new job secret to {args.path} (mode 600); copy it to every host of the job")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``litz`` command; returns the exit code."""
    try:
        return _main(argv)
    except BrokenPipeError:  # ``litz status | head``: the reader left, and nothing more can be said
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # as a shell reports a command killed by SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"launch": launch, "status": status, "scale": scale, "checkpoint": checkpoint, "stop": stop,
                "secret": secret}
    if argv and argv[0] in ("-V", "--version"):
        from litz import __version__

        print(f"litz {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        helpful = not argv or argv[0] in ("-h", "--help")
        if not helpful:
            print(f"litz: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: litz COMMAND ...   (litz --version: the installed version)\n\ncommands:\n"
              "  launch      run an application (litz launch --help)\n"
              "  status      show a running job, or list the local ones (litz status --help)\n"
              "  scale       resize a running job (litz scale --help)\n"
              "  checkpoint  take a checkpoint of a running job (litz checkpoint --help)\n"
              "  stop        stop a running job, optionally after a checkpoint (litz stop --help)\n"
              "  secret      create a job secret file for cluster mode (litz secret PATH)",
              file=sys.stdout if helpful else sys.stderr)
        return 0 if helpful else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
