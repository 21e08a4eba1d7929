"""Latent Dirichlet allocation by collapsed Gibbs sampling on Litz, with model scheduling.

Who holds what:

* **Executors** own a random partition of the documents (input, reloadable from the corpus) and, as
  mutable state that migrates with them (``init_state``), their tokens' topic assignments ``z`` and
  their documents' topic counts (one sparse list per document).
* **Parameter server**: table ``word_topic`` holds the word-topic counts ``n_wk`` (one row per chunk
  of words) and table ``topic_totals`` the topic totals ``n_k``. Both use the ``add`` combiner on
  integers, so every count is exact: a task pushes the integer difference of what it changed. Word
  counts are int16 when no word occurs more than 32,767 times in the corpus (no count or change can
  then exceed that), which halves the bytes fetched and pushed per task; int32 otherwise.

**Model scheduling.** The vocabulary is cut into ``B >= E`` blocks, which ``litz.BlockRotation`` rotates
over the ``E`` executors: in round ``r`` executor ``e`` samples its tokens whose words are in block
``(e·B/E + r) % B`` (the executors spread evenly over the blocks), and a block is held by one executor
at a time. A task fetches its block's rows at its start; because the rotation dispatches a block's
next task only after the driver was told that the previous holder completed, Litz's consistency rule
guarantees that the fetch sees every earlier update: the word-topic counts a task samples with are
exact, and no two executors ever sample the same words at once. ``B`` rounds make one cycle, in which
every token is resampled ``S`` times (``--sweeps-per-task``, default 1): ``S`` iterations. Rows of the
word table are chunks of words (``--chunks``), not single words, because the runtime pays per key;
words are dealt to chunks in frequency order, in a snake, so that every chunk, hence every block,
carries about the same number of tokens.

**Topic totals** are shared by all blocks, so they cannot be scheduled. Each task starts from ``n_k``
as of its dispatch, keeps a local copy that follows its own moves, and pushes its net change at its
end (the approach of YahooLDA and Petuum/Litz). While it runs, the other ``E - 1`` executors move
tokens on other blocks, which it does not see until its next task: ``n_k`` is stale by at most one
round of the others' moves. On fortunes with 2 executors and K = 20 that is a few thousand moves
spread over 20 topics, a few percent of each ``n_k`` in the first iterations and less once the chain
settles; ``n_k`` only scales a topic's weight for every word alike, and the log-likelihood per token
reached stays within 0.3% of the sequential ``lda`` package's (bench/bench_lda.py). It can never go
wrong in sign: a task only takes out its own tokens, which are counted in the value it starts from.

Where a task gets ``n_k`` from: it could read ``topic_totals`` at its start, but ``ps.get_many`` reads
one table per call, so that read would be a second round trip to the servers, after the block's rows,
before sampling can start (measured: about a fifth of the run time on the fortunes corpus). Instead,
every task also returns its change of ``n_k`` (K integers) to the driver, which keeps the running sum
and sends it with each task it dispatches. That sum holds exactly the updates of the tasks completed
before the dispatch, which is what Litz's consistency rule guarantees a read at the task's start
would see, so the information is the same. The table stays the authority: at the end the driver reads
it and checks that it equals the running sum.

**Sampler** (apps/lda_kernels.py): ``--sampler sparse`` (default) splits the conditional into a
document bucket, a word bucket and a smoothing bucket, so a token costs O(topics in its document)
rather than O(K); ``--sampler exact`` evaluates all K topics and is kept as the reference.
``--device cuda`` samples on an NVIDIA GPU instead (apps/lda_cuda.py): a thread per token of the block,
in waves, with atomic count updates; counts stay exact, and each draw sees the counts of the waves
before it.

**Log-likelihood** ``log p(w, z)`` per token is computed where the counts live, from one consistent
snapshot (every token after its last sample of the cycle): documents by their executor at its last
round of the cycle, word rows by each block's last holder in the cycle (with the block's topic sums,
whose total gives the topic term). The driver adds them up and prints one line per cycle (or every
``--ll-every`` iterations).

**Speed.** A round costs a few messages between processes (dispatch, fetch of the block's rows, update,
acknowledgement, completion), about 2 ms on a busy 2-core machine, and a cycle has ``B >= E`` rounds
that depend on each other. So the fewest executors that keep every worker busy, one per worker, is
fastest (``litz launch apps/lda.py --executors 2`` with the default 2 workers); more executors give
finer elasticity at the price of more rounds. ``--pipeline 2`` with more blocks than executors queues an
executor's next round behind its current one as soon as its block is released, and prefetches that
block's rows (``prefetch``), so the messages between rounds overlap with sampling; each task then adds
its own executor's rounds that the driver had not seen at dispatch to ``n_k`` (``_own_rounds_since``).
On a 2-core machine it was not faster (README): the messages' CPU comes out of the samplers' cores.
``--sweeps-per-task 2`` halves the rounds per iteration;
a task's second sweep sees the rest of each document (its tokens in other blocks) as the first did,
which costs some mixing per iteration.

**Checkpoints.** The model lives in the executors' assignments, so SCAR's priority checkpoints
(``--checkpoint priority``) save them by documents: an executor's state rows (``state_rows``) are its
documents' token topics, scored by the length-scaled total variation of each document's topic
counts since they were saved (SCAR's distance for LDA: half the L1 distance of the counts). A worker
lost under ``--recovery partial`` gets its documents back from the last full checkpoint with the
newer copies of the partial ones (``restore_rows``), and the driver then recounts the tables
(``LDADriver.recovered``).

Run it:  ``litz launch apps/lda.py [--corpus fortunes|wordnet] [--topics 20] [--iterations 200]``
(corpora from the Debian packages ``fortunes`` and ``wordnet-base``). Last line printed:
``log-likelihood per token -X.XXX``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import litz
from apps import gpu
from apps import lda_kernels as lk
from apps.datasets import Corpus, load_text_corpus, partition_rows
from apps.options import require_at_least, require_finite, seed

CORPORA = ("fortunes", "wordnet", "synthetic")


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------


def synthetic_corpus(num_docs: int = 400, doc_len: int = 40, num_topics: int = 5, words_per_topic: int = 12,
                     alpha: float = 0.2, seed: int = 0) -> tuple[Corpus, np.ndarray]:
    """A corpus drawn from known topics: ``(corpus, phi)`` with ``phi`` (K, V) the true topic-word
    distributions. Topic k puts its mass uniformly on its own ``words_per_topic`` words; each document
    mixes topics with ``θ ~ Dirichlet(alpha)``. Word ids are re-ranked by frequency, as the real
    corpora's are (the vocabulary blocks rely on it)."""
    rng = np.random.default_rng(seed)
    V = num_topics * words_per_topic
    theta = rng.dirichlet(np.full(num_topics, alpha), size=num_docs)
    topics = np.array([rng.choice(num_topics, size=doc_len, p=t) for t in theta])
    raw = topics * words_per_topic + rng.integers(0, words_per_topic, size=topics.shape)
    counts = np.bincount(raw.ravel(), minlength=V)
    rank = np.empty(V, np.int64)
    rank[np.lexsort((np.arange(V), -counts))] = np.arange(V)
    words = rank[raw].astype(np.int32).ravel()
    phi = np.zeros((num_topics, V))
    for k in range(num_topics):
        phi[k, rank[k * words_per_topic:(k + 1) * words_per_topic]] = 1.0 / words_per_topic
    vocab = tuple(f"w{int(np.flatnonzero(rank == i)[0])}" for i in range(V))
    ptr = np.arange(0, num_docs * doc_len + 1, doc_len, dtype=np.int64)
    return Corpus("synthetic", ptr, words, vocab), phi


