"""Issue 56, nothing crashes: every command on any contract-valid trace (docs/trace-format.md) exits 0 with figures, or
1 with one line, never with a traceback. Hypothesis draws the traces, written with pyarrow alone
(``trace_builder``) or by ``moetrace import`` from drawn engine output: missing steps rows, Parquet files of zero
rows, k = 0 alone, one MoE layer, candidates columns, null or shared token ids, routing of one request in two,
data-parallel ranks (``dp<r>/``), an always-on recording's partitions (``date=.../hour=.../``, of DP ranks too),
several k in a sweep folder, recordings that did not close, an engine that chose each request-step's drafts."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from moetrace.cli import main
from moetrace.trace.schema import STEPS_SCHEMA, routing_schema
from trace_builder import Model, scheduled_by_the_engine, verify_tokens, write_empty_part, write_trace

SHIPPED_CALIBRATION = Path(__file__).parents[2] / "moetrace" / "data" / "calibration-h200.json"
HOURS = ("date=2026-12-04/hour=15", "date=2026-12-04/hour=16")
# the embedded default model, which `moetrace import` takes without --model: layer 0 dense, layers 1..3 MoE
DEFAULT_LAYERS, DEFAULT_EXPERTS, DEFAULT_TOP_K = 4, 384, 8
# every example writes and reads a few small traces: about 2 s each on 2 cores
PROPERTY = settings(max_examples=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Rows:
    """One trace directory's rows as drawn: ``prefill`` prompt tokens per request in step 0, then ``steps`` steps
    of ``requests`` requests verifying k drafts each (0..k with ``variable_drafts``; none: plain decode)."""

    k: int
    requests: int
    steps: int
    prefill: int
    accept_prob: float
    variable_drafts: bool
    seed: int
    files: int  # Parquet files each table is split into
    steps_kept: str  # "all"; "none": no steps rows (killed before its first steps file); "first": its first file only
    empty_part: bool  # a Parquet file of zero rows beside the others in routing/ and steps/
    complete: bool  # false: the recording was killed (or is still running)
    token_ids: str = "distinct"  # a prompt per request; "same": one prompt for all; "none": null (--no-token-ids)
    one_request_in: int = 1  # routing rows of the even requests only where 2 (a request-sampled recording)
    adaptive: bool = False  # k > 0: the engine chose each request-step's drafts (DSpark's adaptive verification)


@dataclass(frozen=True)
class Layout:
    """What a TRACE argument holds: one trace, a sweep (a ``k<k>/`` per part), a data-parallel recording (a
    ``dp<r>/`` per part), an always-on recording (a partition per part, each of ``ranks`` DP ranks where > 1), or
    an always-on recording under DP (``dp<r>/`` each holding the partitions, as the plugin writes it)."""

    kind: str
    model: Model
    candidates: int
    ep: int
    parts: tuple[Rows, ...]
    ranks: int = 1


def rows(k: int) -> st.SearchStrategy[Rows]:
    return st.builds(Rows, k=st.just(k), requests=st.integers(1, 3), steps=st.integers(0, 8),
                     prefill=st.integers(0, 3), accept_prob=st.sampled_from([0.6, 0.0, 1.0]),
                     variable_drafts=st.booleans(), seed=st.integers(0, 2 ** 16), files=st.integers(1, 3),
                     steps_kept=st.sampled_from(["all", "none", "first"]), empty_part=st.booleans(),
                     complete=st.booleans(), token_ids=st.sampled_from(["distinct", "same", "none"]),
                     one_request_in=st.sampled_from([1, 2]), adaptive=st.booleans())


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    num_experts = draw(st.sampled_from([8, 4, 16]))
    top_k = draw(st.integers(1, min(3, num_experts)))
    model = Model(num_experts=num_experts, top_k=top_k, layers=draw(st.sampled_from([(1, 2), (1,), (0, 3)])))
    candidates = draw(st.just(0) | st.integers(top_k + 1, num_experts)) if top_k < num_experts else 0
    kind = draw(st.sampled_from(["trace", "sweep", "dp", "partitions", "dp-partitions"]))
    if kind == "sweep":
        ks = sorted(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)))
        parts = tuple(draw(rows(k)) for k in ks)
    else:
        k = draw(st.integers(0, 3))
        parts = tuple(draw(rows(k)) for _ in range(1 if kind == "trace" else draw(st.integers(1, 2))))
    ranks = draw(st.integers(1, 2)) if kind == "partitions" else 2 if kind == "dp-partitions" else 1
    return Layout(kind, model, candidates, draw(st.sampled_from([1, 2, 3])), parts, ranks)


def write_rows(directory: Path, drawn: Rows, layout: Layout, dp_rank: int | None = None) -> None:
    """``drawn`` as a trace in ``directory``, written with pyarrow (``trace_builder``), then cut as drawn."""
    tokens = verify_tokens(np.random.default_rng(drawn.seed), layout.model, drawn.requests, drawn.steps, drawn.k,
                           drawn.accept_prob, layout.candidates, drawn.prefill, drawn.variable_drafts)
    if drawn.token_ids == "same":
        tokens = replace(tokens, token=tokens.position % 256)
    write_trace(directory, tokens, layout.model, drawn.k, files=drawn.files, ep=layout.ep)
    if drawn.adaptive and drawn.k:
        scheduled_by_the_engine(directory)
    for part in (directory / "routing").glob("*.parquet"):
        table = pq.read_table(part)
        if drawn.token_ids == "none":
            table = table.set_column(table.schema.get_field_index("token"), table.schema.field("token"),
                                     pa.nulls(table.num_rows, pa.uint32()))
        if drawn.one_request_in > 1:
            table = table.filter(pc.equal(pc.bit_wise_and(table["request"], 1), 0))
        pq.write_table(table, part)
    steps = sorted((directory / "steps").glob("*.parquet"))
    for lost in steps if drawn.steps_kept == "none" else steps[1:] if drawn.steps_kept == "first" else []:
        lost.unlink()
    if drawn.empty_part:
        write_empty_part(directory / "routing", routing_schema(layout.model.top_k, layout.candidates))
        write_empty_part(directory / "steps", STEPS_SCHEMA)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["complete"] = drawn.complete
    manifest["capture"].update(token_ids=drawn.token_ids != "none", sampled={"one_request_in": drawn.one_request_in})
    if dp_rank is not None:
        manifest["parallel"].update(dp=len(layout.parts) if layout.kind == "dp" else layout.ranks, dp_rank=dp_rank)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def write_layout(root: Path, layout: Layout) -> Path:
    """``layout`` under ``root``; returns the path a user gives the commands."""
    if layout.kind == "trace":
        write_rows(root, layout.parts[0], layout)
    elif layout.kind == "sweep":
        for drawn in layout.parts:
            write_rows(root / f"k{drawn.k}", drawn, layout)
    elif layout.kind == "dp":
        for rank, drawn in enumerate(layout.parts):
            write_rows(root / f"dp{rank}", drawn, layout, rank)
    else:
        for hour, drawn in zip(HOURS, layout.parts):
            for rank in range(layout.ranks):
                one = replace(drawn, seed=drawn.seed + rank)
                if layout.kind == "dp-partitions":
                    write_rows(root / f"dp{rank}" / hour, one, layout, rank)
                elif layout.ranks > 1:
                    write_rows(root / hour / f"dp{rank}", one, layout, rank)
                else:
                    write_rows(root / hour, one, layout)
    return root


def sweep_from_k0(*ks: int) -> Layout:
    """A sweep of k = 0 and ``ks``, each 4 requests over 8 steps: enough decode steps for --profile measured, and
    windows (32) for a recommendation."""
    drawn = Rows(k=0, requests=4, steps=8, prefill=2, accept_prob=0.6, variable_drafts=False, seed=1, files=2,
                 steps_kept="all", empty_part=False, complete=True)
    return Layout("sweep", Model(), 0, 1, tuple(replace(drawn, k=k, seed=k) for k in (0, *ks)))


def k3_shaped_sweep() -> Layout:
    """Kimi-K3's routing shape (896 experts, top-16, expert ids past uint8 and past 384) in a sweep of k = 0, 2
    and 4 whose engine chose how many drafts each request-step verified (0..k, as DSpark's confidence schedule
    verifies them)."""
    drawn = Rows(k=0, requests=4, steps=8, prefill=2, accept_prob=0.6, variable_drafts=True, seed=1, files=2,
                 steps_kept="all", empty_part=False, complete=True, adaptive=True)
    return Layout("sweep", Model(num_experts=896, top_k=16, name="kimi-k3-shaped"), 0, 1,
                  tuple(replace(drawn, k=k, seed=k) for k in (0, 2, 4)))


def one_rejected_step() -> Layout:
    """One request's one step at k = 2 whose drafts were both rejected: no window of 2 accepted tokens, so nothing
    predicts a step at k = 1."""
    drawn = Rows(k=2, requests=1, steps=1, prefill=0, accept_prob=0.6, variable_drafts=False, seed=0, files=1,
                 steps_kept="all", empty_part=False, complete=True)
    return Layout("trace", Model(num_experts=8, top_k=1), 0, 1, (drawn,))


def no_steps_rows(k: int = 2, **changes: Any) -> Layout:
    """One trace at k whose recording was killed before its first steps file: routing rows, no steps rows."""
    drawn = Rows(k=k, requests=2, steps=5, prefill=2, accept_prob=0.6, variable_drafts=False, seed=5, files=2,
                 steps_kept="none", empty_part=False, complete=False)
    return Layout("trace", Model(), 0, 1, (replace(drawn, **changes),))


def assert_exits_0_with_figures_or_1_in_one_line(result: Result, args: list[str]) -> None:
    command = "moetrace " + " ".join(args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{command} raised {result.exception!r}:\n{result.output[-3000:]}")
    assert "Traceback" not in result.output, f"{command}:\n{result.output[-3000:]}"
    assert result.exit_code in (0, 1), f"{command} exited {result.exit_code}:\n{result.output[-3000:]}"
    if result.exit_code == 1:
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{command}:\n{result.output[-3000:]}"
    else:
        assert result.stdout.strip(), f"{command} exited 0 and printed nothing"


def moetrace(*args: str | Path) -> Result:
    """``moetrace ARGS`` in this process, checked to exit 0 with output or 1 with one line."""
    words = [str(arg) for arg in args]
    result = CliRunner().invoke(main, words)
    assert_exits_0_with_figures_or_1_in_one_line(result, words)
    if currently_in_test_context():  # what the examples reached (pytest --hypothesis-show-statistics)
        options = [word for word in words[1:] if word.startswith("--")]
        event(" ".join([words[0], *options, f"exit {result.exit_code}"]))
    return result


def strict_json(text: str) -> Any:
    """JSON as other tools read it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


