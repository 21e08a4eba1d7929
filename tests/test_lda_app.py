"""The LDA application: the fast sampler draws from the exact conditional, a multi-process run keeps
every count exact and recovers known topics, the CLI runs it, and the text loaders behave.

The count invariants are the point of model scheduling: if two executors ever sampled the same words
at once, or an update were lost or applied twice, the word-topic table would drift away from the
counts of the executors' final assignments, so the test compares them exactly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chisquare

import litz
from apps import lda
from apps import lda_kernels as lk
from apps.datasets import build_corpus, load_text_corpus, read_fortunes, read_wordnet_glosses, tokenize
from litz.cli import job_status, scale
from tests.conftest import calls_function, counts_references, machine_code, processes_mentioning, run_in_thread

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    lk.warmup()


# ----------------------------------------------------------------------------------------------------
# the samplers
# ----------------------------------------------------------------------------------------------------

# (K, document topics, their counts, the token's topic k0, alpha, beta): the token's own count is 1 in
# some cases (its topic leaves the document when taken out) and several in others; large priors make
# the word and smoothing buckets carry real mass, small ones leave almost everything to the doc bucket.
CASES = [
    (50, [3, 7, 11, 40], [5, 1, 2, 9], 7, 0.1, 0.01),
    (50, [3, 7, 11, 40], [5, 1, 2, 9], 40, 2.0, 0.5),
    (8, [0, 1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 2, 3, 1, 1], 5, 0.5, 0.1),
    (200, [17], [1], 17, 0.05, 0.01),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sparse_and_exact_samplers_draw_the_true_conditional(case: int) -> None:
    K, topics, counts, k0, alpha, beta = CASES[case]
    rng = np.random.default_rng(case)
    V = 300
    row = rng.integers(0, 4, K) * (rng.random(K) < 0.3)
    row[k0] += 1  # the token itself is counted in its word's row...
    totals = row + rng.integers(20, 200, K)  # ...and in the totals
    removed = np.array(counts) - (np.array(topics) == k0)
    row_removed = row - (np.arange(K) == k0)
    p = lk.conditional(topics, removed, row_removed, totals - (np.arange(K) == k0), alpha, beta, V * beta)
    n = 200_000
    expected = n * p
    keep = expected >= 5  # chi-square needs non-tiny expected counts; pool the rest into one bin
    for sampler in ("sparse", "exact"):
        hist = lk.draw_topics(sampler, topics, counts, k0, row, totals, alpha, beta, V * beta, n, seed=case)
        assert hist.sum() == n and (hist[p == 0] == 0).all()
        obs = np.append(hist[keep], hist[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        result = chisquare(obs, exp)
        assert result.pvalue > 1e-4, (sampler, result)
        assert np.abs(hist / n - p).max() < 0.01, sampler


@pytest.mark.parametrize("K", [6, 16, 17])  # 16 topics fill 4 bits of a packed pair, 17 need 5
@pytest.mark.parametrize("sampler", sorted(lk.SAMPLERS))
def test_sweeps_keep_every_count_consistent(sampler: str, K: int) -> None:
    corpus, _ = lda.synthetic_corpus(num_docs=60, doc_len=15, num_topics=4, words_per_topic=6, seed=3)
    V, beta, alpha = corpus.num_words, 0.01, 0.1
    doc_len = np.diff(corpus.doc_ptr)
    tok_doc = np.repeat(np.arange(corpus.num_docs), doc_len)
    order = np.lexsort((tok_doc, corpus.words))
    tok_word = corpus.words[order].astype(np.int32)
    off = lk.doc_offsets(doc_len, K)
    tok_off = off[tok_doc[order]].astype(np.int32)
    z = np.random.default_rng(0).integers(0, K, len(tok_word)).astype(np.int32)
    doc_list = lk.build_doc_lists(tok_off, z, int(off[-1]), K)
    rows = np.zeros((V, K), np.int32)
    np.add.at(rows, (tok_word, z), 1)
    totals = rows.sum(0).astype(np.int64)
    table = lk.lgamma_table(beta, int(rows.max()) + len(z))
    first = lk.block_loglik(rows, table)[0]
    changed = [lk.sweep(rows, totals, tok_word, tok_off, z, doc_list, alpha, beta, V * beta, sampler, s)
               for s in range(20)]
    assert changed[0] > 0
    recount = np.zeros((V, K), np.int32)
    np.add.at(recount, (tok_word, z), 1)
    assert (rows == recount).all() and (totals == recount.sum(0)).all()
    fresh = lk.build_doc_lists(tok_off, z, int(off[-1]), K)
    for d in range(corpus.num_docs):  # same (topic, count) pairs, in whatever order
        a, b = lk.doc_pairs(doc_list, off[d], K), lk.doc_pairs(fresh, off[d], K)
        assert sorted(zip(*a, strict=True)) == sorted(zip(*b, strict=True))
        assert (a[1] > 0).all()
    assert lk.block_loglik(rows, table)[0] > first  # the words concentrate on fewer topics


def test_prefetching_changes_no_draw() -> None:
    corpus, _ = lda.synthetic_corpus(num_docs=80, doc_len=20, num_topics=4, words_per_topic=6, seed=5)
    K, V = 8, corpus.num_words
    doc_len = np.diff(corpus.doc_ptr)
    tok_doc = np.repeat(np.arange(corpus.num_docs), doc_len)
    order = np.lexsort((tok_doc, corpus.words))
    off = lk.doc_offsets(doc_len, K)
    tok_word, tok_off = corpus.words[order].astype(np.int32), off[tok_doc[order]].astype(np.int32)
    z0 = np.random.default_rng(1).integers(0, K, len(tok_word)).astype(np.int32)
    finals = []
    for ahead in (0, 1, lk.AHEAD, 10**6):  # 10**6: past the end, never asked for
        z = z0.copy()
        doc_list = lk.build_doc_lists(tok_off, z, int(off[-1]), K)
        rows = np.zeros((V, K), np.int32)
        np.add.at(rows, (tok_word, z), 1)
        totals = rows.sum(0).astype(np.int64)
        for s in range(5):
            lk.sweep(rows, totals, tok_word, tok_off, z, doc_list, 0.1, 0.01, V * 0.01, "sparse", s, ahead=ahead)
        finals.append((z, rows, doc_list))
    for z, rows, doc_list in finals[1:]:
        assert (z == finals[0][0]).all() and (rows == finals[0][1]).all() and (doc_list == finals[0][2]).all()


def test_the_sweep_draws_without_a_call_or_reference_counts() -> None:
    """The sparse draw is inlined into the sweep (``inline="always"``): as a call it cost the sweep 17%
    of its speed (LLVM had left it out of line, being the largest helper). And the sweep runs without
    Numba's reference counts: the inlined draw's array arguments cost ten atomic operations per token,
    1.6x in speed. Both changed no draw (``test_prefetching_changes_no_draw`` and the bench's copies)."""
    lk.warmup()
    asm = machine_code(lk._sweep)
    assert not calls_function(asm, "_draw_sparse")
    assert not counts_references(asm)


def test_a_document_too_long_for_packed_counts_is_refused() -> None:
    # 65,536 topics take 16 bits of each packed (count, topic) pair, leaving 15 for the count
    lk.doc_offsets(np.array([3, 32767]), 65536)
    with pytest.raises(ValueError, match="document of 32768 tokens is too long for 65536 topics"):
        lk.doc_offsets(np.array([3, 32768]), 65536)


def test_loglik_parts_match_a_dense_formula() -> None:
    rng = np.random.default_rng(1)
    D, K, V, alpha, beta = 5, 4, 7, 0.3, 0.05
    doc_len = rng.integers(1, 9, D)
    words = rng.integers(0, V, doc_len.sum())
    z = rng.integers(0, K, doc_len.sum()).astype(np.int32)
    tok_doc = np.repeat(np.arange(D), doc_len)
    off = lk.doc_offsets(doc_len, K)
    doc_list = lk.build_doc_lists(off[tok_doc].astype(np.int32), z, int(off[-1]), K)
    ndk = np.zeros((D, K))
    np.add.at(ndk, (tok_doc, z), 1)
    nwk = np.zeros((V, K), np.int32)
    np.add.at(nwk, (words, z), 1)
    from scipy.special import gammaln

    log_pz = D * gammaln(K * alpha) - gammaln(doc_len + K * alpha).sum() + (gammaln(ndk + alpha) - gammaln(alpha)).sum()
    log_pw = K * gammaln(V * beta) - gammaln(nwk.sum(0) + V * beta).sum() + (gammaln(nwk + beta) - gammaln(beta)).sum()
    dense = log_pz + log_pw
    word_ll, colsum = lk.block_loglik(nwk, lk.lgamma_table(beta, 50))
    ours = lk.doc_loglik(off, doc_list, doc_len, alpha, K) + word_ll + lk.topic_loglik(colsum, beta, V)
    assert ours == pytest.approx(dense, rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# the application across processes
# ----------------------------------------------------------------------------------------------------


def _topic_similarity(word_topic: np.ndarray, phi: np.ndarray, beta: float) -> np.ndarray:
    """For each true topic, 1 - total variation distance to the closest learned topic."""
    est = ((word_topic + beta) / (word_topic + beta).sum(0)).T
    return (1 - 0.5 * np.abs(phi[:, None, :] - est[None, :, :]).sum(-1)).max(axis=1)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_multiprocess_run_keeps_counts_exact_and_recovers_topics(etcd, pipeline: int) -> None:
    # 5 true topics, 7 in the model: with exactly 5, Gibbs sampling merges two true topics in a local
    # optimum in about 1 run of 20 (any implementation; measured with the kernel alone over 150 seeds);
    # with 2 spare topics no run out of 500 failed (worst similarity 0.915). With --pipeline 2 an
    # executor's next round is queued while it samples: counts must stay exact all the same.
    argv = ["--corpus", "synthetic", "--topics", "7", "--iterations", "60", "--blocks", "4", "--chunks", "8",
            "--synthetic-docs", "400", "--synthetic-doc-len", "40", "--synthetic-topics", "5", "--collect",
            "--quiet", "--ll-every", "5", "--pipeline", str(pipeline)]
    app = lda.make_app(argv)
    res = litz.run(app, workers=2, servers=2, num_executors=3, etcd=etcd.url)
    out = res.value
    K, V = 7, app.config["num_words"]
    # exactness: the table is the count of the executors' final assignments, the totals its sum
    recount = np.zeros((V, K), np.int64)
    seen_docs = []
    for part in out["assignments"]:
        np.add.at(recount, (part["words"], part["z"]), 1)
        seen_docs.append(part["docs"])
    assert (out["word_topic"] == recount).all()
    assert (out["totals"] == recount.sum(0)).all() and out["totals"].sum() == app.config["num_tokens"]
    assert sorted(np.concatenate(seen_docs).tolist()) == list(range(400))
    # progress: one report every 5 iterations, improving; the last is the final one
    hist = out["history"]
    assert [h["iteration"] for h in hist] == list(range(5, 61, 5))
    assert hist[-1]["loglik"] > hist[0]["loglik"] + 0.3
    assert out["loglik"] == hist[-1]["loglik"]
    # recovery: every true topic has a learned one within total variation distance 0.15
    _, phi = lda.synthetic_corpus(num_docs=400, doc_len=40, num_topics=5, seed=0)
    assert _topic_similarity(out["word_topic"], phi, 0.01).min() > 0.85


class _Dispatches:
    """A stand-in for the master under a driver: it records what the driver dispatches."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, dict]] = []
        self.state = type("State", (), {"version": 0})()

    def dispatch(self, executor: int, args: dict) -> int:
        self.sent.append((executor, args))
        return len(self.sent)

    def take(self) -> list[tuple[int, dict]]:
        out, self.sent = self.sent, []
        return out


def test_after_a_partial_recovery_the_driver_recounts_once_nothing_runs_and_holds_its_rounds() -> None:
    """The recount as a state machine, without processes: rounds due during a recovery wait; the recount
    starts only when no task runs (one task replaces the tables' contents, then the others add); a
    second loss during the recount starts it over; the held rounds then go out with the recounted n_k."""
    K = 3
    app = lda.make_app(["--corpus", "synthetic", "--topics", str(K), "--iterations", "4", "--quiet",
                        "--synthetic-docs", "20", "--synthetic-doc-len", "5"])
    master, driver = _Dispatches(), lda.LDADriver()
    driver._bind(master, 2, app.config)  # type: ignore[arg-type]
    tid = iter(range(1000))

    def complete(e: int, args: dict, **value: object) -> None:
        driver.handle_task_completion(litz.TaskResult(e, args, value, next(tid), 0))

    def sampled(e: int, args: dict) -> None:
        complete(e, args, tokens=1, changed=0, totals=np.ones(K, np.int64), doc_ll=0.0, word_ll=0.0,
                 colsum=np.zeros(K, np.int64))

    driver.dispatch_initial_tasks()
    for e, args in master.take():
        complete(e, args, tokens=1, totals=np.full(K, 5, np.int64))
    first = dict(master.take())  # round 0 of both executors
    assert sorted(first) == [0, 1] and all(a["op"] == "sample" and a["round"] == 0 for a in first.values())
    sampled(0, first[0])
    assert master.take() == []  # executor 0's next block is executor 1's until it completes
    recovery = litz.Recovery("worker", ("w1",), (1,), (), "/ckpt/ckpt-000001")
    driver.recovered(recovery)
    assert master.take() == []  # executor 1 still samples: no recount yet
    assert driver.progress().endswith("recounting the tables after a recovery")  # litz status says so
    sampled(1, first[1])  # round 1 is now due for both executors, but held
    [(e, replace)] = master.take()
    assert (e, replace) == (0, {"op": "recount", "replace": True})
    driver.recovered(recovery)  # a second loss during the recount
    complete(0, replace, totals=np.array([1, 2, 3], np.int64))
    [(e, add)] = master.take()
    assert (e, add) == (1, {"op": "recount"})
    complete(1, add, totals=np.array([4, 5, 6], np.int64))
    [(e, again)] = master.take()  # the recount starts over
    assert (e, again) == (0, {"op": "recount", "replace": True})
    complete(0, again, totals=np.array([2, 2, 2], np.int64))
    [(e, add)] = master.take()
    complete(1, add, totals=np.array([3, 3, 3], np.int64))
    resumed = dict(master.take())
    assert sorted(resumed) == [0, 1] and all(a["op"] == "sample" and a["round"] == 1 for a in resumed.values())
    for args in resumed.values():  # n_k is the last recount's, not the running sum of before
        np.testing.assert_array_equal(args["totals"], [5, 5, 5])
    np.testing.assert_array_equal(driver.totals, [5, 5, 5])
    assert "recounting" not in driver.progress()


def test_pipelined_tasks_sample_with_their_own_executors_latest_totals(etcd) -> None:
    # One executor, two blocks, two tasks in flight: its next round is dispatched before the driver
    # sees the current one complete, so the driver's n_k lacks that round. Every change of n_k is
    # this executor's, so each task must sample with exactly the previous task's n_k plus its change.
    argv = ["--corpus", "synthetic", "--topics", "5", "--iterations", "30", "--blocks", "2", "--chunks", "4",
            "--synthetic-docs", "100", "--collect", "--quiet", "--ll-every", "30", "--pipeline", "2"]
    res = litz.run(lda.make_app(argv), workers=1, servers=1, num_executors=1, etcd=etcd.url)
    seen = sorted(res.value["totals_seen"], key=lambda t: t[1])
    assert [t[1] for t in seen] == list(range(60))
    assert any(has < rnd - 1 for _, rnd, has, _, _ in seen)  # some task ran ahead of the driver
    for (_, _, _, before, change), (_, _, _, after, _) in zip(seen[:-1], seen[1:], strict=True):
        np.testing.assert_array_equal(after, before + change)
    last = seen[-1]
    np.testing.assert_array_equal(res.value["totals"], last[3] + last[4])


def test_executors_migrate_with_their_assignments_and_counts_stay_exact(tmp_path: Path, monkeypatch) -> None:
    """Scale-in from 2 workers to 1 while the job samples: the leaving worker's executors move with their
    state (topics, document lists) and reload their documents; the counts must still add up exactly."""
    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path))
    job = f"lda-scale-{time.time_ns()}"
    app = lda.make_app(["--corpus", "synthetic", "--topics", "5", "--iterations", "400", "--collect", "--quiet",
                        "--ll-every", "1", "--synthetic-docs", "100", "--synthetic-doc-len", "20"])
    thread, out = run_in_thread(app, workers=2, servers=1, num_executors=4, job=job)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if job_status(job)["master"].get("phase") == "running":
                    break
            except litz.LitzError:
                pass
            time.sleep(0.05)
        assert scale(["--job", job, "--workers", "1", "--wait", "--timeout", "30"]) == 0
    finally:
        thread.join(120)
    assert "error" not in out, out.get("error")
    res = out["res"]
    assert res.total("migrations_in", "worker") == 2  # the leaving worker's two executors
    value = res.value
    _assert_counts_exact(value)
    assert value["history"][0]["iteration"] == 1 and len(value["history"]) == 400
    assert value["history"][-1]["loglik"] > value["history"][0]["loglik"] + 0.2  # the first report is near random


def _litz(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "litz.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _assert_counts_exact(value: dict) -> None:
    """The word-topic table and the topic totals are exactly the histogram of the executors' final
    assignments (``--collect``), and so is each executor's document-topic counts."""
    assert all(part["doc_counts_agree"] for part in value["assignments"])
    recount = np.zeros_like(value["word_topic"])
    for part in value["assignments"]:
        np.add.at(recount, (part["words"], part["z"]), 1)
    assert (value["word_topic"] == recount).all() and (value["totals"] == recount.sum(0)).all()


def _iteration(st: dict) -> int:
    progress = st["master"].get("progress", "")
    return int(progress.split()[1].split("/")[0]) if progress.startswith("iteration ") else -1


@pytest.mark.parametrize(("victim", "recovery", "every", "policy"),
                         [("w1", "partial", "10", "full"), ("s1", "partial", "10", "full"),
                          ("w1", "full", "10", "full"),
                          ("w1", "partial", "100000", "full"),  # no checkpoint yet: fresh executors
                          ("w1", "partial", "8", "priority")])  # documents from the partial checkpoints too
def test_lda_survives_a_killed_process_and_its_counts_stay_exact(tmp_path: Path, monkeypatch, victim: str,
                                                                 recovery: str, every: str, policy: str) -> None:
    """A worker or a server killed while the job samples. Partial recovery restores only the lost
    executors' assignments (or the lost shards' counts) from the checkpoint, so the tables no longer
    count the assignments until the driver recounts them (``LDADriver.recovered``); without the
    recount the job ends with its totals check failing, or with counts that are off. Full recovery
    rolls everything back together. Either way the tables must end exactly equal to the histogram of
    the final assignments, every iteration reported once, and the chain still converging. With
    priority checkpoints (a quarter of the documents every 2 iterations), the lost executors also get
    the documents saved since the full checkpoint (``restore_rows``, which rebuilds their topic counts)."""
    from tests.test_recovery import _status_when

    monkeypatch.setenv("LITZ_JOBS_DIR", str(tmp_path / "jobs"))
    job = f"lda-{victim}-{recovery}-{time.time_ns()}"
    iterations = 100  # about 3 s here; the process dies at iteration 20-35
    app = lda.make_app(["--corpus", "synthetic", "--topics", "5", "--iterations", str(iterations), "--collect",
                        "--quiet", "--ll-every", "1", "--synthetic-docs", "200", "--synthetic-doc-len", "20"])
    t, out = run_in_thread(app, workers=2, servers=2, num_executors=4, job=job, checkpoint_dir=str(tmp_path / "c"),
                           checkpoint_every=every, recovery=recovery, checkpoint_policy=policy,
                           checkpoint_fraction=0.25 if policy != "full" else 1.0)
    try:
        st = _status_when(job, lambda s: _iteration(s) >= 20 and (every == "100000" or sum(
            c.get("ok") for c in s["master"].get("checkpoints", [])) >= (3 if policy != "full" else 1)))
        assert _iteration(st) < iterations - 40, "the job must still be sampling when the process dies"
        os.kill(next(p["pid"] for p in st["processes"] if p["id"] == victim), signal.SIGKILL)
    finally:
        t.join(120)
    assert "error" not in out, out.get("error")
    [rec] = out["res"].stats["master"]["recoveries"]
    assert rec["lost"] == victim and rec["strategy"] == recovery
    assert bool(rec["restored_from"]) == (every != "100000")
    if policy != "full":
        assert rec["partials"] and out["res"].total("rows_restored", "worker") > 0
    value = out["res"].value
    _assert_counts_exact(value)
    assert [h["iteration"] for h in value["history"]] == list(range(1, iterations + 1))
    assert value["history"][-1]["loglik"] > value["history"][0]["loglik"] + 0.2
    assert processes_mentioning(job) == []


def test_litz_launch_lda_prints_progress_topics_and_loglik() -> None:
    proc = _litz("launch", "apps/lda.py", "--help")
    assert proc.returncode == 0 and "--sampler" in proc.stdout and "--corpus" in proc.stdout
    job = f"cli-lda-{time.time_ns()}"
    # 3 sweeps per task: cycles of 3, 3 and 2 iterations, one progress line after each
    proc = _litz("launch", "apps/lda.py", "--workers", "2", "--executors", "2", "--job", job, "--corpus",
                 "synthetic", "--topics", "5", "--iterations", "8", "--sampler", "exact", "--top-words", "3",
                 "--sweeps-per-task", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    progress = [line for line in lines if line.startswith("iteration ") and "log-likelihood per token" in line]
    assert [line.split()[1] for line in progress] == ["3/8", "6/8", "8/8"]
    assert sum(line.startswith("topic ") for line in lines) == 5
    assert lines[-1].startswith("log-likelihood per token -")
    value = lines[-1].split()[-1]
    assert float(value) < 0 and len(value.split(".")[1]) == 3
    assert processes_mentioning(job) == []


# ----------------------------------------------------------------------------------------------------
# data: tokenizer, loaders, vocabulary layout
# ----------------------------------------------------------------------------------------------------


def test_tokenizer_and_corpus_builder() -> None:
    assert tokenize("The QUICK brown fox's 2nd jump-over: it's x!") == ["quick", "brown", "fox", "jump"]
    corpus = build_corpus(["apple banana apple", "banana cherry", "the of and", "cherry apple"], min_count=2)
    assert corpus.vocab == ("apple", "banana", "cherry")  # by frequency, then alphabetically
    assert corpus.num_docs == 3 and corpus.num_tokens == 7  # the all-stop-word document is dropped
    assert corpus.doc(0).tolist() == [0, 1, 0]


def test_loaders_read_the_debian_formats_and_name_the_package_when_missing(tmp_path: Path) -> None:
    (tmp_path / "jokes").write_text("first one\n%\nsecond\nline two\n%\n", encoding="utf-8")
    (tmp_path / "jokes.dat").write_bytes(b"\0\1binary index")
    (tmp_path / "jokes.u8").symlink_to(tmp_path / "jokes")
    assert read_fortunes(str(tmp_path)) == ["first one\n", "\nsecond\nline two\n"]
    (tmp_path / "data.noun").write_text("  1 license header | not a gloss\n"
                                        "00001740 03 n 01 entity 0 000 | that which exists  \n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        read_wordnet_glosses(str(tmp_path))
    for pos in ("verb", "adj", "adv"):
        (tmp_path / f"data.{pos}").write_text("", encoding="utf-8")
    assert read_wordnet_glosses(str(tmp_path)) == ["that which exists  \n"]
    with pytest.raises(FileNotFoundError, match="apt-get install -y fortunes"):
        read_fortunes(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        load_text_corpus("wordnet", root=str(tmp_path / "missing"))
    with pytest.raises(litz.ConfigError, match="wordnet-base"):  # litz launch says it in one line
        load_text_corpus("wordnet", root=str(tmp_path / "missing"))


def test_vocabulary_layout_balances_chunks_and_inverts() -> None:
    layout = lda.VocabLayout(num_words=1003, num_chunks=16)
    words = np.arange(1003)
    pos = layout.position(words)
    assert len(set(pos.tolist())) == 1003 and pos.max() < 16 * layout.chunk_words
    assert (layout.word_at(pos) == words).all()
    assert (layout.word_at(np.arange(16 * layout.chunk_words)) >= 0).sum() == 1003
    freq = 1.0 / (words + 20)  # Zipf-like frequencies by rank
    per_chunk = np.bincount(pos // layout.chunk_words, weights=freq, minlength=16)
    assert per_chunk.max() / per_chunk.min() < 1.1  # the snake deals heavy and light words evenly
    assert [list(layout.chunks(b, 3)) for b in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("argv, message", [
    (["--blocks", "-1"], "--blocks must be at least 0, got -1"),
    (["--chunks", "0"], "--chunks must be a positive integer, got 0"),
    (["--corpus", "synthetic", "--synthetic-docs", "0"], "--synthetic-docs must be a positive integer, got 0"),
    (["--topics", "0"], "--topics must be a positive integer, got 0"),
    (["--beta", "inf"], "--beta must be a positive number, got inf"),  # ran to a log-likelihood of nan
    (["--alpha", "nan"], "--alpha must be a positive number, got nan"),
    # (checked once the corpus is loaded; before, every worker failed to load its documents)
    (["--corpus", "synthetic", "--topics", "70000", "--synthetic-docs", "1", "--synthetic-doc-len", "20000"],
     "a document of 20000 tokens is too long for 70000 topics"),
])
def test_bad_options_are_refused_before_the_corpus_loads(argv: list[str], message: str) -> None:
    """Before, --blocks -1 failed every worker's load_input with an IndexError and a synthetic corpus
    of 0 documents failed with a numpy cast error."""
    with pytest.raises(litz.ConfigError, match=re.escape(message)):
        lda.make_app(argv)
