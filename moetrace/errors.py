"""Errors that reach the user as one line and a non-zero exit, never as a traceback."""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """Bad input or an unusable environment, explained in one line."""


def refuse_existing(target: Path, force: bool) -> None:
    """A trace or a user's file is never overwritten without --force (derived reports are just rebuilt)."""
    if target.exists() and not force:
        raise UserError(f"{target}: already exists (use --force to overwrite)")
