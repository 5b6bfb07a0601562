"""`--profile` parsing (analysis/profile.py): explicit units, one-line errors, and how a profile is anchored."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner
from moetrace.analysis.cost import predict
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.profile import PROFILE_PRESETS, Profile, parse_profile
from moetrace.analysis.shape import ModelShape
from trace_builder import small_k2_trace

from moetrace.cli import main

BASE = {"step": "10ms", "allreduce": "10%", "moe": "10%", "attention": "10%", "other": "10%"}
SHARE_RULE = "a share is a fraction in [0, 1] or a percentage like 1.5%"
GROWTH_RULE = "growth per extra token is a fraction in [0, 1] or a percentage like 3%"
STEP_RULE = "step is a positive time like 12.1ms, 12100us or 0.0121s (a bare number is ms)"
TOKENS_RULE = "tokens is a positive whole number with no unit, like 1"


def text(**changes: str) -> str:
    """BASE as ``KEY=VALUE,...`` with ``changes`` applied (a key's value replaced, or added)."""
    return ",".join(f"{key}={value}" for key, value in {**BASE, **changes}.items())


def error(profile_text: str) -> str:
    with pytest.raises(ValueError) as caught:
        parse_profile(profile_text)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("profile"), message
    return message


def test_the_three_forms_give_the_design_profile() -> None:
    inline = parse_profile("step=12.1ms,allreduce=51.5%,moe=0.111,attention=15.3%,other=13.4%")
    as_json = parse_profile('{"step_ms": 12.1, "allreduce": 0.515, "moe": "11.1%", "attention": 0.153, '
                            '"other": 0.134}')
    for profile in (inline, as_json, parse_profile("kimi-k2-tp8"), PROFILE_PRESETS["kimi-k2-tp8"]):
        assert (profile.step_ms, profile.allreduce, profile.moe, profile.attention, profile.other_gemm) == \
            pytest.approx((12.1, 0.515, 0.111, 0.153, 0.134), rel=1e-12)
        assert profile.rest == pytest.approx(1 - 0.515 - 0.111 - 0.153 - 0.134) and profile.rest == pytest.approx(0.087)
        assert profile.tokens == 1
    assert (inline.attention_growth_per_token, inline.other_growth_per_token) == (0.03, 0.01)  # the defaults


def test_a_share_is_a_fraction_or_a_percentage_never_a_bare_percentage() -> None:
    assert parse_profile(text(other="0.5")).other_gemm == 0.5
    assert parse_profile(text(other="50%")).other_gemm == 0.5
    assert parse_profile(text(other="0")).other_gemm == 0.0
    assert parse_profile(text(allreduce="60%")).allreduce == 0.6
    assert error(text(other="1.5")) == f"profile other=1.5: {SHARE_RULE}"
    assert error(text(moe="150%")) == f"profile moe=150%: {SHARE_RULE}"
    assert error(text(attention="-0.1")) == f"profile attention=-0.1: {SHARE_RULE}"
    assert error(text(moe="10ms")) == f"profile moe=10ms: {SHARE_RULE}"
    assert error(text(moe="ten")) == f"profile moe=ten: {SHARE_RULE}"
    assert error(text(moe="")) == f"profile moe=: {SHARE_RULE}"


def test_growth_per_token_is_a_fraction_or_a_percentage_in_0_1() -> None:
    assert parse_profile(text(attention_growth="3%")).attention_growth_per_token == 0.03
    assert parse_profile(text(attention_growth="0.03")).attention_growth_per_token == 0.03
    # 1 is +100% per extra token: at the edge of [0, 1], so accepted, and never read as 1%
    assert parse_profile(text(attention_growth="1")).attention_growth_per_token == 1.0
    assert parse_profile(text(other_growth="0%")).other_growth_per_token == 0.0
    assert error(text(attention_growth="3")) == f"profile attention_growth=3: {GROWTH_RULE}"
    assert error(text(other_growth="101%")) == f"profile other_growth=101%: {GROWTH_RULE}"


def test_step_takes_ms_us_or_s_and_a_bare_number_is_ms() -> None:
    assert parse_profile(text(step="12100us")).step_ms == 12.1
    assert parse_profile(text(step="12100µs")).step_ms == 12.1  # micro sign
    assert parse_profile(text(step="12100μs")).step_ms == 12.1  # Greek mu
    assert parse_profile(text(step="0.0121s")).step_ms == pytest.approx(12.1, rel=1e-12)
    assert parse_profile(text(step="12.1")).step_ms == 12.1
    assert parse_profile(text(step="12.1 ms")).step_ms == 12.1
    assert error(text(step="12.1%")) == f"profile step=12.1%: {STEP_RULE}"
    assert error(text(step="0")) == f"profile step=0: {STEP_RULE}"
    assert error(text(step="12.1kg")) == f"profile step=12.1kg: {STEP_RULE}"


def test_tokens_is_a_positive_whole_number() -> None:
    assert parse_profile(text(tokens="1")).tokens == 1 and parse_profile(text(tokens="4")).tokens == 4
    for bad in ("0", "1.5", "1tok", "-1"):
        assert error(text(tokens=bad)) == f"profile tokens={bad}: {TOKENS_RULE}"


def test_json_numbers_follow_the_bare_number_rules_and_strings_the_text_rules() -> None:
    base = {"step": 10, "allreduce": 0.1, "moe": 0.1, "attention": 0.1, "other": 0.1}
    as_json = parse_profile(json.dumps(base | {"moe": "50%", "step": "12100us", "tokens": 1}))
    assert (as_json.moe, as_json.step_ms, as_json.tokens) == (0.5, 12.1, 1)
    assert parse_profile(json.dumps(base)).step_ms == 10.0  # a bare step is ms
    assert error(json.dumps(base | {"moe": 3})) == f"profile moe=3: {SHARE_RULE}"  # not 300%, not 3%
    assert error(json.dumps(base | {"attention_growth": 3})) == f"profile attention_growth=3: {GROWTH_RULE}"
    assert error(json.dumps(base | {"moe": True})) == f"profile moe=true: {SHARE_RULE}"
    assert error(json.dumps(base | {"moe": None})) == f"profile moe=null: {SHARE_RULE}"
    assert error('{"step": 10, "allreduce": 0.1, "moe": NaN, "attention": 0.1, "other": 0.1}') == \
        f"profile moe=NaN: {SHARE_RULE}"
    assert error(json.dumps(base | {"step": 1e400})) == f"profile step=Infinity: {STEP_RULE}"
    assert error(json.dumps(base | {"tokens": 1.0})) == f"profile tokens=1.0: {TOKENS_RULE}"
    assert error('{"step": 10, "step": 12}') == "profile: key 'step' given twice"
    assert error("{1") == "profile: bad JSON (Expecting property name enclosed in double quotes)"


def test_shares_over_100_percent_unknown_missing_and_repeated_keys() -> None:
    assert error(text(allreduce="90%", moe="20%")) == \
        "profile: shares allreduce+moe+attention+other sum to 130%, more than 100% of the step"
    exactly = parse_profile("step=1,allreduce=51.5%,moe=11.1%,attention=15.3%,other=22.1%")  # 100% after rounding
    assert exactly.rest == pytest.approx(0.0, abs=1e-12)
    unknown = error(text(gpu="8"))
    assert unknown.startswith("profile: unknown key 'gpu' (known: step, allreduce, moe")
    assert error("step=12ms,moe=10%") == \
        "profile: missing allreduce, attention, other_gemm (give step, allreduce, moe, attention and other)"
    assert error("step=12ms,step_ms=12") == "profile: 'step' and 'step_ms' both give step_ms"
    assert error("nonsense") == "profile: 'nonsense' is not KEY=VALUE (presets: kimi-k2-tp8)"


SHAPE = ModelShape(num_experts=64, top_k=8, num_layers=2, moe_layers=2, hidden_size=1000, expert_width=32,
                   shared_experts=1, expert_weight_bits=16, quant_group_size=None)
# one request's window of k+1 tokens: unique routed experts per layer; plus 1 shared expert: 9, 15, 20, 24 read
PER_K = pl.DataFrame({"k": [0, 1, 2, 3], "tokens": [1.0, 2.0, 3.0, 4.0], "unique_experts": [8.0, 14.0, 19.0, 23.0],
                      "busiest_rank_experts": [8.0, 14.0, 19.0, 23.0], "tokens_per_step": [1.0, 1.7, 2.2, 2.5]})
# A 10 ms step measured at 4 tokens (k=3: 24 experts read per layer): MoE 50%, attention 20% (+3% per token),
# other GEMMs 10% (+1% per token), rest 20%; one GPU, so no all-reduce.
FOUR_TOKENS = Profile(step_ms=10.0, allreduce=0.0, moe=0.5, attention=0.2, other_gemm=0.1, tokens=4,
                      attention_growth_per_token=0.03, other_growth_per_token=0.01)
# The same deployment at 1 token, by hand under the model's rules (MoE ∝ experts read; attention and other
# linear in tokens; rest flat): MoE 5 × 9/24 = 1.875 ms; attention 2 × (1 − 3 × 0.03) = 1.82 ms, growing
# 0.06 ms per token = 0.03/0.91 of 1.82; other 1 × (1 − 3 × 0.01) = 0.97 ms, growing 0.01/0.97 of it; rest 2 ms.
ONE_STEP = 1.875 + 1.82 + 0.97 + 2.0
ONE_TOKEN = Profile(step_ms=ONE_STEP, allreduce=0.0, moe=1.875 / ONE_STEP, attention=1.82 / ONE_STEP,
                    other_gemm=0.97 / ONE_STEP, tokens=1, attention_growth_per_token=0.03 / 0.91,
                    other_growth_per_token=0.01 / 0.97)


def test_the_one_token_equivalent_predicts_the_measured_four_token_step() -> None:
    table, _ = predict(PER_K, deployment_for(SHAPE, 1, 1), ONE_TOKEN, None)
    steps = table["step_ms"].to_list()
    assert steps[0] == pytest.approx(6.665, rel=1e-12)
    assert steps[3] == pytest.approx(10.0, rel=1e-9)  # the 4-token step the profile was measured at
    # k=2, 3 tokens: MoE 5 × 20/24, attention 2 × (1 − 0.03), other 1 × (1 − 0.01), rest 2
    assert steps[2] == pytest.approx(5 * 20 / 24 + 1.94 + 0.99 + 2.0, rel=1e-9)


def test_a_profile_at_four_tokens_predicts_as_its_one_token_equivalent() -> None:
    four, _ = predict(PER_K, deployment_for(SHAPE, 1, 1), FOUR_TOKENS, None)
    one, _ = predict(PER_K, deployment_for(SHAPE, 1, 1), ONE_TOKEN, None)
    assert four["step_ms"][2] == pytest.approx(one["step_ms"][2], rel=1e-9)
    assert four["step_ms"][3] == pytest.approx(10.0, rel=1e-9)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return small_k2_trace(tmp_path / "t-k2")


def test_report_refuses_a_bare_share_above_one_in_one_line(trace: Path, tmp_path: Path) -> None:
    as_file = tmp_path / "profile.json"
    as_file.write_text('{"step": 10, "allreduce": 0.1, "moe": 3, "attention": 0.1, "other": 0.1}')
    for profile_text, message in (
            ("step=10,allreduce=1.5,moe=0.1,attention=0.1,other=0.1",
             f"error: --profile: profile allreduce=1.5: {SHARE_RULE}"),
            (str(as_file), f"error: --profile: profile moe=3: {SHARE_RULE}")):
        result = CliRunner().invoke(main, ["report", str(trace), "--force", "--profile", profile_text],
                                    catch_exceptions=False)
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        assert [line for line in result.output.splitlines() if line.strip()] == [message]


def test_report_anchors_a_profile_at_its_own_window_of_tokens(trace: Path) -> None:
    # measured at 3 tokens (one request's window at k=2): the prediction at k=2, batch 1, is the profile's own 10 ms
    profile = "step=10ms,allreduce=0,moe=50%,attention=20%,other=10%,tokens=3"
    result = CliRunner().invoke(main, ["report", str(trace), "--force", "--json", "--profile", profile],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    per_k = json.loads(result.stdout)["runs"][0]["prediction"]["per_k"]
    assert next(row["step_ms"] for row in per_k if row["k"] == 2) == pytest.approx(10.0, rel=1e-9)
    too_long = CliRunner().invoke(main, ["report", str(trace), "--force", "--profile",
                                         profile.replace("tokens=3", "tokens=12")], catch_exceptions=False)
    assert too_long.exit_code == 1 and "Traceback" not in too_long.output
    assert too_long.output.strip() == ("error: --profile tokens=12: its step is one request's window of 12 tokens, "
                                       "k=11: give --max-k 11 or more")
