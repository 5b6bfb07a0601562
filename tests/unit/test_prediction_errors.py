"""tools/prediction_errors.py: the record marks which held-out cells were blind, and prices each recommendation
against the measured best k (that it holds every results file's cells: its ``--check``, run by scripts/test.sh)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def prediction_errors() -> ModuleType:
    return load_script("tools/prediction_errors.py")


def committed_record() -> dict[str, Any]:
    document: dict[str, Any] = json.loads((ROOT / "moetrace" / "data" / "prediction-errors.json").read_text())
    return document


def test_a_file_named_repredicted_is_never_blind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cells = committed_record()["cells"]
    assert any("repredicted" in cell["results"] for cell in cells)
    assert all(cell["prediction"] == "re-predicted" for cell in cells if "repredicted" in cell["results"])
    module = prediction_errors()
    row = {"model": "m", "drafter": "ngram", "concurrency": 8, "k": 2, "held_out_concurrency": True,
           "predicted_speedup": 1.1, "measured_speedup": 1.0, "measured_ci95": [0.9, 1.1], "error": 0.1,
           "command": "measure --prompt-tokens 512"}
    for name in ("speedup-validation-x-repredicted.json", "speedup-validation-x.json"):
        (tmp_path / name).write_text(json.dumps({"rows": [row]}))
    # even where the evidence table says blind, the name wins; a file missing from the table is not blind either
    monkeypatch.setitem(module.PROVENANCE, "speedup-validation-x-repredicted.json",
                        module.Provenance("blind", "abc1234", "planned and committed first"))
    found = {cell["results"]: cell for cell in module.held_out_cells(tmp_path)}
    assert found["speedup-validation-x-repredicted.json"]["prediction"] == "re-predicted"
    assert found["speedup-validation-x-repredicted.json"]["why"].startswith("named re-predicted")
    assert found["speedup-validation-x.json"]["prediction"] == "re-predicted"
    assert found["speedup-validation-x.json"]["commit"] is None
    assert {cell["context"] for cell in found.values()} == {512}
    assert {cell["acceptance"] for cell in found.values()} == {"drafter"}


def test_regret_on_hand_made_results_equals_the_hand_computed_values(tmp_path: Path) -> None:
    def row(concurrency: int, k: int, speedup: float, low: float, high: float) -> dict[str, Any]:
        return {"model": "m", "drafter": "ngram", "concurrency": concurrency, "k": k,
                "held_out_concurrency": concurrency != 16, "predicted_speedup": speedup, "measured_speedup": speedup,
                "measured_ci95": [low, high], "error": 0.0, "acceptance": "synthetic", "command": "measure"}

    def decision(concurrency: int, best: int, recommended: int) -> dict[str, Any]:
        return {"model": "m", "drafter": "ngram", "concurrency": concurrency, "measured_best_k": best,
                "recommended_k": recommended}

    document = {
        "rows": [row(8, 2, 1.5, 1.4, 1.6), row(8, 4, 1.8, 1.7, 1.9), row(16, 4, 2.0, 1.9, 2.1),
                 row(2, 2, 0.8, 0.7, 0.9), row(32, 2, 1.2, 1.1, 1.3)],
        "decisions": [decision(8, 4, 2), decision(16, 4, 4), decision(2, 0, 2)],  # none at 32
    }
    (tmp_path / "speedup-validation-hand.json").write_text(json.dumps(document))
    found = prediction_errors().record(tmp_path)
    regret = {group["concurrency"]: group for group in found["regret"]}
    assert set(regret) == {2, 8, 16} and found["groups_without_recommendation"] == 1
    # at 8 the report chose k = 2 (1.5) where k = 4 measured 1.8: 1.8 / 1.5 - 1 = 0.2;
    # bounds 1.7 / 1.6 - 1 = 0.0625 and 1.9 / 1.4 - 1 = 0.357142...
    assert regret[8]["regret"] == pytest.approx(0.2)
    assert regret[8]["regret_interval"] == pytest.approx([0.0625, 0.3571])
    assert (regret[8]["recommended_k"], regret[8]["measured_best_k"]) == (2, 4)
    assert regret[16]["regret"] == 0.0 and regret[16]["regret_interval"] == [0.0, 0.0]
    # at 2 k = 0 (exactly 1) beat the recommended k = 2 (0.8): 1 / 0.8 - 1 = 0.25, bounds 1 / 0.9 - 1, 1 / 0.7 - 1
    assert regret[2]["regret"] == pytest.approx(0.25)
    assert regret[2]["regret_interval"] == pytest.approx([0.1111, 0.4286])
    assert not regret[16]["held_out_concurrency"] and regret[8]["held_out_concurrency"]
    assert {cell["acceptance"] for cell in found["cells"]} == {"synthetic"}
    assert len(found["cells"]) == 4  # every row but the recorded 16


def test_a_moved_prediction_names_the_context_it_moved_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = prediction_errors()
    row = {"model": "m", "drafter": "ngram", "concurrency": 8, "k": 2, "held_out_concurrency": True,
           "predicted_speedup": 1.1, "measured_speedup": 1.0, "error": 0.1, "command": "measure --prompt-tokens 8192"}
    (tmp_path / "moved.json").write_text(json.dumps({"models": {"m": {"predicted_from": "r256 moved by --context "
                                                                                       "8192"}}, "rows": [row]}))
    with pytest.raises(SystemExit, match="moved to another context"):
        module.held_out_cells(tmp_path)
    monkeypatch.setitem(module.PROVENANCE, "moved.json", module.Provenance("re-predicted", None, "why", moved_from=256))
    [cell] = module.held_out_cells(tmp_path)
    assert (cell["context"], cell["moved_from"]) == (8192, 256)


def test_the_readme_line_counts_blind_cells_apart() -> None:
    cells = [{"prediction": "blind", "error": e} for e in (0.05, -0.08, 0.12)] + [
        {"prediction": "re-predicted", "error": e} for e in (0.2, 0.01)]
    assert prediction_errors().readme_figures(cells) == (
        "2 of 3 blind held-out cells within 10% (\u22128% to +12%), 2 more re-predicted (1 within 10%)")
