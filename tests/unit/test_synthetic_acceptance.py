"""Acceptance set by vLLM's synthetic rejection sampling: what ``record`` asks vLLM for at each k, and how the
manifest says the trace's acceptance is no drafter's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from moetrace.hooks.manifest import spec_acceptance
from moetrace.recording.record import (
    ACCEPTANCE_PROFILES,
    RecordRequest,
    engine_settings,
    parse_synthetic_acceptance,
    resolve_model,
)
from moetrace.trace.manifest import Manifest


def test_each_k_of_a_sweep_asks_vllm_for_the_profiles_first_k_rates(tmp_path: Path) -> None:
    rates = (0.8, 0.5, 0.3)
    request = RecordRequest(model=None, ks=[0, 1, 3], synthetic_acceptance=rates, out=tmp_path)
    asked = {k: engine_settings(request, resolve_model(None), k, tmp_path / f"k{k}", ["a b"], tmp_path / "p")
             ["spec_args"] for k in (0, 1, 3)}
    assert "rejection_sample_method" not in asked[0]  # k = 0 verifies nothing
    assert asked[1] == {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.8]}
    assert asked[3]["synthetic_acceptance_rates"] == [0.8, 0.5, 0.3]


def test_a_profile_name_gives_the_committed_rates_and_every_profile_says_where_they_come_from() -> None:
    committed = json.loads(ACCEPTANCE_PROFILES.read_text())["profiles"]
    assert parse_synthetic_acceptance("kimi-k2-eagle3-chat") == (0.799, 0.517, 0.306, 0.182)
    for name, profile in committed.items():
        rates = parse_synthetic_acceptance(name)
        assert rates is not None and len(rates) >= 4, name  # every k of the 0..4 grid
        assert profile["source"] and profile["drafter"] in ("ngram", "eagle3", "mtp"), name


def test_the_manifest_says_who_kept_the_drafts_as_vllm_was_configured() -> None:
    synthetic = SimpleNamespace(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.8, 0.5])
    assert spec_acceptance(synthetic) == {"set_by": "synthetic", "rates": [0.8, 0.5]}
    assert spec_acceptance(SimpleNamespace(rejection_sample_method="standard")) == {"set_by": "drafter"}
    assert spec_acceptance(SimpleNamespace()) == {"set_by": "drafter"}  # a release before synthetic sampling
    assert spec_acceptance(None) is None


def test_a_trace_read_back_carries_its_set_rates_and_an_older_one_its_drafters() -> None:
    document = {"schema": "moetrace/1", "complete": True,
                "model": {"num_experts": 8, "top_k": 2, "moe_layers": [1], "hidden_size": 16},
                "spec": {"method": "ngram", "k": 2, "acceptance": {"set_by": "synthetic", "rates": [0.8, 0.5]}},
                "parallel": {"tp": 1, "ep": 1}}
    manifest = Manifest.from_document(document)
    assert manifest.spec.synthetic_rates == (0.8, 0.5) and manifest.acceptance_set_by == "synthetic"
    older = Manifest.from_document({**document, "spec": {"method": "ngram", "k": 2}})
    assert older.spec.synthetic_rates is None and older.acceptance_set_by == "drafter"


def test_a_report_on_a_synthetic_sweep_says_whose_acceptance_it_is_beside_its_figures(tmp_path: Path) -> None:
    """The k = 3 trace's manifest says vLLM kept drafts at set rates: the JSON and the terminal name it synthetic
    with those rates; the k = 0 trace verified nothing and says nothing."""
    from cli_results import invoke
    from trace_builder import well_sampled_sweep

    from moetrace.trace.manifest import amend_manifest

    sweep = well_sampled_sweep(tmp_path / "sweep", ks=(0, 3))
    manifest = json.loads((sweep / "k3" / "manifest.json").read_text())
    amend_manifest(sweep / "k3", spec={**manifest["spec"],
                                       "acceptance": {"set_by": "synthetic", "rates": [0.8, 0.52, 0.31]}})
    run = json.loads(invoke("report", sweep, "--json", "-o", tmp_path / "r.html").stdout)["runs"][0]
    assert run["acceptance_set_by"] == [{"k": 3, "set_by": "synthetic", "rates": [0.8, 0.52, 0.31]}]
    assert any(note.startswith("synthetic acceptance: at k = 3 vLLM kept drafts at set rates (0.80 / 0.52 / 0.31")
               for note in run["notes"])
    shown = invoke("report", sweep, "-o", tmp_path / "t.html").output
    assert "synthetic acceptance" in shown and "§ acceptance set by vLLM's synthetic rejection sampling" in shown
    tokens_per_step = {row["k"]: row["tokens_per_step"] for row in run["acceptance_per_k"]}
    assert f"{tokens_per_step[3]:.2f}§" in shown  # beside the acceptance figure itself
    assert f"{tokens_per_step[0]:.2f}§" not in shown


def test_the_installed_vllm_has_the_speculative_config_fields_the_manifest_reads() -> None:
    """``spec_acceptance`` reads vLLM's own ``SpeculativeConfig`` after vLLM resolved it: a mean acceptance length
    becomes rates there (1 + 1.0 + 0.5 = 2.5 tokens at 3 drafts), so the manifest holds rates either way."""
    from vllm.config.speculative import SpeculativeConfig

    assert {"rejection_sample_method", "synthetic_acceptance_rates"} <= set(SpeculativeConfig.__dataclass_fields__)
    resolved = SpeculativeConfig._resolve_synthetic_acceptance_rates(3, None, 2.5)
    assert spec_acceptance(SimpleNamespace(rejection_sample_method="synthetic",
                                           synthetic_acceptance_rates=resolved)) == {
        "set_by": "synthetic", "rates": [1.0, 0.5, 0.0]}
