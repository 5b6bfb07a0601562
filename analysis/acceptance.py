"""How many drafts verification accepts, from the steps table: per draft position, tokens per step, step times.

One definition of acceptance serves the tables, the cost model and the decision: the rate at draft position i is
unconditional, the request-steps that accepted at least i drafts over every decoding request-step at that k (those
that proposed fewer than i drafts, or none, count as not accepting at i). So 1 + the sum of the rates over
i = 1..k is exactly the mean tokens a decoding request-step gains.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
import polars as pl

from moetrace.analysis.predicates import decoding
from moetrace.analysis.sources import Source


def acceptance_by_position(steps: pl.LazyFrame, k: int) -> pl.DataFrame:
    """Per draft position 1..k: decoding request-steps, those that proposed at least i drafts, those that accepted at
    least i, the unconditional ``acceptance_rate`` (accepted ÷ request-steps: what the run gained at i, however many
    drafts each request-step verified) and the ``conditional_rate``: accepted at i ÷ the request-steps that verified
    draft i with every draft before it accepted (how often a draft is accepted once it is verified and every draft
    before it was). A request-step that verified fewer than i drafts (n-gram out of matches, an adaptive schedule's
    choice) is not among those verifying i: counted there, it would read as a rejection of a draft never verified."""
    decode = steps.filter(decoding())
    per_position = decode.select(
        request_steps=pl.len().cast(pl.Int64),
        **{f"proposed_{i}": (pl.col("num_drafts") >= i).sum().cast(pl.Int64) for i in range(1, k + 1)},
        **{f"accepted_{i}": (pl.col("num_accepted") >= i).sum().cast(pl.Int64) for i in range(1, k + 1)},
        **{f"reached_{i}": ((pl.col("num_drafts") >= i) & (pl.col("num_accepted") >= i - 1)).sum().cast(pl.Int64)
           for i in range(1, k + 1)},
    ).collect()
    request_steps = int(per_position["request_steps"].item()) if k else 0
    rows = []
    for i in range(1, k + 1):
        accepted, reached = int(per_position[f"accepted_{i}"].item()), int(per_position[f"reached_{i}"].item())
        rows.append({"draft_pos": i, "request_steps": request_steps,
                     "proposed": int(per_position[f"proposed_{i}"].item()), "accepted": accepted,
                     "acceptance_rate": accepted / request_steps if request_steps else None,
                     "conditional_rate": accepted / reached if reached else None})
    schema = {"draft_pos": pl.Int32(), "request_steps": pl.Int64(), "proposed": pl.Int64(), "accepted": pl.Int64(),
              "acceptance_rate": pl.Float64(), "conditional_rate": pl.Float64()}
    return pl.DataFrame(rows, schema=schema, orient="row")


def every_draft_rates(by_position: pl.DataFrame) -> dict[int, float]:
    """The unconditional rates by position of a run that verified every draft its drafter proposed, from a trace in
    which an adaptive schedule verified fewer (``acceptance_by_position`` of it): the rate at i is the product of the
    ``conditional_rate`` at positions 1..i, the drafts the schedule left unverified after accepting all before them
    taken to be accepted as often as those it verified there. Positions up to the first that no request-step
    verified after accepting all before it (past it, nothing measured: ``acceptance_curve`` extrapolates)."""
    rates: dict[int, float] = {}
    rate = 1.0
    for position, conditional in zip(by_position["draft_pos"].to_list(), by_position["conditional_rate"].to_list()):
        if conditional is None:
            break
        rate *= conditional
        rates[int(position)] = rate
    return rates


def tokens_per_step(rates: Sequence[float]) -> float:
    """Tokens a request gains per step: 1 (the token the target model always yields) + the unconditional
    acceptance rates of draft positions 1..k."""
    return 1.0 + float(sum(rates))


def acceptance_curve(measured: Mapping[int, float], k: int) -> tuple[list[float], bool]:
    """Unconditional rates for positions 1..k from those measured at positions 1..K (one trace at K); positions
    past K continue geometrically with the last measured conditional rate (rate K ÷ rate K−1). Returns the rates
    and whether any was extrapolated."""
    positions = sorted(p for p in measured if p >= 1)
    if not positions:
        raise ValueError("no measured acceptance")
    last = float(measured[positions[-1]])
    before = float(measured[positions[-2]]) if len(positions) > 1 else 1.0
    conditional = min(last / before, 1.0) if before > 0 else 0.0
    out: list[float] = []
    for i in range(1, k + 1):
        out.append(float(measured[i]) if i in measured else (out[-1] if out else 1.0) * conditional)
    return out, k > positions[-1]


def acceptance_totals(steps: pl.LazyFrame) -> pl.DataFrame:
    """One row: decoding request-steps (``windows``: each is one verification window, or one plain decode token
    where nothing was proposed), those with drafts, mean drafts and accepted per window with drafts, mean tokens
    a request-step read (``tokens_read``: anchor + drafts) and ``tokens_per_step`` gained (1 + accepted)."""
    decode = steps.filter(decoding())
    with_drafts = pl.col("num_drafts") > 0
    return decode.select(
        windows=pl.len().cast(pl.Int64),
        verify_windows=with_drafts.sum().cast(pl.Int64),
        mean_drafts=pl.col("num_drafts").filter(with_drafts).mean().cast(pl.Float64),
        mean_accepted=pl.col("num_accepted").filter(with_drafts).mean().cast(pl.Float64),
        tokens_read=pl.col("num_tokens").mean().cast(pl.Float64),
        tokens_per_step=(pl.col("num_accepted").mean() + 1).cast(pl.Float64),
    ).collect()


def decode_steps(steps: pl.LazyFrame) -> pl.LazyFrame:
    """One row per engine step ``(dp_rank, step)``: whether every request in it was decoding, its requests, its
    start and end (ns) and the tokens its requests gained (1 + accepted, summed)."""
    return steps.group_by("dp_rank", "step").agg(
        decoding=decoding().all(), requests=pl.len(), t_start_ns=pl.col("t_start_ns").first(),
        t_end_ns=pl.col("t_end_ns").first(), kept=(pl.col("num_accepted") + 1).sum())


def mean_ms(nanoseconds: pl.Expr) -> pl.Expr:
    """The mean of integer nanoseconds, in ms: summed as integers (exact, so the same however the rows are split
    over threads; a float mean may differ in its last bit from run to run). Null over no rows (not NaN: JSON has
    none)."""
    return pl.when(pl.len() > 0).then(nanoseconds.sum() / pl.len() / 1e6).cast(pl.Float64)


def step_times(steps: pl.LazyFrame) -> pl.DataFrame:
    """One row over the steps in which every request was decoding (no prefill chunk): how many, their mean
    duration in ms (recorded bounds: from vLLM's ``execute_model`` to its sync after sampling, drafting included)
    and median requests per step."""
    per_step = decode_steps(steps).filter(pl.col("decoding"))
    return per_step.select(
        decode_steps=pl.len().cast(pl.Int64),
        step_ms=mean_ms(pl.col("t_end_ns") - pl.col("t_start_ns")),
        requests_per_step=pl.col("requests").median().cast(pl.Float64),
    ).collect()


def decode_step_periods(steps: pl.LazyFrame, only: pl.LazyFrame | None = None) -> pl.DataFrame:
    """Per concurrency (``batch``: requests per step): the mean time from one decode step's start to the next's on
    the same data-parallel rank, host scheduling between them included, over consecutive steps of one rank with the
    same requests count in which every request was decoding (the step right after a prefill step left out: see
    below); how many such pairs there were; and the tokens each
    request gained per step in them (1 + accepted drafts). This is what each request waits per step, and what it
    gets for it: the mean, not the median, because throughput pays every step (the slow tail of verification
    steps is real: on an H200 a k = 4 step's mean is 6% above its median).

    ``prefill_ms_per_token``: what a request waits outside decode steps for each token it gets, at that
    concurrency: the steps that held a prefill chunk, and the decode step right after each, took so much beyond a
    decode step of the concurrency each serves (each from its start to the next step's; under async scheduling a
    prefill's GPU work ends inside the next step's period), summed over the trace, per token gained in it, times the
    concurrency (a prefill stalls every request of its step). A prefill step serves the concurrency of the decode
    steps it leads to: its own requests or, where more, those of the rank's next decoding step (requests that end
    together are replaced over steps of fewer requests, and a round starts with its prompts prefilled over steps of
    more and more requests); 0 where no step held a prefill.

    ``only`` (``dp_rank, step``): the decode steps to measure ``period_ms`` and ``tokens_per_step`` over (those of
    one context bucket, say); ``prefill_ms_per_token`` is then null (prefill is paid over every step, not a
    subset's)."""
    following = [pl.col(name).shift(-1).over("dp_rank").alias(f"next_{name}")
                 for name in ("step", "decoding", "requests", "t_start_ns")]
    # on a prefill step (null here), the requests of the rank's next decoding step
    next_decoding_requests = pl.when(pl.col("decoding")).then(pl.col("requests")).backward_fill().over("dp_rank")
    per_step = decode_steps(steps).sort("dp_rank", "step").with_columns(following).with_columns(
        # start to the next step's start where the rank's next step was recorded, else the step's own duration
        period_ns=pl.when(pl.col("next_step") == pl.col("step") + 1).then(pl.col("next_t_start_ns"))
        .otherwise(pl.col("t_end_ns")) - pl.col("t_start_ns"),
        served=pl.when(pl.col("decoding")).then(pl.col("requests"))
        .otherwise(pl.max_horizontal(pl.col("requests"), next_decoding_requests.fill_null(0))),
        # the decode step right after a prefill step: under async scheduling it starts before the prefill's GPU
        # work ends and waits for it (at 8,192-token prompts on an H100, 36 ms against 8.4), so what it takes
        # beyond a decode step is the prefill's
        after_prefill=(pl.col("decoding") & ~pl.col("decoding").shift(1).over("dp_rank")
                       & (pl.col("step").shift(1).over("dp_rank") == pl.col("step") - 1)).fill_null(False)
    ).collect().lazy()  # the steps table read once: the pairs, the prefills and the tokens gained all come from it
    pairs = per_step.filter(pl.col("decoding") & ~pl.col("after_prefill") & pl.col("next_decoding")
                            & (pl.col("next_step") == pl.col("step") + 1)
                            & (pl.col("next_requests") == pl.col("requests")))
    if only is not None:
        pairs = pairs.join(only.select("dp_rank", "step"), on=["dp_rank", "step"], how="semi")
    periods = (pairs.group_by(batch=pl.col("requests").cast(pl.Int32))
               .agg(decode_steps=pl.len().cast(pl.Int64), period_ms=mean_ms(pl.col("period_ns")),
                    tokens_per_step=(pl.col("kept").sum() / pl.col("requests").sum()).cast(pl.Float64))
               .sort("batch").collect())
    if only is not None or periods.is_empty():
        return periods.with_columns(prefill_ms_per_token=pl.lit(None, pl.Float64))
    # each prefill step (and the step after it) beyond a decode step of the concurrency it serves (linear between
    # those measured, held past them), pooled over the trace: which concurrency a prefill lands in differs from k to
    # k (requests that end together at k = 0 end one by one under speculation), the prompts do not
    outside = per_step.filter(~pl.col("decoding") | pl.col("after_prefill")).select("served", "period_ns").collect()
    decode_ms = np.interp(outside["served"].to_numpy(), periods["batch"].to_numpy(), periods["period_ms"].to_numpy())
    excess_ms = max(float((outside["period_ns"].to_numpy() / 1e6 - decode_ms).sum()), 0.0)
    gained = per_step.select(pl.col("kept").sum()).collect().item()
    return periods.with_columns(prefill_ms_per_token=(pl.col("batch") * excess_ms / gained).cast(pl.Float64))


def measured_speedup(per_k: pl.LazyFrame) -> pl.DataFrame:
    """``per_k`` (k, tokens_per_step, step_ms, one row per recorded k) with ``measured_speedup``: tokens per request
    per second at k over the same at k = 0, on the machine that recorded (null without a k = 0 recording)."""
    rate = pl.col("tokens_per_step") / pl.col("step_ms")
    baseline = rate.filter(pl.col("k") == 0).first()
    return per_k.with_columns(measured_speedup=rate / baseline).collect()


ACCEPTANCE_SCHEMA: dict[str, pl.DataType] = {
    "k": pl.Int32(), "tokens_per_step": pl.Float64(), "tokens_read": pl.Float64(), "request_steps": pl.Int64(),
    "acceptance_source": pl.String()}


def drawn_from(recorded: Collection[int], k: int) -> int:
    """The recorded k whose trace a k is drawn from: itself where recorded, else the smallest recorded above it (its
    request-steps proposed at least k drafts where they could), else the largest: what a k's acceptance and tokens
    (``acceptance_per_k``) and unions (``concurrency``) are read from."""
    larger = [at for at in recorded if at >= k]
    return min(larger) if larger else max(recorded)


def acceptance_per_k(recorded: Mapping[int, pl.LazyFrame], ks: Sequence[int], given_rate: float | None = None,
                     scheduled: Collection[int] = ()) -> pl.DataFrame:
    """Per k: tokens a request gains per step, tokens a request-step reads, the decoding request-steps behind them,
    and where they come from. ``recorded``: the steps table of each trace of the sweep, by its k.

    - a recorded k: measured (``acceptance_totals``; equal to 1 + the unconditional rates);
    - a k below a recorded one: estimated from the nearest larger recorded K: its rates at positions 1..k, and
      1 + mean(min(drafts, k)) tokens read;
    - past the largest recorded K: extrapolated (``acceptance_curve``), reading K's tokens plus, per extra
      position, the share of request-steps that proposed all K drafts;
    - drawn from a trace of ``scheduled`` (recorded k whose engine chose how many drafts each request-step verified:
      an adaptive schedule, ``SpecInfo.adaptive``), every fixed k, its own included, is estimated as a run that
      verifies all k drafts the drafter proposes: k + 1 tokens read, the rates of ``every_draft_rates``; past the
      positions those measure, extrapolated;
    - ``given_rate``: each draft accepted with that rate while all before it were; k+1 tokens read;
    - k > 0 resting on a trace whose steps hold no decoding request-step (no steps rows: a recording killed before
      its first steps file): unknown, tokens gained and read null."""
    rows = []
    for k in ks:
        if given_rate is not None:
            rows.append({"k": k, "tokens_per_step": tokens_per_step([given_rate ** i for i in range(1, k + 1)]),
                         "tokens_read": float(k + 1), "request_steps": None,
                         "acceptance_source": Source.GIVEN.value})
            continue
        at = drawn_from(recorded, k)
        steps = recorded[at].filter(decoding())
        by_position = acceptance_by_position(recorded[at], at)
        rates = dict(zip(by_position["draft_pos"].to_list(), by_position["acceptance_rate"].to_list()))
        counts = steps.select(
            request_steps=pl.len(), read=(pl.col("num_drafts").clip(upper_bound=k) + 1).mean(),
            full=(pl.col("num_drafts") >= at).mean()).collect().row(0, named=True)
        read: float | None
        gained: float | None
        if k == 0:  # k = 0 gains and reads one token per step, by definition
            source, read, gained = Source.MEASURED, 1.0, 1.0
        elif at in scheduled:
            drafted = every_draft_rates(by_position)
            curve, past = acceptance_curve(drafted, k) if drafted else ([], True)
            source = Source.EXTRAPOLATED if past or k > at else Source.ESTIMATED
            read, gained = (float(k + 1), tokens_per_step(curve)) if counts["request_steps"] else (None, None)
        elif not counts["request_steps"]:
            source = Source.MEASURED if k == at else Source.ESTIMATED if k < at else Source.EXTRAPOLATED
            read = gained = None
        elif k == at:
            source, read = Source.MEASURED, counts["read"]
            gained = tokens_per_step([rates[i] for i in range(1, k + 1)])
        elif k < at:
            source, read = Source.ESTIMATED, counts["read"]
            gained = tokens_per_step([rates[i] for i in range(1, k + 1)])
        else:
            source, read = Source.EXTRAPOLATED, counts["read"] + (k - at) * (counts["full"] or 0.0)
            gained = tokens_per_step(acceptance_curve(rates, k)[0]) if rates else 1.0
        rows.append({"k": k, "tokens_per_step": gained, "tokens_read": read, "request_steps": counts["request_steps"],
                     "acceptance_source": source.value})
    return pl.DataFrame(rows, schema=ACCEPTANCE_SCHEMA, orient="row")
