"""Checks of the applications' command-line options, shared so that every app words a bad value
the same way: named as on the command line, with the value given, before any data is loaded."""

from __future__ import annotations

import argparse

import litz


def require_at_least(args: argparse.Namespace, **least: int) -> None:
    """Refuse an integer option below its least value (a ConfigError naming ``--the-option``).

    ``None`` passes: an option left to a default that depends on the data set."""
    for name, low in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            bound = "a positive integer" if low == 1 else f"at least {low}"
            raise litz.ConfigError(f"--{name.replace('_', '-')} must be {bound}, got {value}")
