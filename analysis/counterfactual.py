"""Counterfactual windows: what one request-step reads at a k its trace did not record. The one definition that the
growth (``growth``, streamed in ``streamed_windows``) and the unions one step reads (``concurrency``; through them
the bytes, the cost model and the decision) cut their windows by.

A trace recorded at K holds, for every decoding request-step, the d ≤ K drafts its drafter proposed (n-gram proposes
fewer whenever its match runs short: 1.72 on average at K = 3 on the default model, 40% of request-steps none). At
k the request-step reads ``window_tokens``:

- k ≤ K: min(d, k) + 1 tokens. n-gram and model drafters propose a prefix of what they would at a larger k.
- k > K: d + 1 where d < K (the drafter stopped short of the cap, and would stop there again); k + 1 where d = K, an
  assumption: a drafter capped at K is taken to propose all k drafts (it extrapolates the recording, which cannot
  say how far past K it would have gone).

Its window is that many consecutive tokens of the request's accepted sequence (decode tokens, verification anchors,
accepted drafts) from the request-step's anchor: its own accepted drafts, then the tokens the request decoded next,
standing in for the drafts it would have proposed. A window that runs past the request's last recorded token is
incomplete and not counted. Windows of neighbouring request-steps overlap where one reads further than it kept.
Acceptance reads the same (``acceptance.acceptance_per_k``): 1 + mean min(d, k) tokens below K, and past it K's
tokens plus k − K for every request-step that proposed K.

An adaptive schedule (DSpark's confidence-scheduled verification) verifies d ≤ K of the K drafts its drafter
proposed: a fixed k runs all k, so its windows are taken as the drafter's (``every_draft_proposed``), k + 1 tokens.

A trace without drafts (K = 0: plain decoding, or an engine's routing imported) does not say what a drafter would
propose: its windows are full, k + 1 tokens, tiling each request's sequence at positions that are multiples of k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.expert_sets import group_of_row, group_starts
from moetrace.analysis.predicates import HASH_RANGE, not_prefill, step_key

NOT_AN_ANCHOR = -1  # ``proposed`` of a token that starts no request-step (an accepted draft)
PROPOSALS_SCHEMA: dict[str, pl.DataType] = {"step_key": pl.Int64(), "request": pl.UInt32(), "proposed": pl.Int64()}


def proposed_drafts(routing: pl.LazyFrame, trace_k: int) -> pl.DataFrame:
    """Per decoding request-step (``step_key``, ``request``): the drafts its drafter proposed (``proposed``: the
    largest ``draft_pos`` of its rows; 0 for a step that proposed none). Empty for a trace without drafts
    (``trace_k`` 0), whose windows do not read it."""
    if trace_k == 0:
        return pl.DataFrame(schema=PROPOSALS_SCHEMA)
    return (routing.filter(not_prefill()).group_by(step_key(), "request")
            .agg(proposed=pl.col("draft_pos").max()).collect().cast(PROPOSALS_SCHEMA))  # type: ignore[arg-type]


def every_draft_proposed(proposals: pl.DataFrame, trace_k: int) -> pl.DataFrame:
    """``proposed_drafts`` of a trace whose adaptive schedule chose how many drafts each request-step verified (its
    routing holds only those), as its drafter proposed them: all ``trace_k`` at every request-step. A fixed k runs
    every draft it proposes, so each request-step's window at k is k + 1 tokens (``window_tokens``)."""
    return proposals.with_columns(proposed=pl.lit(trace_k, pl.Int64))


@dataclass(frozen=True)
class Proposals:
    """``proposed_drafts`` as sorted numpy keys, looked up per token: ``steps`` [S] the step keys, ascending;
    ``keys`` [R] (index in ``steps`` << 32 | request), ascending; ``drafts`` [R] what each request-step proposed."""

    steps: npt.NDArray[np.int64]
    keys: npt.NDArray[np.int64]
    drafts: npt.NDArray[np.int64]

    @classmethod
    def of(cls, proposals: pl.DataFrame) -> Proposals:
        steps, step_index = np.unique(proposals["step_key"].to_numpy().astype(np.int64), return_inverse=True)
        keys = (step_index.astype(np.int64) << 32) | proposals["request"].to_numpy().astype(np.int64)
        order = np.argsort(keys)
        return cls(steps, keys[order], proposals["proposed"].to_numpy().astype(np.int64)[order])

    def at(self, step: npt.NDArray[np.int64], request: npt.NDArray[np.integer],
           draft_pos: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
        """Per token [T] of the accepted sequence (its step key, request, draft position): on a request-step's
        anchor the drafts that request-step proposed (0 where its rows hold none), ``NOT_AN_ANCHOR`` elsewhere."""
        found = np.zeros(len(step), dtype=np.int64)
        if len(self.keys):
            index = np.minimum(np.searchsorted(self.steps, step), len(self.steps) - 1)
            keys = (index << 32) | request.astype(np.int64)
            at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
            hit = (self.steps[index] == step) & (self.keys[at] == keys)
            found = np.where(hit, self.drafts[at], 0)
        return np.where(draft_pos == 0, found, NOT_AN_ANCHOR)


def window_tokens(proposed: npt.NDArray[np.integer], k: int, trace_k: int) -> npt.NDArray[np.int64]:
    """Tokens a request-step of a trace recorded at ``trace_k`` (> 0) that proposed ``proposed`` drafts reads at
    ``k`` (see the module doc)."""
    capped = proposed >= trace_k
    drafts = np.where(capped & (k > trace_k), k, np.minimum(proposed, k))
    return drafts.astype(np.int64) + 1


@dataclass(frozen=True)
class Spans:
    """Complete windows among tokens sorted by (sequence, position): [W] the row each starts at, its tokens and the
    last position it covers (rows ``starts[i]`` to ``starts[i] + widths[i] - 1``)."""

    starts: npt.NDArray[np.int64]
    widths: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]

    def take(self, chosen: npt.NDArray[np.bool_] | npt.NDArray[np.int64]) -> Spans:
        return Spans(self.starts[chosen], self.widths[chosen], self.ends[chosen])

    def widest_first(self) -> Spans:
        """The same windows ordered by width, widest first (``expert_sets.window_union`` takes them so)."""
        return self.take(np.argsort(-self.widths, kind="stable"))


