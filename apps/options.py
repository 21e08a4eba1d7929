"""Checks of the applications' command-line options, shared so that every app words a bad value
the same way: named as on the command line, with the value given, before any data is loaded."""

from __future__ import annotations

import argparse
import math

import litz


def require_at_least(args: argparse.Namespace, **least: int) -> None:
    """Refuse an integer option below its least value (a ConfigError naming ``--the-option``).

    ``None`` passes: an option left to a default that depends on the data set."""
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            bound = "a positive integer" if low == 1 else f"at least {low}"
            raise litz.ConfigError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def require_finite(args: argparse.Namespace, *, positive: tuple[str, ...] = (),
                   non_negative: tuple[str, ...] = ()) -> None:
    """Refuse a real-valued option that is not finite (NaN, inf: ``nan <= 0`` is False, so a plain
    comparison lets NaN through), or not > 0 (``positive``) or not >= 0 (``non_negative``)."""
    for names, bound, ok in ((positive, "a positive number", lambda v: v > 0),
                             (non_negative, "a number >= 0", lambda v: v >= 0)):
        for name in names:
            value = getattr(args, name)
            if value is not None and not (math.isfinite(value) and ok(value)):
                raise litz.ConfigError(f"--{name.replace('_', '-')} must be {bound}, got {value}")


def seed(text: str) -> int:
    """An argparse type for seeds: NumPy's generators take non-negative integers only."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a seed must be a non-negative integer, got {value}")
    return value
