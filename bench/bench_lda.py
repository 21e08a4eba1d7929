"""LDA on the Debian fortunes or wordnet glosses: Litz against the ``lda`` package (collapsed Gibbs)
and ``tomotopy``.

Same corpus (the app's tokenization; fortunes: 15,100 documents, 176,714 tokens, 7,324 words;
``--corpus wordnet``: 117,081 glosses, 775,081 tokens, 18,268 words), same K, α, β and number of
iterations for all three, side by side in one run. Each system reports

* the log-likelihood per token ``log p(w, z) / N`` of its final state, computed here by one function
  from each system's final counts (the formula of ``lda.LDA.loglikelihood``), and
* tokens per second: ``N · iterations / sampling time``.

Timed: ``lda``'s ``fit``; ``tomotopy``'s ``train(iterations, workers=2)`` after a ``train(0)`` that
builds its state; Litz's sampling phase as its driver measures it (first round dispatched to last
round completed: the worker processes are started, the Numba kernels loaded and the initial counts
pushed before it). A short Litz warm-up run first compiles the kernels into Numba's cache. No system
computes its log-likelihood during the timed iterations (``lda``: ``refresh`` = iterations; Litz:
``--ll-every`` = iterations, one report at the end). Litz: 2 worker processes, 1 server, the app's
``sparse`` sampler, once with the plain schedule and once with 2 sweeps per task (each task resamples
its block twice: half the rounds per iteration; see apps/lda.py). Peers: ``tomotopy.LDAModel(k, alpha,
eta)`` with ``optim_interval = 0`` (fixed priors, as the others), 2 threads; ``lda.LDA(k, n_iter,
alpha, eta)``, one thread.

The last two columns are ratios: tokens per second against tomotopy's (above 1 = faster), and the
log-likelihood per token against ``lda``'s (positive = higher, i.e. better).

Run: ``python bench/bench_lda.py [--corpus fortunes|wordnet] [--topics 20 100] [--iterations 200]
[--sweeps 1 2] [--repeats 1] [--skip-lda]`` (about 1.5 minutes for the defaults on 2 cores, most of it
``lda`` at K = 100; wordnet with 50 iterations and ``--repeats 2`` takes about 4 minutes).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.special import gammaln

import litz
from apps import lda as lda_app
from apps.datasets import Corpus, load_text_corpus


@dataclass
class Outcome:
    seconds: float
    loglik: float  # per token

    def tokens_per_second(self, tokens: int, iterations: int) -> float:
        return tokens * iterations / self.seconds


def joint_loglik(ndk: np.ndarray, nwk: np.ndarray, alpha: float, beta: float) -> float:
    """``log p(w, z)`` from dense document-topic (D, K) and word-topic (V, K) counts."""
    D, K = ndk.shape
    V = nwk.shape[0]
    nd = ndk.sum(1)
    nk = nwk.sum(0)
    log_pz = D * gammaln(K * alpha) - gammaln(nd + K * alpha).sum() + (gammaln(ndk + alpha) - gammaln(alpha)).sum()
    log_pw = K * gammaln(V * beta) - gammaln(nk + V * beta).sum() + (gammaln(nwk + beta) - gammaln(beta)).sum()
    return float(log_pz + log_pw)


def run_lda(corpus: Corpus, K: int, iterations: int, alpha: float, beta: float, seed: int) -> Outcome:
    import lda

    # copies: csr_matrix keeps the index arrays it is given, and sum_duplicates sorts them in place
    X = sp.csr_matrix((np.ones(corpus.num_tokens, np.int64), corpus.words.copy(), corpus.doc_ptr.copy()),
                      shape=(corpus.num_docs, corpus.num_words))
    X.sum_duplicates()
    model = lda.LDA(n_topics=K, n_iter=iterations, alpha=alpha, eta=beta, random_state=seed, refresh=iterations)
    t = time.perf_counter()
    model.fit(X)
    seconds = time.perf_counter() - t
    ll = joint_loglik(model.ndz_.astype(np.float64), model.nzw_.T.astype(np.float64), alpha, beta)
    return Outcome(seconds, ll / corpus.num_tokens)


def run_tomotopy(corpus: Corpus, K: int, iterations: int, alpha: float, beta: float, seed: int,
                 threads: int) -> Outcome:
    import tomotopy as tp

    model = tp.LDAModel(k=K, alpha=alpha, eta=beta, seed=seed)
    model.optim_interval = 0  # keep α fixed (tomotopy optimizes it every 10 iterations by default)
    model.burn_in = 0
    for d in range(corpus.num_docs):
        model.add_doc([str(w) for w in corpus.doc(d)])
    model.train(0, workers=threads)  # builds the model state; not timed
    t = time.perf_counter()
    model.train(iterations, workers=threads)
    seconds = time.perf_counter() - t
    ndk = np.zeros((corpus.num_docs, K))
    nwk = np.zeros((corpus.num_words, K))
    for d, doc in enumerate(model.docs):
        topics = np.asarray(doc.topics, np.int64)
        np.add.at(ndk, (d, topics), 1)
        np.add.at(nwk, (np.asarray(doc.words, np.int64), topics), 1)
    return Outcome(seconds, joint_loglik(ndk, nwk, alpha, beta) / corpus.num_tokens)


def run_litz(corpus: Corpus, K: int, iterations: int, alpha: float, beta: float, seed: int, workers: int,
             executors: int, sweeps: int, extra: list[str]) -> Outcome:
    app = lda_app.make_app(["--corpus", corpus.name, "--topics", str(K), "--iterations", str(iterations),
                            "--alpha", str(alpha), "--beta", str(beta), "--seed", str(seed), "--quiet", "--collect",
                            "--ll-every", str(iterations), "--sweeps-per-task", str(sweeps), *extra])
    res = litz.run(app, workers=workers, servers=1, num_executors=executors)
    out = res.value
    ndk = np.zeros((corpus.num_docs, K))
    for part in out["assignments"]:
        np.add.at(ndk, (part["docs"][part["tok_doc"]], part["z"]), 1)
    ll = joint_loglik(ndk, out["word_topic"].astype(np.float64), alpha, beta) / corpus.num_tokens
    if abs(ll - out["loglik"]) > 1e-9 * abs(ll):
        raise AssertionError(f"Litz's own log-likelihood {out['loglik']} differs from the recount {ll}")
    return Outcome(out["sampling_seconds"], ll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="fortunes", choices=["fortunes", "wordnet"])
    ap.add_argument("--topics", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--beta", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=1, help="runs per system (interleaved); the fastest is kept")
    ap.add_argument("--workers", type=int, default=2, help="Litz worker processes")
    ap.add_argument("--executors", type=int, default=2, help="Litz executors (default: one per worker)")
    ap.add_argument("--sweeps", type=int, nargs="+", default=[1, 2],
                    help="Litz runs with these --sweeps-per-task (1 = the plain schedule)")
    ap.add_argument("--threads", type=int, default=2, help="tomotopy threads")
    ap.add_argument("--skip-lda", action="store_true", help="leave out the (slow, one-thread) lda package")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("litz_args", nargs="*", help="extra options for apps/lda.py, after --")
    args = ap.parse_args()
    logging.getLogger("lda").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="The training result may differ")  # tomotopy, threads > 1
    corpus = load_text_corpus(args.corpus)
    N = corpus.num_tokens
    print(f"LDA, {args.corpus}: {corpus.num_docs} documents, {N} tokens, {corpus.num_words} words; "
          f"alpha {args.alpha}, beta {args.beta}, {args.iterations} iterations", flush=True)
    run_litz(corpus, args.topics[0], 2, args.alpha, args.beta, args.seed, args.workers, args.executors, 1,
             args.litz_args)  # warm-up: Numba cache, corpus cache, page cache
    litz_names = [f"litz S={s}" for s in args.sweeps]
    for K in args.topics:
        runs: dict[str, list[Outcome]] = {name: [] for name in [*litz_names, "tomotopy", "lda"]}
        for _ in range(args.repeats):
            for name, sweeps in zip(litz_names, args.sweeps, strict=True):
                runs[name].append(run_litz(corpus, K, args.iterations, args.alpha, args.beta, args.seed,
                                           args.workers, args.executors, sweeps, args.litz_args))
            runs["tomotopy"].append(run_tomotopy(corpus, K, args.iterations, args.alpha, args.beta, args.seed,
                                                 args.threads))
            if not args.skip_lda:
                runs["lda"].append(run_lda(corpus, K, args.iterations, args.alpha, args.beta, args.seed))
        best = {name: min(outs, key=lambda o: o.seconds) for name, outs in runs.items() if outs}
        labels = {name: f"Litz, {sweeps} sweep{'s' if sweeps > 1 else ''}/task"
                  for name, sweeps in zip(litz_names, args.sweeps, strict=True)}
        labels.update({"tomotopy": f"tomotopy ({args.threads} threads)", "lda": "lda (1 thread)"})
        ref = best.get("lda", best["tomotopy"])
        ref_name = "lda" if "lda" in best else "tomotopy"
        print(f"\nK = {K}   (Litz: {args.workers} workers, {args.executors} executors, 1 server)")
        print(f"{'system':<26} {'seconds':>8} {'M tokens/s':>11} {'loglik/token':>13} {'tokens/s ÷ tomotopy':>20} "
              f"{'loglik vs ' + ref_name:>16}")
        for name, o in best.items():
            print(f"{labels[name]:<26} {o.seconds:8.2f} {o.tokens_per_second(N, args.iterations) / 1e6:11.2f} "
                  f"{o.loglik:13.4f} {best['tomotopy'].seconds / o.seconds:20.2f} "
                  f"{(o.loglik - ref.loglik) / abs(ref.loglik):+16.2%}", flush=True)


if __name__ == "__main__":
    main()
