"""LDA's GPU sweep (apps/lda_cuda.py): in Numba's CUDA simulator here, on a GPU where there is one,
and ``--device`` on the app."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import litz
from apps import gpu, lda
from tests.conftest import run_in_cuda_simulator
from tests.test_lda_app import _assert_counts_exact, _topic_similarity

ON_GPU = gpu.available() and not gpu.simulated()

# Runs in a process of its own (run_in_cuda_simulator).
SIMULATED_CHECK = textwrap.dedent("""
    import warnings
    import numpy as np
    from apps import lda_kernels as lk
    from apps.lda_cuda import DeviceTokens
    warnings.simplefilter("ignore", RuntimeWarning)  # the simulator's uint64 hash overflows on purpose
    rng = np.random.default_rng(3)
    K, V, D, n, alpha, beta = 5, 12, 25, 400, 0.3, 0.05
    tok_word = rng.integers(0, V - 1, n).astype(np.int32)
    tok_doc = rng.integers(0, D - 1, n).astype(np.int32)
    tok_word[-1], tok_doc[-1] = V - 1, D - 1  # a token alone in its word and its document
    order = np.lexsort((tok_doc, tok_word))
    tok_word, tok_doc = tok_word[order], tok_doc[order]
    z = rng.integers(0, K, n).astype(np.int32)
    rows = np.zeros((V, K), np.int16)
    np.add.at(rows, (tok_word, z), 1)
    totals = np.bincount(z, minlength=K).astype(np.int64) + 50  # other executors' tokens too
    dev = DeviceTokens(tok_word, tok_doc, z, D, K)
    # 1. a block of tokens, two sweeps, fewer threads than tokens: every count is exact afterwards, with
    # a sweep in one cooperative launch (the simulator's grid is one block: the threads stride) and
    # with a launch per wave
    from apps import lda_cuda
    from apps.lda_cuda import cooperative_blocks
    assert cooperative_blocks(32) == 1 and lda_cuda.launch_mode(32) == "one cooperative launch per sweep"
    saved = lda_cuda._COOPERATIVE.pop(32), lda_cuda.cooperative_unavailable
    lda_cuda._COOPERATIVE[32], lda_cuda.cooperative_unavailable = 0, "CudaSupportError: no cooperative launch"
    assert lda_cuda.launch_mode(32) == ("a launch per wave (cooperative launches fail here: CudaSupportError: "
                                        "no cooperative launch)")
    lda_cuda._COOPERATIVE[32], lda_cuda.cooperative_unavailable = saved
    for cooperative in (False, True):
        z0 = z.copy()
        changed = dev.sweep(rows, totals, 60, 330, z, alpha, beta, 100 * beta, seed=11, sweeps=2, threads=32,
                            waves=16, cooperative=cooperative)  # 16 waves of 17 tokens: the simulator is slow
        assert (z[:60] == z0[:60]).all() and (z[330:] == z0[330:]).all() and (z[60:330] != z0[60:330]).any()
        assert 0 < changed <= 2 * 270, changed
        recount = np.zeros((V, K), np.int64)
        np.add.at(recount, (tok_word, z), 1)
        assert (recount == rows).all() and (totals == np.bincount(z, minlength=K) + 50).all()
        ndk = np.zeros((D, K), np.int64)
        np.add.at(ndk, (tok_doc, z), 1)
        assert (dev.doc_counts() == ndk).all()
    # one thread: both ways visit the tokens one at a time in the same order (the simulator runs blocks
    # one after another), so from the same state they must draw exactly the same topics
    same = []
    for cooperative in (False, True):
        z_c, rows_c, totals_c = z.copy(), rows.copy(), totals.copy()
        DeviceTokens(tok_word, tok_doc, z_c, D, K).sweep(rows_c, totals_c, 60, 330, z_c, alpha, beta, 100 * beta,
                                                         seed=5, threads=1, waves=4, cooperative=cooperative)
        same.append((z_c, rows_c, totals_c))
    assert all((a == b).all() for a, b in zip(*same)) and (same[0][0] != z).any()
    # 2. one token drawn again and again from the same state (the device copy made afresh each time):
    # the draws' frequencies must match its full conditional. Once for a token among others in its
    # word and document, once for the token alone in both (there a sampler that leaves the token's own
    # counts in gives its topic 5 to 20 times the weight)
    draws = 800
    for t in (200, int(np.flatnonzero(tok_word == V - 1)[0])):
        d, w = tok_doc[t], tok_word[t]
        hits = np.zeros(K)
        for s in range(draws):
            z_s, rows_s, totals_s = z.copy(), rows.copy(), totals.copy()
            DeviceTokens(tok_word, tok_doc, z_s, D, K).sweep(rows_s, totals_s, t, t + 1, z_s, alpha, beta,
                                                             100 * beta, seed=s, threads=1)
            hits[z_s[t]] += 1
        others = np.delete(np.arange(n), t)
        nd = np.bincount(z[others][tok_doc[others] == d], minlength=K)
        row = rows[w].astype(np.int64) - np.eye(K, dtype=np.int64)[z[t]]
        p = lk.conditional(np.arange(K), nd, row, totals - np.eye(K, dtype=np.int64)[z[t]], alpha, beta, 100 * beta)
        sigma = np.sqrt(p * (1 - p) / draws)
        assert (np.abs(hits / draws - p) < 4 * sigma + 1e-9).all(), (t, hits / draws, p)
        assert p.max() < 0.9  # the conditional is not degenerate: the check tells samplers apart
    # 3. refusals on the host (the kernel does not check its reads)
    for call, err in ((lambda: dev.sweep(rows[:3], totals, 60, 330, z, alpha, beta, 1.0, 0), IndexError),
                      (lambda: dev.sweep(rows, totals.astype(np.int32), 0, 10, z, alpha, beta, 1.0, 0), TypeError),
                      (lambda: dev.sweep(rows, totals, 0, n + 1, z, alpha, beta, 1.0, 0), IndexError)):
        try:
            call()
        except err:
            pass
        else:
            raise AssertionError("bad input was not refused")
    # 4. dense document counts that would not fit the GPU's free memory: refused, saying why
    import apps.lda_cuda as lc
    lc._free_memory = lambda: 4 * D * K
    try:
        DeviceTokens(tok_word, tok_doc, z, D, K)
    except MemoryError as e:
        assert f"{D:,} documents x {K} topics" in str(e) and "more executors" in str(e), e
    else:
        raise AssertionError("a copy larger than the free memory was not refused")
    print("simulated lda ok", changed)
