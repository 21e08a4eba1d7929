"""The LDA sweep kernel alone: tokens per second with and without prefetching the document lists.

A sweep visits its tokens word by word, so each token's document list (apps/lda_kernels.py) is one
read at a random place; ``sweep(..., ahead=N)`` asks the CPU for the list of the token ``N`` places
ahead. This bench runs the app's own data layout outside the runtime: the corpus split over 2
executors and 2 vocabulary blocks exactly as ``litz launch apps/lda.py --executors 2`` splits it,
the blocks rotated between the executors in one process, ``--warmup`` iterations first (a chain that
has mixed samples faster than a random start). Then, for every ``ahead`` value, a copy of the same
state is swept, the copies alternating iteration by iteration; ``ahead`` changes no draw, so the
copies stay identical (checked at the end). With ``--processes 2`` two such processes run at once,
as the two workers of a job do on two cores.

Run: ``python bench/bench_lda_sweep.py [--corpus fortunes wordnet] [--topics 20 100] [--processes 1 2]``
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from apps import lda
from apps import lda_kernels as lk

EXECUTORS = BLOCKS = 2


class Chain:
    """Two executors' tokens and counts and the word-topic table, swept block by block."""

    def __init__(self, corpus: str, topics: int) -> None:
        self.cfg = dict(lda.make_app(["--corpus", corpus, "--topics", str(topics)]).config)
        self.layout = lda._layout(self.cfg)
        self.executors = []
        for e in range(EXECUTORS):
            ex = lda.LDAExecutor()  # the attributes the runtime sets
            ex.executor_id, ex.num_executors, ex.config = e, EXECUTORS, self.cfg
            ex.input = ex.load_input()
            ex.state = ex.init_state()
            self.executors.append(ex)
        C, cw = self.layout.num_chunks, self.layout.chunk_words
        self.rows = np.zeros((C * cw, topics), self.cfg["count_dtype"])
        for ex in self.executors:
            np.add.at(self.rows, (self.layout.position(ex.input["words"]), ex.state["z"]), 1)
        self.totals = self.rows.sum(0).astype(np.int64)
        self.tokens = sum(len(ex.state["z"]) for ex in self.executors)

    def iteration(self, it: int, ahead: int) -> float:
        """One iteration (every executor sweeps every block once); returns the seconds spent in sweeps."""
        cfg, cw = self.cfg, self.layout.chunk_words
        spent = 0.0
        for r in range(BLOCKS):
            for e, ex in enumerate(self.executors):
                b = (e + r) % BLOCKS
                chunks = self.layout.chunks(b, BLOCKS)
                lo, hi = ex.input["block_ptr"][b], ex.input["block_ptr"][b + 1]
                t = time.perf_counter()
                lk.sweep(self.rows[chunks.start * cw:chunks.stop * cw], self.totals, ex.input["tok_word"][lo:hi],
                         ex.input["tok_off"][lo:hi], ex.state["z"][lo:hi], ex.state["doc_list"], cfg["alpha"],
                         cfg["beta"], cfg["num_words"] * cfg["beta"], "sparse", lk.task_seed(0, e, it * BLOCKS + r),
                         ahead=ahead)
                spent += time.perf_counter() - t
        return spent


def measure(corpus: str, topics: int, aheads: list[int], warmup: int, repeats: int) -> dict[str, Any]:
    """Median tokens per second of each ``ahead`` (alternating), and whether the copies agree."""
    lk.warmup()
    base = Chain(corpus, topics)
    for it in range(warmup):
        base.iteration(it, lk.AHEAD)
    chains = {a: copy.deepcopy(base) for a in aheads}
    rates: dict[int, list[float]] = {a: [] for a in aheads}
    for rep in range(repeats):
        for a in (aheads if rep % 2 == 0 else aheads[::-1]):
            rates[a].append(base.tokens / chains[a].iteration(warmup + rep, a))
    first = chains[aheads[0]]
    same = all((c.rows == first.rows).all() and all((x.state["z"] == y.state["z"]).all()
                                                    for x, y in zip(c.executors, first.executors, strict=True))
               for c in chains.values())
    list_mb = max(ex.state["doc_list"].nbytes for ex in base.executors) / 1e6
    return {"rates": {a: float(np.median(v)) for a, v in rates.items()}, "same": same, "list_mb": list_mb}


def _child(args: tuple[str, int, list[int], int, int], out: Any) -> None:
    out.put(measure(*args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", nargs="+", default=["fortunes", "wordnet"], choices=["fortunes", "wordnet"])
    ap.add_argument("--topics", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--ahead", type=int, nargs="+", default=[0, lk.AHEAD],
                    help="prefetch distances to compare (0: no prefetch; the app uses %(default)s's last)")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="sweeping processes at once")
    ap.add_argument("--warmup", type=int, default=20, help="iterations before timing")
    ap.add_argument("--repeats", type=int, default=8, help="timed iterations per ahead value")
    args = ap.parse_args()
    print("M tokens/s of one process's sweeps, per prefetch distance; ratio: last distance / first")
    print(f"{'corpus':<9} {'K':>4} {'procs':>5} {'lists MB':>8}  "
          + "  ".join(f"{'ahead ' + str(a):>9}" for a in args.ahead) + "  ratio")
    ctx = mp.get_context("spawn")
    for corpus in args.corpus:
        for K in args.topics:
            for procs in args.processes:
                q = ctx.Queue()
                job = (corpus, K, args.ahead, args.warmup, args.repeats)
                ps = [ctx.Process(target=_child, args=(job, q)) for _ in range(procs)]
                for p in ps:
                    p.start()
                results = [q.get() for _ in ps]
                for p in ps:
                    p.join()
                for res in results:
                    r = res["rates"]
                    ratio = r[args.ahead[-1]] / r[args.ahead[0]]
                    print(f"{corpus:<9} {K:>4} {procs:>5} {res['list_mb']:>8.2f}  "
                          + "  ".join(f"{r[a] / 1e6:>9.2f}" for a in args.ahead)
                          + f"  {ratio:5.2f}" + ("" if res["same"] else "  COPIES DIFFER"), flush=True)


if __name__ == "__main__":
    main()
