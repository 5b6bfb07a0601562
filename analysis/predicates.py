"""The row predicates and keys every analysis shares, each defined once.

- A token is *in the sequence* when it ended up in the output: a plain decode token, a verification anchor, or an
  accepted draft (rejected drafts were read by the step but are redone).
- A request-step is *decoding* when it ran one anchor and its drafts (``num_tokens == num_drafts + 1``), not a
  prefill chunk.
- A step is identified by ``(dp_rank, step)``: every data-parallel rank numbers its own steps.
"""

from __future__ import annotations

import polars as pl

DP_RANK_SHIFT = 16  # step keys: step << 16 | dp_rank (dp_rank is uint16)
HASH_RANGE = 1 << 32  # a key's hash modulo this, below share × this: in a deterministic sample at that share


def phase_is(phase: str) -> pl.Expr:
    """Routing rows of one ``phase`` (``schema.TOKEN_PHASES``). Compared as the categorical it is read as: cast to
    strings first, every row's phase would be a string made (60M rows: a second per predicate)."""
    return pl.col("phase") == phase


def in_sequence() -> pl.Expr:
    """Routing rows of tokens that ended up in the sequence (see the module doc)."""
    return phase_is("decode") | (
        phase_is("verify") & ((pl.col("draft_pos") == 0) | pl.col("accepted").fill_null(False)))


def accepted_sequence(routing: pl.LazyFrame) -> pl.LazyFrame:
    """The routing rows of tokens in the sequence."""
    return routing.filter(in_sequence())


def decoding() -> pl.Expr:
    """Steps-table rows of decoding request-steps (see the module doc)."""
    return pl.col("num_tokens") == pl.col("num_drafts") + 1


def not_prefill() -> pl.Expr:
    """Routing rows a decode or verification step read (every token of it: anchors, accepted and rejected drafts)."""
    return ~phase_is("prefill")


def step_key() -> pl.Expr:
    """One Int64 per ``(dp_rank, step)``: groups the rows of one engine step across data-parallel ranks apart."""
    return (pl.col("step").cast(pl.Int64) * (1 << DP_RANK_SHIFT) + pl.col("dp_rank").cast(pl.Int64)).alias("step_key")