""")


def test_the_gpu_sweep_in_the_cuda_simulator_keeps_counts_exact_and_draws_the_conditional() -> None:
    """Threads take their tokens out and put them back with atomics: after two sweeps over a block, with
    fewer threads per block than tokens, the word-topic rows, totals and the GPU's document counts are
    exactly the histograms of the new topics, and tokens outside the block kept theirs. A token
    resampled 800 times from the same state draws its full conditional (every topic within 4 standard errors): one among
    others, and one alone in its word and document."""
    run_in_cuda_simulator(SIMULATED_CHECK, "simulated lda ok")


JOB_CHECK = textwrap.dedent("""
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)
    import litz
    from apps import lda
    from tests.test_lda_app import _assert_counts_exact
    # one iteration: 3 blocks, so each executor runs 3 tasks on its GPU copy of the tokens
    app = lda.make_app(["--corpus", "synthetic", "--topics", "4", "--iterations", "1", "--blocks", "3", "--chunks",
                        "6", "--synthetic-docs", "40", "--synthetic-doc-len", "15", "--synthetic-topics", "3",
                        "--collect", "--quiet", "--device", "cuda"])
    out = litz.run(app, workers=2, servers=1, num_executors=2).value
    assert out["devices"] == ["cuda"], out["devices"]
    assert out["gpu_launches"] == ["one cooperative launch per sweep"], out["gpu_launches"]
    _assert_counts_exact(out)
    assert out["totals"].sum() == 600
    print("simulated lda job ok", out["loglik"])