@dataclass(frozen=True)
class Flags:
    """The drawn options the commands run with."""

    report_k: int
    budget_k: int
    ep: int
    calibration: str  # "shipped": the shipped H200 one, priced at its TP=8; "built": ``built_calibration``


flags = st.builds(Flags, report_k=st.integers(0, 4), budget_k=st.integers(0, 4), ep=st.sampled_from([2, 1, 4]),
                  calibration=st.sampled_from(["built", "shipped"]))


@pytest.fixture(scope="module")
def built_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped calibration with its TP=8 expert curves taken as those of TP=1 and of EP=2 and 3 too: prices a
    built trace at its own parallelism."""
    document = json.loads(SHIPPED_CALIBRATION.read_text())
    for key in ("experts", "int4_estimate"):
        tp8 = [curve for curve in document[key] if curve["config"] == "tp8"]
        document[key] = [{**curve, "config": config, "tp": tp, "ep": ep}
                         for curve in tp8 for config, tp, ep in (("tp1", 1, 1), ("ep2", 1, 2), ("ep3", 1, 3))]
    path = tmp_path_factory.mktemp("calibration") / "calibration-built.json"
    path.write_text(json.dumps(document))
    return path


def run_every_command(trace: Path, out: Path, drawn: Flags, built_calibration: Path) -> None:
    """info, report (terminal, JSON, calibrated, --profile measured), budget, export (each form) and place on
    ``trace``, writing into ``out``; each checked by ``moetrace``."""
    calibration = (("--calibration", str(built_calibration)) if drawn.calibration == "built" else
                   ("--calibration", str(SHIPPED_CALIBRATION), "--tp", "8", "--ep", "1"))
    dashboard = ("-o", out / "report.html")
    moetrace("info", trace)
    moetrace("info", trace, "--json")
    moetrace("report", trace, "--k", str(drawn.report_k), *dashboard)
    as_json = moetrace("report", trace, "--k", str(drawn.report_k), "--json", *dashboard)
    moetrace("report", trace, *calibration, *dashboard)
    moetrace("report", trace, *calibration, "--profile", "measured", *dashboard)
    moetrace("budget", trace, "--k", str(drawn.budget_k), "-o", out / "budgets.json")
    moetrace("export", trace, "--sglang-expert-location", "-o", out / "sglang.json")
    moetrace("export", trace, "--sglang-expert-location", "--ep", str(drawn.ep), "-o", out / "sglang-ep.json")
    moetrace("export", trace, "--eplb", "--ep", str(drawn.ep), "-o", out / "eplb.json")
    moetrace("place", trace, "--ep", str(drawn.ep), "-o", out / "placement.json")
    if as_json.exit_code == 0:
        decision_json = out / "decision.json"
        decision_json.write_text(json.dumps(strict_json(as_json.stdout)))
        moetrace("export", decision_json, "--vllm-spec-schedule", "-o", out / "schedule.json")


@PROPERTY
@given(layout=layouts(), drawn=flags)
@example(layout=no_steps_rows(), drawn=Flags(3, 3, 2, "built"))  # report crashed in tokens_per_step
@example(layout=no_steps_rows(), drawn=Flags(3, 3, 2, "shipped"))  # so did a calibrated one
@example(layout=sweep_from_k0(2), drawn=Flags(2, 2, 2, "built"))  # every command with figures
@example(layout=one_rejected_step(), drawn=Flags(0, 2, 2, "built"))  # the policy replay looked up k=1's step
@example(layout=k3_shaped_sweep(), drawn=Flags(4, 2, 8, "built"))  # Kimi-K3's 896 experts, top-16, variable k
def test_every_command_on_a_built_trace_exits_0_with_figures_or_1_in_one_line(
        layout: Layout, drawn: Flags, tmp_path_factory: pytest.TempPathFactory, built_calibration: Path) -> None:
    root = tmp_path_factory.mktemp("built")
    run_every_command(write_layout(root / "trace", layout), root, drawn, built_calibration)


# Imported sources: what `moetrace import` writes from an engine's own output, drawn for the default model.


@dataclass(frozen=True)
class EngineOutput:
    """Requests as an engine returned or dumped them: ``form`` is "vllm" (completion responses with base64 .npy),
    "sglang" (/generate responses with raw int32) or "sglang-dump" (SGLang's per_token recorder: a pass prefilling
    every request, then ``decode_passes`` passes of one token each); ``lengths``: (prompt, output) tokens per
    request; ``padded``: the first request's last row is -1 padding in every layer (vLLM's)."""

    form: str
    lengths: tuple[tuple[int, int], ...]
    prompt_start: int
    padded: bool
    decode_passes: int
    seed: int


engine_outputs = st.builds(
    EngineOutput, form=st.sampled_from(["vllm", "sglang", "sglang-dump"]),
    lengths=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1, max_size=3).map(tuple),
    prompt_start=st.integers(0, 1), padded=st.booleans(), decode_passes=st.integers(0, 3), seed=st.integers(0, 99))


def routed_rows(rng: np.random.Generator, tokens: int, dense: int) -> npt.NDArray[np.int64]:
    """[tokens, layers, top-k] of the default model: layer 0 ``dense`` in every slot, 8 distinct experts in each
    MoE layer."""
    out = np.full((tokens, DEFAULT_LAYERS, DEFAULT_TOP_K), dense, dtype=np.int64)
    for token in range(tokens):
        for layer in range(1, DEFAULT_LAYERS):
            out[token, layer] = rng.choice(DEFAULT_EXPERTS, DEFAULT_TOP_K, replace=False)
    return out


def write_engine_output(directory: Path, drawn: EngineOutput) -> Path:
    rng = np.random.default_rng(drawn.seed)
    if drawn.form == "sglang-dump":
        return write_sglang_dump(directory, drawn, rng)
    lines: list[dict[str, Any]] = []
    for number, (prompt, output) in enumerate(drawn.lengths):
        rows = routed_rows(rng, max(prompt + output - 1 - drawn.prompt_start, 0), dense=0)
        if drawn.padded and number == 0 and len(rows):
            rows[-1] = -1
        if drawn.form == "vllm":
            buffer = io.BytesIO()
            np.save(buffer, rows.astype(np.int32), allow_pickle=False)
            lines.append({"id": f"cmpl-{number}", "choices": [{
                "index": 0, "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
                "prompt_token_ids": list(range(prompt)), "token_ids": list(range(100, 100 + output))}]})
        else:
            lines.append({"text": "", "meta_info": {
                "id": f"s{number}", "prompt_tokens": prompt, "completion_tokens": output,
                "routed_experts": base64.b64encode(rows.astype(np.int32).tobytes()).decode()}})
    path = directory / "responses.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_sglang_dump(directory: Path, drawn: EngineOutput, rng: np.random.Generator) -> Path:
    """A per_token dump as SGLang 0.5.23 writes it (keys as in tests/unit/test_import.py): physical ids through the
    trivial map, layer 0 (dense) -1, the padded request's last decode token -1 in every layer."""
    import torch

    extend, decode = 1, 2  # SGLang's ForwardMode
    prompts = [prompt for prompt, _ in drawn.lengths]
    plan: list[tuple[int, list[int], list[int] | None]] = [
        (extend, [p for prompt in prompts for p in range(prompt)], prompts)]
    plan += [(decode, [prompt + step for prompt in prompts], None) for step in range(drawn.decode_passes)]
    records = []
    for number, (mode, positions, groups) in enumerate(plan):
        ids = routed_rows(rng, len(positions), dense=-1)
        if drawn.padded and mode == decode and number == len(plan) - 1:
            ids[0] = -1
        records.append(dict(forward_pass_id=number + 1, rank=0, gatherer_key="primary",
                            input_ids=[int(i) for i in rng.integers(0, 320, len(positions))], positions=positions,
                            extend_seq_lens=groups, forward_mode=mode,
                            topk_ids_of_layer=torch.from_numpy(ids.transpose(1, 0, 2).copy()).to(torch.int32),
                            misc_objects=[], global_physical_count=torch.zeros((DEFAULT_LAYERS, DEFAULT_EXPERTS),
                                                                               dtype=torch.int32)))
    mapping = torch.arange(DEFAULT_EXPERTS).repeat(DEFAULT_LAYERS, 1)
    path = directory / "expert_distribution_recorder_1730000000.0_0.pt"
    torch.save(dict(records=records, last_physical_to_logical_map=mapping), str(path))
    return path


