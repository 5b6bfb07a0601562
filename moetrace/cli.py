"""The ``moetrace`` command line: one click group and the error mapping; each command lives in
``moetrace.commands``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import polars as pl
import pyarrow as pa
from rich.text import Text

from moetrace.commands.calibrate import calibrate
from moetrace.commands.common import err_console
from moetrace.commands.export import export
from moetrace.commands.imports import import_routing
from moetrace.commands.info import info
from moetrace.commands.place import place
from moetrace.commands.record import record
from moetrace.commands.report import budget, report
from moetrace.errors import UserError
from moetrace.trace.reader import unreadable_file


class Group(click.Group):
    """Turns ``UserError`` into one line on stderr and exit code 1, never a traceback; an error reading a trace's
    data becomes one line naming the file, unless ``--debug`` (or ``MOETRACE_DEBUG=1``) asks for the traceback."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["moetrace.args"] = list(args)  # to name a broken file if reading fails later
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            fail(str(exc))
        except (pl.exceptions.PolarsError, pa.ArrowException) as exc:  # data that the footers did not vouch for
            if ctx.params.get("debug"):
                raise
            paths = [Path(arg) for arg in ctx.meta.get("moetrace.args", []) if Path(arg).exists()]
            fail((unreadable_file(paths) or f"reading the trace failed: {str(exc).splitlines()[0]}")
                 + " (--debug shows the traceback)")


def fail(message: str) -> NoReturn:
    # Text, not markup: paths and model names may hold "[...]".
    err_console.print(Text("error: ", style="red") + Text(message), highlight=False, soft_wrap=True)
    sys.exit(1)


@click.group(cls=Group)
@click.version_option(package_name="moetrace")
@click.option("--debug", is_flag=True, envvar="MOETRACE_DEBUG",
              help="Show the traceback of an error reading a trace's data (also MOETRACE_DEBUG=1).")
def main(debug: bool) -> None:
    """Record and analyse MoE expert routing during speculative-decoding verification in vLLM."""


for command in (record, info, import_routing, report, budget, export, place, calibrate):
    main.add_command(command)