def window_spans(sequence: npt.NDArray[np.integer], position: npt.NDArray[np.integer],
                 proposed: npt.NDArray[np.int64] | None, k: int, trace_k: int) -> Spans:
    """The complete counterfactual windows at ``k`` among accepted-sequence tokens [T] sorted by (``sequence``: one
    id per request, or per request and layer; ``position``). ``proposed`` [T]: ``Proposals.at`` of the tokens, for
    a trace recorded at ``trace_k`` > 0; None for a trace without drafts (full windows at positions that are
    multiples of k + 1, complete when they hold k + 1 rows)."""
    tokens = len(position)
    position = position.astype(np.int64)
    if proposed is None:
        width = k + 1
        block = position // width
        starts = group_starts(sequence, block)
        sizes = np.diff(np.append(starts, tokens))
        complete = sizes == width
        starts = starts[complete]
        return Spans(starts, np.full(len(starts), width, np.int64), block[starts] * width + (width - 1))
    starts = np.flatnonzero(proposed != NOT_AN_ANCHOR).astype(np.int64)
    widths = window_tokens(proposed[starts], k, trace_k)
    last = np.minimum(starts + widths - 1, max(tokens - 1, 0))
    complete = ((starts + widths - 1 < tokens) & (sequence[last] == sequence[starts])
                & (position[last] - position[starts] == widths - 1))
    starts, widths = starts[complete], widths[complete]
    return Spans(starts, widths, position[starts] + widths - 1)


class CutSequence:
    """Accepted-sequence routing rows (``layer``, ``step``, ``dp_rank``, ``request``, ``position``, ``draft_pos`` and
    any others) ordered once by (layer, request, position), to be cut into windows at any k."""

    def __init__(self, rows: pl.DataFrame, trace_k: int, proposals: Proposals | None) -> None:
        self.rows, self.trace_k = rows, trace_k
        keys = rows.select("layer", "request", "position", step_key(), "draft_pos")
        # [T] row of each token, in window order (numpy's sort: the rows come nearly sorted, and Polars' took 15x as
        # long on a 3M-row sample)
        self.order = np.lexsort([keys[name].to_numpy() for name in ("position", "request", "layer")]).astype(np.int64)
        layer, request = keys["layer"].to_numpy()[self.order], keys["request"].to_numpy()[self.order]
        self.request, self.position = request.astype(np.int64), keys["position"].to_numpy()[self.order]
        starts = group_starts(layer, request)
        self.sequence = group_of_row(starts, len(request))  # [T]
        self.layers = max(len(np.unique(layer)), 1)
        self.proposed = None if proposals is None else proposals.at(
            keys["step_key"].to_numpy()[self.order], request, keys["draft_pos"].to_numpy()[self.order])

    def windows(self, k: int, max_windows: int | None = None, share: float = 1.0, full: bool = False,
                columns: list[str] | None = None) -> tuple[pl.DataFrame, float]:
        """The rows (their ``columns``: all by default) keyed by the counterfactual window at ``k`` each lies in
        (``window_spans``; a row of several overlapping windows once for each): ``window_major`` its request,
        ``window_minor`` the window's first position; ``full``: full windows of k + 1 tokens whatever the drafter
        proposed. A deterministic sample of whole windows (by a hash of their key) at ``share``, or thinned to about
        ``max_windows`` per layer; with the share of the windows kept."""
        spans = window_spans(self.sequence, self.position, None if full else self.proposed, k,
                             0 if full else self.trace_k)
        if max_windows is not None:
            share = min(share, max_windows * self.layers / max(len(spans.starts), 1))
        if share < 1.0:
            key = pl.DataFrame({"request": self.request[spans.starts], "position": self.position[spans.starts]})
            kept = key.select(pl.struct("request", "position").hash(seed=0) % HASH_RANGE
                              < int(share * HASH_RANGE)).to_series().to_numpy()
            spans = spans.take(kept)
        # token i of the window that starts at row s is row s + i
        first = np.repeat(spans.starts, spans.widths)
        offset = np.arange(len(first)) - np.repeat(np.cumsum(spans.widths) - spans.widths, spans.widths)
        tokens = first + offset
        rows = self.rows if columns is None else self.rows.select(columns)
        keyed = rows[self.order[tokens]].with_columns(
            window_major=pl.Series(self.request[first]), window_minor=pl.Series(self.position[first].astype(np.int64)))
        return keyed, min(share, 1.0)