@functools.lru_cache(maxsize=4)
def _synthetic(params: tuple[tuple[str, Any], ...]) -> tuple[Corpus, np.ndarray]:
    return synthetic_corpus(**dict(params))


def load_corpus(config: dict[str, Any]) -> Corpus:
    """The job's corpus; memoized per process, so executors sharing a worker tokenize it once."""
    if config["corpus"] == "synthetic":
        return _synthetic(tuple(sorted(config["synthetic"].items())))[0]
    return load_text_corpus(config["corpus"], config["min_count"])


@dataclass(frozen=True)
class VocabLayout:
    """Where each word's row lives: ``C`` chunks of ``ceil(V / C)`` words, one table row per chunk.

    Words (ids are frequency ranks) are dealt to chunks in a snake, 0, 1, ..., C-1, C-1, ..., 0, ...,
    so every chunk gets about the same number of tokens. A block is a contiguous range of chunks.
    """

    num_words: int
    num_chunks: int

    @property
    def chunk_words(self) -> int:
        return -(-self.num_words // self.num_chunks)

    def position(self, words: np.ndarray) -> np.ndarray:
        """Row-major position ``chunk * chunk_words + slot`` of each word."""
        w = np.asarray(words, np.int64)
        slot, i = np.divmod(w, self.num_chunks)
        chunk = np.where(slot % 2 == 0, i, self.num_chunks - 1 - i)
        return chunk * self.chunk_words + slot

    def word_at(self, positions: np.ndarray) -> np.ndarray:
        """The word at each position, or -1 for padding."""
        chunk, slot = np.divmod(np.asarray(positions, np.int64), self.chunk_words)
        i = np.where(slot % 2 == 0, chunk, self.num_chunks - 1 - chunk)
        w = slot * self.num_chunks + i
        return np.where(w < self.num_words, w, -1)

    def chunks(self, block: int, num_blocks: int) -> range:
        """The table rows (chunks) of ``block`` out of ``num_blocks``."""
        return range(block * self.num_chunks // num_blocks, (block + 1) * self.num_chunks // num_blocks)


def _layout(config: dict[str, Any]) -> VocabLayout:
    return VocabLayout(config["num_words"], config["chunks"])


def _num_blocks(config: dict[str, Any], num_executors: int) -> int:
    return int(config["blocks"] or num_executors)


# ----------------------------------------------------------------------------------------------------
# executor
# ----------------------------------------------------------------------------------------------------


class LDAExecutor(litz.Executor):
    """Owns a partition of the documents; its state is the topic of each of their tokens.

    ``self.input`` (reloadable): the partition's tokens sorted by (block, word, document), with each
    token's word as an index into its block's rows and the offset of its document's count list.
    ``self.state`` (migrates): ``z`` (topics, same order) and ``doc_list`` (the documents' counts).
    """

    #: with ``--device cuda``: ``doc_list`` while GPU tasks left it behind ``z`` (see ``_doc_list``)
    _stale_doc_list: np.ndarray | None = None
    #: with ``--device cuda``: (input, z, doc_list) the GPU copy was made from, and that copy
    _gpu_tokens: tuple[Any, np.ndarray, np.ndarray, Any] | None = None

    def load_input(self) -> dict[str, np.ndarray]:
        cfg = self.config
        corpus = load_corpus(cfg)
        K = cfg["topics"]
        layout = _layout(cfg)
        B = _num_blocks(cfg, self.num_executors)
        docs = partition_rows(corpus.num_docs, self.num_executors, self.executor_id, seed=cfg["seed"])
        starts = corpus.doc_ptr[docs]
        doc_len = corpus.doc_ptr[docs + 1] - starts
        n = int(doc_len.sum())
        tok_doc = np.repeat(np.arange(len(docs), dtype=np.int64), doc_len)
        first = np.repeat(np.cumsum(doc_len) - doc_len, doc_len)
        words = corpus.words[np.repeat(starts, doc_len) + np.arange(n) - first]
        pos = layout.position(words)
        order = np.lexsort((tok_doc, pos))
        pos, tok_doc, words = pos[order], tok_doc[order], words[order]
        # block b covers positions [block_start[b], block_start[b + 1]); chunks(B, B) starts at the end
        block_start = np.array([layout.chunks(b, B).start * layout.chunk_words for b in range(B + 1)], np.int64)
        block_ptr = np.searchsorted(pos, block_start).astype(np.int64)
        block_of = np.searchsorted(block_start, pos, side="right") - 1
        doc_off = lk.doc_offsets(doc_len, K)
        if doc_off[-1] >= 2**31:
            raise ValueError("this executor's documents are too many for int32 offsets: use more executors")
        return {"docs": docs.astype(np.int64), "doc_len": doc_len.astype(np.int64), "doc_off": doc_off,
                "tok_word": (pos - block_start[block_of]).astype(np.int32),
                "tok_off": doc_off[tok_doc].astype(np.int32), "words": words.astype(np.int32),
                "tok_doc": tok_doc.astype(np.int32), "block_ptr": block_ptr}

    def init_state(self) -> dict[str, np.ndarray]:
        inp = self.input
        K = self.config["topics"]
        rng = np.random.default_rng([self.config["seed"], self.executor_id, 1])
        z = rng.integers(0, K, size=len(inp["tok_word"])).astype(np.int32)
        return {"z": z, "doc_list": self._doc_lists(z)}

    def setup(self) -> None:
        lk.warmup()  # compile or load the kernels before the first task, here or after a move
        cfg = self.config
        if cfg.get("device", "cpu") != "cpu" and gpu.available():  # a host without a GPU: its first task says so
            from apps.lda_cuda import warmup

            warmup()
        self._doc_table = lk.lgamma_table(cfg["alpha"], int(np.max(self.input["doc_len"], initial=0)))
        self._word_table = lk.lgamma_table(cfg["beta"], int(cfg["max_word_count"]))
        # state rows (documents) for priority checkpoints: the tokens of document d are
        # z[by_doc[ptr[d]:ptr[d + 1]]]
        tok_doc = self.input["tok_doc"]
        self._by_doc = np.argsort(tok_doc, kind="stable")
        self._doc_ptr = np.concatenate([[0], np.cumsum(self.input["doc_len"])]).astype(np.int64)
        self._row_doc = tok_doc[self._by_doc].astype(np.int64)  # the document of each state-row value

    def state_rows(self) -> litz.StateRows:
        """The documents' token topics, a document per row (SCAR's unit for LDA)."""
        return litz.StateRows(self.state["z"][self._by_doc], self._doc_ptr)

    def row_distances(self, now: litz.StateRows, saved: litz.StateRows) -> np.ndarray:
        """Length-scaled total variation between each document's topic counts now and as saved:
        its length times the TV of the two topic distributions, which (same length) is half the
        L1 distance of the counts. A long document that changed its mix outranks a short one."""
        K, D = self.config["topics"], now.num_rows
        key = self._row_doc * K
        diff = (np.bincount(key + now.values, minlength=D * K)
                - np.bincount(key + saved.values, minlength=D * K)).reshape(D, K)
        return 0.5 * np.abs(diff).sum(axis=1)

    def restore_rows(self, rows: dict[int, np.ndarray]) -> None:
        """Documents saved by partial checkpoints after the full one the state came from: their
        tokens' topics, then every document's topic counts rebuilt from the assignments."""
        z = self.state["z"]
        for d, topics in rows.items():
            z[self._by_doc[self._doc_ptr[d]:self._doc_ptr[d + 1]]] = topics
        self.state["doc_list"] = self._doc_lists(z)

    def _doc_lists(self, z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The documents' topic-count lists for the assignment ``z`` (in ``out`` when given)."""
        return lk.build_doc_lists(self.input["tok_off"], z, int(self.input["doc_off"][-1]), self.config["topics"],
                                  out=out)

    def _doc_list(self) -> np.ndarray:
        """``state["doc_list"]``, brought up to date with ``z`` first if GPU tasks changed the topics
        since it was built. A GPU task keeps the documents' counts on the GPU and leaves the host's
        lists behind (rebuilding them for all the executor's tokens after every task cost more than
        a small task's sweep); whatever reads them calls this: reports, dumps, ``get_state``
        (checkpoints and moves) and a CPU sweep. Rebuilt in place, so the GPU copy, keyed on the
        array's identity, stays valid."""
        doc_list = self.state["doc_list"]
        if doc_list is self._stale_doc_list:
            self._doc_lists(self.state["z"], out=doc_list)
            self._stale_doc_list = None
        return doc_list

    def get_state(self) -> dict[str, Any]:
        """The state with its document lists current: a checkpoint or a move must carry lists that
        agree with ``z``, whatever GPU tasks left behind."""
        self._doc_list()
        return self.state

    def run_task(self, args: dict[str, Any]) -> dict[str, Any]:
        op = args["op"]
        if op == "sample":
            return self._sample(args)
        if op in ("init", "recount"):
            return self._push_counts(replace=bool(args.get("replace")))
        if op == "dump":  # --collect, for tests: the assignments, and whether the document counts agree
            inp, z = self.input, self.state["z"]
            K, D = self.config["topics"], len(inp["docs"])
            dense = np.zeros((D, K), np.int64)
            for d in range(D):  # the lists' (topic, count) pairs, in whatever order the sampler left them
                topics, counts = lk.doc_pairs(self._doc_list(), int(inp["doc_off"][d]), K)
                dense[d, topics] = counts
            truth = np.zeros((D, K), np.int64)
            np.add.at(truth, (inp["tok_doc"], z), 1)
            return {"docs": inp["docs"], "tok_doc": inp["tok_doc"], "words": inp["words"], "z": z,
                    "doc_counts_agree": bool(np.array_equal(dense, truth))}
        raise ValueError(f"unknown task {op!r}")

    def _push_counts(self, replace: bool = False) -> dict[str, Any]:
        """Add this executor's counts (its assignments' word-topic histogram and topic totals) to the
        tables. At the start (``init``) the tables are empty and executors may add concurrently:
        integer adds commute. After a partial recovery the driver recounts (``recount``): one task
        with ``replace`` first takes the tables' current contents out, while no other task runs,
        then every other executor adds its counts, so the tables are again exactly the executors'."""
        cfg = self.config
        K = cfg["topics"]
        layout = _layout(cfg)
        z = self.state["z"]
        C, cw = layout.num_chunks, layout.chunk_words
        counts = np.zeros((C * cw, K), np.int64)
        np.add.at(counts, (layout.position(self.input["words"]), z), 1)
        counts = counts.reshape(C, cw, K)
        totals = np.bincount(z, minlength=K).astype(np.int64)
        dtotals = totals
        if replace:
            counts = counts - self.ps.get_many("word_topic", range(C))
            dtotals = totals - self.ps.get("topic_totals", 0)
        keys = np.flatnonzero(counts.reshape(C, -1).any(axis=1))
        info = np.iinfo(cfg["count_dtype"])
        # a change within the dtype's range in one update, or in two halves (a table gone wrong may
        # hold a negative count, and the count minus it can exceed int16 by a little)
        parts = [counts] if counts.min(initial=0) >= info.min and counts.max(initial=0) <= info.max else \
            [counts // 2, counts - counts // 2]
        for part in parts:
            self.ps.update_many("word_topic", keys, part[keys].astype(cfg["count_dtype"]))
        self.ps.update("topic_totals", 0, dtotals)
        return {"tokens": len(z), "totals": totals}

    def prefetch(self, args: dict[str, Any]) -> list[tuple[str, range]]:
        """A sampling task reads its block's rows: with ``--pipeline 2`` they arrive while the
        executor still samples its previous block."""
        return [("word_topic", self._block_rows(args["block"]))] if args.get("op") == "sample" else []

    def _block_rows(self, block: int) -> range:
        """The rows (chunks) of ``word_topic`` that hold ``block``'s words."""
        return _layout(self.config).chunks(block, _num_blocks(self.config, self.num_executors))

    def _own_rounds_since(self, counted: int) -> np.ndarray:
        """This executor's change of ``n_k`` in its rounds after ``counted``, the last one whose
        completion the driver had seen when it dispatched this task. With ``--pipeline 1`` that is
        always the previous round, and the sum is zero; with more, a task can be dispatched while
        its executor's previous rounds still run, and their moves are missing from the driver's
        totals. The executor ran them (its tasks run in order), so it adds them back: each task
        sees every move of its own executor, as in the plain schedule."""
        kept = [(r, d) for r, d in self.state.get("own_rounds", []) if r > counted]
        self.state["own_rounds"] = kept
        return sum((d for _, d in kept), np.zeros(self.config["topics"], np.int64))

    def _sample(self, args: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        K = cfg["topics"]
        block = args["block"]
        chunks = self._block_rows(block)
        rows3 = self.ps.get_many("word_topic", chunks)  # a fresh copy, ours to change
        totals = np.array(args["totals"], np.int64)  # n_k as of the dispatch (see the module docstring)
        totals += self._own_rounds_since(args.get("totals_has", args["round"] - 1))
        rows = rows3.reshape(-1, K)
        rows_before = rows.copy()
        totals_before = totals.copy()
        lo, hi = self.input["block_ptr"][block], self.input["block_ptr"][block + 1]
        z = self.state["z"]
        changed = 0
        device = gpu.process_device(cfg.get("device", "cpu"))
        if device == "cuda":
            tokens = self._device_tokens()
            self._gpu_tokens = None  # until the topics are back on the host: after a failure, copy afresh
            changed = tokens.sweep(rows, totals, int(lo), int(hi), z, cfg["alpha"], cfg["beta"],
                                   cfg["num_words"] * cfg["beta"], lk.task_seed(cfg["seed"], self.executor_id,
                                                                                args["round"]), args["sweeps"])
            self._stale_doc_list = self.state["doc_list"]  # rebuilt when read (_doc_list)
            self._gpu_tokens = (self.input, z, self.state["doc_list"], tokens)
        else:
            for sweep in range(args["sweeps"]):
                changed += lk.sweep(rows, totals, self.input["tok_word"][lo:hi], self.input["tok_off"][lo:hi],
                                    z[lo:hi], self._doc_list(), cfg["alpha"], cfg["beta"],
                                    cfg["num_words"] * cfg["beta"], cfg["sampler"],
                                    lk.task_seed(cfg["seed"], self.executor_id, args["round"], sweep))
        dtotals = totals - totals_before
        self.state.setdefault("own_rounds", []).append((args["round"], dtotals))
        if changed:
            delta = (rows - rows_before).reshape(rows3.shape)
            moved = np.flatnonzero(delta.reshape(len(chunks), -1).any(axis=1))
            self.ps.update_many("word_topic", np.asarray(chunks)[moved], delta[moved])
            self.ps.update("topic_totals", 0, dtotals)
        out: dict[str, Any] = {"tokens": int(hi - lo), "changed": changed, "totals": dtotals, "device": device}
        if device == "cuda":
            from apps.lda_cuda import launch_mode

            out["launch"] = launch_mode()
        if cfg["collect"]:  # for tests: the n_k this task sampled with
            out["totals_seen"] = totals_before
        if args.get("report_words"):
            out["word_ll"], out["colsum"] = lk.block_loglik(rows, self._word_table)
        if args.get("report_docs"):
            inp = self.input
            out["doc_ll"] = lk.doc_loglik(inp["doc_off"], self._doc_list(), inp["doc_len"], cfg["alpha"], K,
                                          self._doc_table)
        return out

    def _device_tokens(self) -> Any:
        """This executor's tokens on the GPU (``apps.lda_cuda.DeviceTokens``), copied at its first task
        there, and again whenever its state changed other than by its own GPU tasks (a restore)."""
        from apps.lda_cuda import DeviceTokens  # imported only where a GPU is wanted (apps/gpu.py)

        cached = self._gpu_tokens
        st = self.state
        if cached is None or cached[0] is not self.input or cached[1] is not st["z"] or cached[2] is not st["doc_list"]:
            inp = self.input
            tokens = DeviceTokens(inp["tok_word"], inp["tok_doc"], st["z"], len(inp["docs"]), self.config["topics"])
            cached = self._gpu_tokens = (self.input, st["z"], st["doc_list"], tokens)
        return cached[3]


# ----------------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------------


class LDADriver(litz.Driver):
    """Three phases: every executor pushes its initial counts; the block rotation runs its rounds;
    optionally (tests) every executor returns its final assignment.

    ``B`` rounds make a *cycle*, in which each executor holds each block once and resamples its tokens
    there ``S`` times (``--sweeps-per-task``, default 1), so a cycle is ``S`` iterations (the last cycle
    may do fewer).
    """

    #: where the sampling tasks ran (``cpu``, ``cuda``), as they report it
    devices: frozenset[str] = frozenset()
    #: how GPU tasks ran their sweeps (``apps.lda_cuda.launch_mode``), each printed when first seen
    gpu_launches: frozenset[str] = frozenset()

    def dispatch_initial_tasks(self) -> None:
        cfg = self.config
        E = self.num_executors
        self.B = _num_blocks(cfg, E)
        if not E <= self.B <= cfg["chunks"]:
            raise litz.ConfigError(f"LDA needs executors <= blocks <= chunks, got {E} executors, {self.B} blocks "
                                   f"and {cfg['chunks']} chunks (see --blocks and --chunks)")
        self.iterations = int(cfg["iterations"])
        self.S = int(cfg["sweeps_per_task"])
        self.cycles = -(-self.iterations // self.S)
        self.rotation = litz.BlockRotation(E, self.B, self.cycles * self.B, int(cfg.get("pipeline", 1)))
        self._completed_round = [-1] * E  # each executor's last round whose change is in self.totals
        self._seen: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []  # with --collect (tests)
        self.layout = _layout(cfg)
        self.history: list[dict[str, float]] = []
        self._reports: dict[int, dict[str, Any]] = {}
        self._changed: dict[int, int] = {}  # cycle -> tokens that changed topic, until reported
        self._in_flight = 0  # sampling tasks
        self._running = 0  # tasks of any kind
        self._phase = "init"
        self._left = E
        self._dumps: list[dict[str, Any]] = []
        self._dump_gen = 0  # dumps of an earlier generation came before a recovery: ignored
        # after a partial recovery the tables are recounted (see ``recovered``): None, "wanted"
        # (once no task runs), "replacing" or "adding"; rounds due meanwhile wait in _held
        self._repair: str | None = None
        self._repair_again = False
        self._held: list[tuple[int, int, int]] = []
        self._recount_totals = np.zeros(cfg["topics"], np.int64)
        self._recount_left = 0
        self._start = time.perf_counter()
        self._t0 = self._last = self._start
        self.loglik = float("nan")
        self.totals = np.zeros(cfg["topics"], np.int64)  # n_k: the sum of every completed task's change
        for e in range(E):
            self._send(e, {"op": "init"})

    def _send(self, executor: int, args: dict[str, Any]) -> None:
        self.dispatch_task(executor, args)
        self._running += 1

    @property
    def iteration(self) -> int | None:
        """Iterations that every executor has completed (for checkpoints every C iterations)."""
        if getattr(self, "_phase", "init") == "init":
            return 0
        return min((min(self._completed_round) + 1) // self.B * self.S, self.iterations)

    # -- partial recovery ----------------------------------------------------------------------------
    def recovered(self, recovery: litz.Recovery) -> None:
        """A lost process's part came back from the checkpoint while the rest went on, so the tables
        no longer count the executors' assignments: a restored executor's tokens are back at their
        checkpointed topics (or a restored shard's counts are), and the counts of the lost timeline
        are still in the tables (or missing from them). The assignments are the model; the tables
        are their histogram. So once no task runs, one task takes the tables' contents out and every
        executor adds its counts back (``_push_counts``); rounds wait meanwhile, and the driver's
        running ``n_k`` becomes the recount's. Exact whatever was lost, and costs one pass over the
        tokens; only the restored executors' sampling since the checkpoint is redone."""
        what = (f"{len(recovery.executors)} executors" if recovery.role == "worker"
                else f"{len(recovery.shards)} shards")
        if not self.config["quiet"]:
            print(f"recovered from the loss of {', '.join(recovery.lost)} ({what} from "
                  f"{recovery.checkpoint or 'scratch'}): recounting the word-topic table", flush=True)
        if self._repair is None:
            self._repair = "wanted"
        else:  # during a recount: start it over once it ends
            self._repair_again = True
        if self._phase == "dump":  # a restored executor's assignment is not what it dumped
            self._dump_gen += 1
            self._dumps = []
        self._maybe_repair()

    def _maybe_repair(self) -> None:
        if self._repair != "wanted" or self._running:
            return
        self._repair, self._repair_again = "replacing", False
        self._recount_totals = np.zeros(self.config["topics"], np.int64)
        self._send(0, {"op": "recount", "replace": True})

    def _recounted(self, totals: np.ndarray) -> None:
        self._recount_totals += totals
        if self._repair == "replacing":
            self._repair, self._recount_left = "adding", self.num_executors - 1
            for e in range(1, self.num_executors):
                self._send(e, {"op": "recount"})
        else:
            self._recount_left -= 1
        if self._repair != "adding" or self._recount_left:
            return
        if self._repair_again:
            self._repair = "wanted"
            return
        self._repair = None
        self.totals = self._recount_totals.copy()
        held, self._held = self._held, []
        self._dispatch(held)
        if self._phase == "sample" and self.rotation.finished() and self._in_flight == 0:
            self._end_sampling()
        elif self._phase == "dump" and not self._dumps:
            self._dispatch_dumps()

    # -- rotation ------------------------------------------------------------------------------------
    def _iterations_after(self, cycle: int) -> int:
        """How many iterations are complete once ``cycle`` is."""
        return min((cycle + 1) * self.S, self.iterations)

    def _last_use_in_cycle(self, block: int, rnd: int) -> bool:
        """Whether round ``rnd`` is the last one of its cycle in which some executor holds ``block``."""
        end = (rnd // self.B + 1) * self.B
        return all(self.rotation.user(block, r) is None for r in range(rnd + 1, end))

    def _dispatch(self, assignments: list[tuple[int, int, int]]) -> None:
        if self._repair is not None:  # after the recount, with the recounted n_k
            self._held.extend(assignments)
            return
        every = self.config["ll_every"]
        for e, rnd, block in assignments:
            cycle = rnd // self.B
            after = self._iterations_after(cycle)
            report = after // every > (cycle * self.S) // every or cycle == self.cycles - 1
            self._send(e, {"op": "sample", "round": rnd, "block": block, "cycle": cycle,
                           "sweeps": after - cycle * self.S, "totals": self.totals.copy(),
                           "totals_has": self._completed_round[e],
                           "report_docs": report and rnd % self.B == self.B - 1,
                           "report_words": report and self._last_use_in_cycle(block, rnd)})
            self._in_flight += 1

    def handle_task_completion(self, result: litz.TaskResult) -> None:
        self._running -= 1
        self._completed(result)
        self._maybe_repair()

    def _completed(self, result: litz.TaskResult) -> None:
        op = result.args["op"]
        if op == "recount":
            self._recounted(result.value["totals"])
        elif op == "init":
            self.totals += result.value["totals"]
            self._left -= 1
            if self._left == 0:
                self._phase = "sample"
                self._t0 = self._last = time.perf_counter()
                self._dispatch(self.rotation.start())
        elif op == "sample":
            self._in_flight -= 1
            self.totals += result.value["totals"]
            self._completed_round[result.executor_id] = result.args["round"]
            if self.config["collect"]:
                self._seen.append((result.executor_id, result.args["round"], result.args["totals_has"],
                                   np.asarray(result.value["totals_seen"]), np.asarray(result.value["totals"])))
            self._record(result.args, result.value)
            self._dispatch(self.rotation.complete(result.executor_id, result.args["round"]))
            if self.rotation.finished() and self._in_flight == 0 and self._repair is None:
                self._end_sampling()
        elif result.args["gen"] == self._dump_gen:
            self._dumps.append(result.value)
            if len(self._dumps) == self.num_executors and self._repair is None:
                self._finish()

    def _record(self, args: dict[str, Any], value: dict[str, Any]) -> None:
        cycle = args["cycle"]
        self.devices = self.devices | {value.get("device", "cpu")}
        launch = value.get("launch")
        if launch is not None and launch not in self.gpu_launches:
            self.gpu_launches = self.gpu_launches | {launch}
            if not self.config["quiet"]:
                print(f"GPU sweeps: {launch}", flush=True)
        self._changed[cycle] = self._changed.get(cycle, 0) + value["changed"]
        if not (args["report_docs"] or args["report_words"]):
            return
        rep = self._reports.setdefault(cycle, {"docs": 0, "words": 0, "ll": 0.0,
                                               "totals": np.zeros(self.config["topics"], np.int64)})
        if args["report_docs"]:
            rep["docs"] += 1
            rep["ll"] += value["doc_ll"]
        if args["report_words"]:
            rep["words"] += 1
            rep["ll"] += value["word_ll"]
            rep["totals"] += value["colsum"]
        if rep["docs"] == self.num_executors and rep["words"] == self.B:
            del self._reports[cycle]
            self._report(cycle, rep)

    def _report(self, cycle: int, rep: dict[str, Any]) -> None:
        """One progress line: the log-likelihood after ``cycle``, and the rate since the last line."""
        cfg = self.config
        now = time.perf_counter()
        ll = (rep["ll"] + lk.topic_loglik(rep["totals"], cfg["beta"], cfg["num_words"])) / cfg["num_tokens"]
        self.loglik = ll
        it = self._iterations_after(cycle)
        done = it - (self.history[-1]["iteration"] if self.history else 0)
        changed = sum(self._changed.pop(c) for c in [c for c in self._changed if c <= cycle])
        seconds = now - self._last
        self._last = now
        entry = {"iteration": it, "loglik": ll, "seconds": seconds, "elapsed": now - self._t0,
                 "changed": changed / (done * cfg["num_tokens"])}
        self.history.append(entry)
        if not cfg["quiet"]:
            print(f"iteration {it:4d}/{self.iterations}  log-likelihood per token {ll:.4f}  "
                  f"changed {entry['changed']:.3f}  "
                  f"{done * cfg['num_tokens'] / seconds / 1e6:6.2f}M tokens/s", flush=True)

    def _end_sampling(self) -> None:
        self.sampling_seconds = time.perf_counter() - self._t0
        if self.config["collect"]:
            self._phase = "dump"
            self._dispatch_dumps()
        else:
            self._finish()

    def _dispatch_dumps(self) -> None:
        for e in range(self.num_executors):
            self._send(e, {"op": "dump", "gen": self._dump_gen})

    def _finish(self) -> None:
        cfg = self.config
        K = cfg["topics"]
        C = self.layout.num_chunks
        rows = self.ps.get_many("word_topic", range(C)).reshape(C * self.layout.chunk_words, K).astype(np.int64)
        totals = np.array(self.ps.get("topic_totals", 0))
        if not (totals == self.totals).all():
            raise RuntimeError(f"topic totals on the servers {totals.tolist()} differ from the sum of the tasks' "
                               f"changes {self.totals.tolist()}: an update was lost or applied twice")
        vocab = load_corpus(cfg).vocab
        words = self.layout.word_at(np.arange(len(rows)))
        top: list[list[str]] = []
        for k in range(K):
            best = np.argsort(-rows[:, k], kind="stable")[: cfg["top_words"]]
            top.append([vocab[words[p]] for p in best if rows[p, k] > 0 and words[p] >= 0])
        if not cfg["quiet"]:
            for k in np.argsort(-totals, kind="stable"):
                print(f"topic {k:3d} ({totals[k] / cfg['num_tokens']:6.2%}): {' '.join(top[k])}")
        print(f"log-likelihood per token {self.loglik:.3f}", flush=True)  # the result line, --quiet or not
        result: dict[str, Any] = {
            "loglik": self.loglik, "history": self.history, "topics": top,
            "sampling_seconds": self.sampling_seconds, "devices": sorted(self.devices),
            "gpu_launches": sorted(self.gpu_launches),
            "tokens_per_second": cfg["num_tokens"] * self.iterations / self.sampling_seconds,
            "seconds": time.perf_counter() - self._start}
        if cfg["collect"]:
            result["word_topic"] = rows[words >= 0][np.argsort(words[words >= 0])]  # (V, K) in word-id order
            result["totals"] = totals
            result["assignments"] = self._dumps
            result["totals_seen"] = self._seen
        self.finish(result)

    def progress(self) -> str:
        if not getattr(self, "history", None):
            line = f"{getattr(self, '_phase', 'init')}: iteration 0/{self.config['iterations']}"
        else:
            h = self.history[-1]
            line = f"iteration {h['iteration']}/{self.iterations}, log-likelihood per token {h['loglik']:.4f}"
        return line + (", recounting the tables after a recovery" if getattr(self, "_repair", None) else "")


# ----------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="litz launch apps/lda.py",
                                description="LDA topic model by collapsed Gibbs sampling with vocabulary blocks "
                                            "rotated over the executors (model scheduling).")
    p.add_argument("--corpus", choices=CORPORA, default="fortunes",
                   help="Debian 'fortunes' (15k docs) or 'wordnet-base' glosses (117k docs); 'synthetic' "
                        "draws documents from known topics")
    p.add_argument("--topics", "-K", type=int, default=20)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--alpha", type=float, default=0.1, help="symmetric document-topic prior")
    p.add_argument("--beta", type=float, default=0.01, help="symmetric topic-word prior")
    p.add_argument("--sampler", choices=sorted(lk.SAMPLERS), default="sparse",
                   help="sparse: O(topics of the document) per token; exact: O(K), the reference")
    gpu.add_device_option(p, "the Gibbs sweeps (on a GPU: one thread per token, the dense sampler)",
                          "apps/lda_cuda.py")
    p.add_argument("--blocks", type=int, default=0, help="vocabulary blocks (0 = one per executor)")
    p.add_argument("--chunks", type=int, default=32,
                   help="rows of the word-topic table (groups of words; a block is a range of them)")
    p.add_argument("--min-count", type=int, default=5, help="drop words seen fewer times in the corpus")
    p.add_argument("--pipeline", type=int, default=1,
                   help="tasks in flight per executor (2: an executor's next round waits in its queue while it "
                        "samples, which hides the messages between rounds; needs --blocks above the executors)")
    p.add_argument("--sweeps-per-task", type=int, default=1,
                   help="resample a block's tokens S times per task: S times fewer rounds (each a few round trips "
                        "between processes) per iteration, at some cost in mixing per iteration")
    p.add_argument("--ll-every", type=int, default=1,
                   help="report the log-likelihood every N iterations (at the end of the cycle reaching them)")
    p.add_argument("--top-words", type=int, default=10, help="words printed per topic at the end")
    p.add_argument("--synthetic-docs", type=int, default=400, help="with --corpus synthetic")
    p.add_argument("--synthetic-doc-len", type=int, default=40, help="with --corpus synthetic")
    p.add_argument("--synthetic-topics", type=int, default=5, help="with --corpus synthetic")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--collect", action="store_true",
                   help="return the final assignments and tables in the job's result (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the result line is printed)")
    return p


def make_app(argv: list[str]) -> litz.App:
    """The app for ``litz launch apps/lda.py ARGV``. It loads the corpus here (cached on disk) because the
    tables' shapes depend on the vocabulary, and the count dtype on the most frequent word."""
    args = parser().parse_args(argv)
    require_at_least(args, topics=1, iterations=1, ll_every=1, sweeps_per_task=1, pipeline=1, blocks=0, chunks=1,
                     min_count=0, top_words=0, synthetic_docs=1, synthetic_doc_len=1,
                     synthetic_topics=1)
    require_finite(args, positive=("alpha", "beta"))
    gpu.check_device(args.device)
    config: dict[str, Any] = {
        "corpus": args.corpus, "min_count": args.min_count, "topics": args.topics, "iterations": args.iterations,
        "alpha": args.alpha, "beta": args.beta, "sampler": args.sampler, "blocks": args.blocks,
        "ll_every": args.ll_every, "sweeps_per_task": args.sweeps_per_task, "pipeline": args.pipeline,
        "top_words": args.top_words,
        "seed": args.seed, "collect": args.collect, "device": args.device,
        "quiet": args.quiet,
        "synthetic": {"num_docs": args.synthetic_docs, "doc_len": args.synthetic_doc_len,
                      "num_topics": args.synthetic_topics, "seed": args.seed}}
    corpus = load_corpus(config)
    if corpus.num_tokens == 0:
        raise litz.ConfigError(f"corpus {args.corpus!r} has no tokens left (try a lower --min-count)")
    try:  # a document too long for its counts to share an int32 with a topic: refused now, not by a worker
        lk.doc_offsets(np.diff(corpus.doc_ptr), args.topics)
    except ValueError as exc:
        raise litz.ConfigError(str(exc)) from None
    max_word_count = int(np.bincount(corpus.words).max())
    config.update(num_words=corpus.num_words, num_tokens=corpus.num_tokens, max_word_count=max_word_count,
                  count_dtype="int16" if max_word_count <= np.iinfo(np.int16).max else "int32",
                  chunks=max(1, min(args.chunks, corpus.num_words)))
    layout = _layout(config)
    # priority (SCAR) checkpoints rank word chunks by how far each word's topic mix moved,
    # weighted by the word's count: the length-scaled total variation
    tables = [litz.Table("word_topic", shape=(layout.chunk_words, args.topics), dtype=config["count_dtype"],
                         num_rows=layout.num_chunks, distance="tv"),
              litz.Table("topic_totals", shape=(args.topics,), dtype="int64", num_rows=1)]
    return litz.App(LDADriver, LDAExecutor, tables=tables, config=config, name="lda")


if __name__ == "__main__":
    from litz.cli import launch

    sys.exit(launch([__file__, *sys.argv[1:]]))
