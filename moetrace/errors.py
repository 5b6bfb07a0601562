"""What reaches the user on stderr in plain lines: an error, one line and a non-zero exit (never a traceback), and
warnings, while the command goes on."""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """Bad input or an unusable environment, explained in one line."""


def refuse_existing(target: Path, force: bool) -> None:
    """A trace or a user's file is never overwritten without --force (derived reports are just rebuilt)."""
    if target.exists() and not force:
        raise UserError(f"{target}: already exists (use --force to overwrite)")


def warn(lines: list[str]) -> None:
    """Each of ``lines`` as a warning on stderr: what the reader met (a file skipped as corrupt, a recording that did
    not close) is said whatever the command can still say from the rest."""
    from rich.console import Console  # only where a command speaks: what runs inside vLLM imports this module too

    console = Console(stderr=True)
    for line in lines:
        console.print(f"warning: {line}", style="yellow", markup=False, highlight=False, soft_wrap=True)
