"""Cost of consistent checkpoints (issue 4): MLR with a checkpoint every epoch against none.

Runs alternate in one process (none, every epoch, none, every epoch, ...), after a warm-up
run, and report the median time per epoch of each, their ratio, and for the checkpointed
runs how long training was held per checkpoint (pause until nothing runs + in-memory copy)
and how long a checkpoint took until its manifest was written (background writes included).

Run: ``python bench/bench_checkpoint.py [--epochs 16] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import litz
from apps import mlr


def one(epochs: int, ckpt_dir: str | None) -> dict[str, float]:
    app = mlr.make_app(["--epochs", str(epochs), "--quiet"])
    kw = {"checkpoint_dir": ckpt_dir, "checkpoint_every": "20"} if ckpt_dir else {}  # 20 clocks = 1 epoch
    res = litz.run(app, workers=2, servers=1, num_executors=8, **kw)
    epoch_s = statistics.median(h["seconds"] for h in res.value["history"])
    ckpts = [c for c in res.stats["master"]["checkpoints"] if c["ok"]]
    return {"epoch": epoch_s, "n": len(ckpts),
            "paused": statistics.median(c["paused_seconds"] for c in ckpts) if ckpts else 0.0,
            "total": statistics.median(c["seconds"] for c in ckpts) if ckpts else 0.0,
            "accuracy": res.value["test_accuracy"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    one(2, None)  # warm-up: Numba cache, dataset cache
    plain, ckpt = [], []
    for _ in range(args.repeats):
        plain.append(one(args.epochs, None))
        with tempfile.TemporaryDirectory() as d:
            ckpt.append(one(args.epochs, d))
    p = statistics.median(r["epoch"] for r in plain)
    c = statistics.median(r["epoch"] for r in ckpt)
    print(f"MLR {args.epochs} epochs, 2 workers, 1 server, 8 executors, {args.repeats} runs each")
    print(f"no checkpoints: {p:.3f} s/epoch; a checkpoint every epoch: {c:.3f} s/epoch; ratio {c / p:.3f}")
    print(f"per checkpoint: training held {statistics.median(r['paused'] for r in ckpt) * 1e3:.1f} ms, "
          f"manifest written after {statistics.median(r['total'] for r in ckpt) * 1e3:.1f} ms "
          f"({statistics.median(r['n'] for r in ckpt):.0f} checkpoints per run); "
          f"accuracy {statistics.median(r['accuracy'] for r in plain):.4f} vs "
          f"{statistics.median(r['accuracy'] for r in ckpt):.4f}")


if __name__ == "__main__":
    main()