@settings(PROPERTY, max_examples=12)
@given(drawn=engine_outputs, flags_drawn=flags)
# a request of one output token: its rows are all prompt, and the import divided by its zero output tokens
@example(drawn=EngineOutput("vllm", ((1, 1),), 0, False, 0, 0), flags_drawn=Flags(3, 3, 2, "built"))
def test_every_command_on_an_imported_trace_exits_0_with_figures_or_1_in_one_line(
        drawn: EngineOutput, flags_drawn: Flags, tmp_path_factory: pytest.TempPathFactory,
        built_calibration: Path) -> None:
    root = tmp_path_factory.mktemp("imported")
    source = write_engine_output(root, drawn)
    start = ("--prompt-start", str(drawn.prompt_start)) if drawn.form != "sglang-dump" else ()
    imported = moetrace("import", source, *start, "-o", root / "trace")
    if imported.exit_code == 0:
        run_every_command(root / "trace", root, flags_drawn, built_calibration)


# The known crash (a trace with routing rows and no steps rows), by what the report says of it.


def test_a_trace_without_steps_rows_is_reported_from_its_routing_and_says_its_acceptance_is_unknown(
        tmp_path: Path) -> None:
    root = write_layout(tmp_path / "no-steps", no_steps_rows())
    result = moetrace("report", root, "--json", "-o", tmp_path / "r.html")
    assert result.exit_code == 0
    run = strict_json(result.stdout)["runs"][0]
    # the routing part: picks per (layer, expert) in decode and verification, counted here from the Parquet rows
    picks = (pl.read_parquet(root / "routing").filter(pl.col("phase") != "prefill").explode("experts")
             .group_by("layer", "experts").len())
    expected = [[0] * 16 for _ in (1, 2)]
    for layer, expert, count in picks.iter_rows():
        expected[layer - 1][expert] = count
    assert run["layers"] == [1, 2] and run["expert_load"] == expected
    [acceptance] = run["acceptance_per_k"]
    assert (acceptance["k"], acceptance["windows"], acceptance["tokens_per_step"], acceptance["step_ms"]) == (
        2, 0, None, None)
    decision = strict_json(result.stdout)["decision"][0]["per_batch"]
    assert all(row["k"] is None and f"{root}: no steps rows: its acceptance is unknown" in row["status"]
               for row in decision)
    assert f"{root}: no steps rows: its acceptance is unknown" in result.stderr
    terminal = moetrace("report", root, "-o", tmp_path / "r.html")
    assert terminal.exit_code == 0
    assert "Unique experts per layer vs k" in terminal.stdout and "1:– 2:–" in terminal.stdout


