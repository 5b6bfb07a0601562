"""Errors that reach the user as one line and a non-zero exit, never as a traceback."""

from __future__ import annotations

from pathlib import Path

from moetrace.trace.schema import MAX_K


class UserError(Exception):
    """Bad input or an unusable environment, explained in one line."""


def refuse_existing(target: Path, force: bool) -> None:
    """A trace or a user's file is never overwritten without --force (derived reports are just rebuilt)."""
    if target.exists() and not force:
        raise UserError(f"{target}: already exists (use --force to overwrite)")


def check_k(k: int, option: str = "--k") -> int:
    """``k`` where it is a draft length moetrace handles (0..MAX_K), else one line naming ``option``."""
    if not 0 <= k <= MAX_K:
        raise UserError(f"{option} {k}: must be between 0 and {MAX_K}")
    return k