""")


def test_a_job_with_device_cuda_in_the_simulator_keeps_every_count_exact() -> None:
    """The app's device path (tokens copied once, topics back to the host's state, the host's document
    lists rebuilt) through workers and servers: the tables and every executor's document lists equal
    the histograms of the final assignments."""
    run_in_cuda_simulator(JOB_CHECK, "simulated lda job ok")


def test_document_lists_left_behind_by_gpu_tasks_are_rebuilt_before_they_are_read() -> None:
    """A GPU task changes the topics and leaves the host's document lists as they were (the GPU keeps its
    own counts). Whatever reads the lists must see them rebuilt: ``get_state`` (checkpoints, moves), in
    place, so that the GPU copy keyed on the array stays valid; an executor whose state was replaced
    (a move, a restore) must not rebuild the new lists from the old mark."""
    app = lda.make_app(["--corpus", "synthetic", "--topics", "5", "--synthetic-docs", "30", "--quiet"])
    ex = lda.LDAExecutor()
    ex.executor_id, ex.num_executors, ex.config = 0, 1, app.config
    ex.input = ex.load_input()
    ex.state = ex.init_state()
    lists = ex.state["doc_list"]
    before = lists.copy()
    z = ex.state["z"]
    z[:] = (z + 1) % 5  # what a GPU task leaves: new topics on the host, the lists marked stale
    ex._stale_doc_list = lists
    state = ex.get_state()
    assert state["doc_list"] is lists and not np.array_equal(lists, before)
    assert np.array_equal(lists, ex._doc_lists(z))
    z[:] = (z + 1) % 5  # not marked: nothing rebuilds it (the CPU sweep keeps its lists current itself)
    assert np.array_equal(ex.get_state()["doc_list"], ex._doc_lists((z + 4) % 5))
    ex._stale_doc_list = lists
    ex.set_state({"z": z.copy(), "doc_list": ex._doc_lists(z)})  # a move or a restore: fresh lists
    kept = ex.state["doc_list"].copy()
    ex.state["z"][:] = 0
    assert np.array_equal(ex.get_state()["doc_list"], kept)


def test_without_a_gpu_device_cuda_is_refused_and_auto_samples_on_the_cpu(etcd) -> None:
    if not gpu.available():
        with pytest.raises(litz.ConfigError, match="--device cuda: no CUDA GPU"):
            lda.make_app(["--corpus", "synthetic", "--device", "cuda"])
    app = lda.make_app(["--corpus", "synthetic", "--topics", "5", "--iterations", "4", "--synthetic-docs", "60",
                        "--quiet", "--device", "auto"])
    out = litz.run(app, workers=1, servers=1, num_executors=2, etcd=etcd.url).value
    assert out["devices"] == ["cuda" if gpu.available() else "cpu"]
    assert len(out["gpu_launches"]) == (1 if gpu.available() else 0)  # a CPU job names no GPU launch


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (the simulator checks above run everywhere)")
def test_on_a_gpu_the_sampler_learns_as_well_as_the_cpus(etcd) -> None:
    """On hardware thousands of tokens move at once: the log-likelihood reached must be within 1% of the
    CPU's sequential sampler's, the true topics recovered, and the counts exact."""
    argv = ["--corpus", "synthetic", "--topics", "7", "--iterations", "60", "--blocks", "4", "--chunks", "8",
            "--synthetic-docs", "400", "--synthetic-doc-len", "40", "--synthetic-topics", "5", "--collect",
            "--quiet", "--ll-every", "20"]
    _, phi = lda.synthetic_corpus(num_docs=400, doc_len=40, num_topics=5, seed=0)
    ll = {}
    for device in ("cpu", "cuda"):
        out = litz.run(lda.make_app([*argv, "--device", device]), workers=2, servers=1, num_executors=3,
                       etcd=etcd.url).value
        assert out["devices"] == [device]
        assert len(out["gpu_launches"]) == (device == "cuda")
        _assert_counts_exact(out)
        assert _topic_similarity(out["word_topic"], phi, 0.01).min() > 0.85
        ll[device] = out["loglik"]
    assert abs(ll["cuda"] - ll["cpu"]) <= 0.01 * abs(ll["cpu"]), ll