def test_a_calibrated_report_of_a_trace_without_steps_rows_refuses_in_one_line_unless_acceptance_is_given(
        tmp_path: Path, built_calibration: Path) -> None:
    root = write_layout(tmp_path / "no-steps", no_steps_rows())
    asked = ("report", root, "--calibration", built_calibration, "-o", tmp_path / "r.html")
    refused = moetrace(*asked)
    assert refused.exit_code == 1
    assert f"{root}: no steps rows: its acceptance is unknown; give --acceptance RATE" in refused.output
    given_rate = moetrace(*asked, "--acceptance", "0.5", "--json")
    assert given_rate.exit_code == 0
    per_k = {row["k"]: row for row in strict_json(given_rate.stdout)["runs"][0]["prediction"]["per_k"]}
    assert per_k[3]["tokens_per_step"] == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert per_k[3]["acceptance_source"] == "given"


def test_a_concurrency_with_a_k_nothing_predicts_is_not_replayed_and_the_verdict_says_why(tmp_path: Path) -> None:
    root = write_layout(tmp_path / "one-step", one_rejected_step())
    result = moetrace("report", root, "--json", "-o", tmp_path / "r.html")
    assert result.exit_code == 0
    [decision] = strict_json(result.stdout)["decision"]
    rejected = pl.read_parquet(root / "routing").filter(pl.col("draft_pos") > 0)["accepted"]
    assert rejected.len() and not rejected.any()  # so no window of 2 accepted tokens: nothing prices k = 1
    assert decision["policies"]["rows"] == []
    assert decision["policies"]["verdict"] == [f"B={batch}: not replayed: no predicted step at k=1"
                                               for batch in (1, 8, 32, 128)]


def test_a_report_over_partitions_on_a_local_ray_cluster_exits_0_or_1_in_one_line(tmp_path: Path) -> None:
    """--ray starts a local cluster (seconds): one example, not a property."""
    pytest.importorskip("ray")
    drawn = replace(no_steps_rows(k=2).parts[0], steps_kept="all", complete=True)
    layout = Layout("partitions", Model(), 0, 1, (drawn, replace(drawn, seed=6, steps_kept="none")))
    root = write_layout(tmp_path / "always-on", layout)
    result = moetrace("report", root, "--ray", "local", "--json", "-o", tmp_path / "r.html")
    assert result.exit_code == 0

