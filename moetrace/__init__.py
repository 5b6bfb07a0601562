"""moetrace records which experts every token picks in every MoE layer during speculative-decoding verification
inside vLLM, and turns the traces into the k that pays at each concurrency.

The Python API (the CLI is ``moetrace --help``)::

    import moetrace
    trace = moetrace.open_trace("traces/RUN/k3")   # one recording at one k
    trace.manifest.spec.k                           # the typed manifest (model, spec, parallel, capture, ...)
    routing = trace.routing()                       # pl.LazyFrame: one row per (step, token, MoE layer)
    steps = trace.steps()                           # pl.LazyFrame: one row per (step, request)
    sweep = moetrace.open_traces("traces/RUN")      # every k of a sweep, ordered by k

``moetrace.analysis`` holds the analyses the report runs (``moetrace.analysis.acceptance``, ``.growth``,
``.concurrency``, ``.cost``, ``.decision``, ...): functions of Polars frames that return Polars frames. A trace that
cannot be read raises ``moetrace.errors.UserError`` with one line naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moetrace.trace.reader import Trace, open_trace, open_traces

__all__ = ["Trace", "open_trace", "open_traces"]


def __getattr__(name: str) -> Any:
    """The reader's names, imported on first use: the vLLM plugin imports this package in every engine process,
    which has no use for Polars."""
    if name in __all__:
        from moetrace.trace import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'moetrace' has no attribute {name!r}")


def require_same_checkout(module_file: str, name: str) -> None:
    """ImportError in one line where ``name`` (moetrace.hooks or moetrace.analysis, top-level folders of the source
    tree mapped by package-dir) comes from another checkout than ``moetrace`` itself: the editable install of one
    clone and another clone's ``moetrace/`` on ``sys.path`` would otherwise mix their code in silence."""
    root, package = Path(module_file).resolve().parents[1], Path(__file__).resolve().parent
    if root not in (package, package.parent):
        raise ImportError(f"{name} comes from {root}, moetrace from {package.parent}: two moetrace checkouts are "
                          f"mixed; run from the checkout that is installed, or pip install -e the one you run")
