"""On a GPU vLLM: graph capture (torch.compile + FULL_AND_PIECEWISE CUDA graphs, and FULL graphs without compile)
records what eager capture records, Model Runner V2 what V1 records, and a TP=2 run and a DP=2 expert-parallel
`vllm serve` what a one-GPU run records, up to near-ties, and every row equals the float32 reference routing of its
own router logits. Skipped without CUDA (the TP and DP tests without 2 GPUs); results of the runs on H200s with
vLLM 0.26 are in benchmarks/results/gpu-vllm-*.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a GPU build of vLLM")


def capture(tmp_path: Path, *args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    out = tmp_path / "capture.json"
    script = Path(__file__).parent / "gpu_vllm_capture.py"
    done = subprocess.run([sys.executable, str(script), "--max-tokens", "48", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result, done


def assert_rows_agree(result: dict[str, Any], done: subprocess.CompletedProcess[str], moved: bool = False) -> None:
    """``moved``: the runs compute different hidden states (TP's all-reduce, DP's batches round differently), so a
    few deep-layer rows really route differently: allowed where each keeps most of its candidates (a row from the
    wrong token shares few) and stays within 1% of the rows."""
    runs = list(result["complete"])
    assert result["complete"] == dict.fromkeys(runs, True)
    assert result["acceptance_equals_vllm_counters"] == dict.fromkeys(runs, True)
    assert result["rows_equal_scheduled_tokens"] == dict.fromkeys(runs, True)
    assert result["rows_compared"] == result["rows_in_a"] > 0 and result["tokens_equal"]
    assert result["decoded_rows_compared"] > 0
    if moved:
        assert result["rows_unexplained_sharing_most_candidates"] == result["rows_unexplained"]
        assert result["rows_unexplained"] <= 0.01 * result["rows_compared"]
    else:
        assert result["rows_unexplained"] == 0
        assert result["rows_nearer_another_token"] == 0
    for run in runs:
        assert result["reference"][run]["rows_reference_unexplained"] == 0
    assert done.returncode == (1 if result["rows_unexplained"] else 0)


def test_compiled_graph_capture_equals_eager_up_to_near_ties_and_the_float32_reference(tmp_path: Path) -> None:
    result, done = capture(tmp_path, "--candidates", "384")  # every expert's score: a row's exact movement
    assert set(result["complete"]) == {"eager", "compiled"}
    assert result["capture_mechanisms"]["compiled"].get("graph", 0) > 0, "the compiled run replayed CUDA graphs"
    assert result["host_copy"]["compiled"] == "mapped", "under sync scheduling the GPU packs into pinned memory"
    assert_rows_agree(result, done)


def test_cuda_graphs_without_compile_record_what_eager_records(tmp_path: Path) -> None:
    result, done = capture(tmp_path, "--graphs-only", "--candidates", "384")
    assert set(result["complete"]) == {"eager", "graphs-only"}
    assert result["capture_mechanisms"]["graphs-only"].get("graph", 0) > 0, "the run replayed CUDA graphs"
    assert_rows_agree(result, done)


def test_model_runner_v2_records_what_v1_records(tmp_path: Path) -> None:
    # 0.26's V2 drafts with MTP, not n-gram; every expert's score, so that a moved row is told from a misplaced one
    result, done = capture(tmp_path, "--v2", "--method", "mtp", "--candidates", "384")
    assert result["model_runner"] == {"compiled": "v1", "compiled-v2": "v2"}
    assert result["capture_mechanisms"]["compiled-v2"].get("graph", 0) > 0, "V2 replayed CUDA graphs"
    assert result["windows_after_finish"]["compiled-v2"] > 0, "async scheduling verified finished requests once more"
    assert_rows_agree(result, done)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_rows_equal_one_gpu_rows_up_to_near_ties(tmp_path: Path) -> None:
    result, done = capture(tmp_path, "--tp", "2")
    assert result["tp"] == {"compiled": 1, "tp2": 2}
    assert_rows_agree(result, done, moved=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_data_parallel_expert_parallel_serve_rows_equal_one_gpu_rows_and_the_servers_counts(tmp_path: Path) -> None:
    result, done = capture(tmp_path, "--dp", "2", "--num-prompts", "10")
    dp = result["data_parallel"]
    assert dp["dp_ranks"] == [0, 1] and min(dp["requests_per_rank"]) > 0, "both ranks served requests"
    assert dp["client"] == {"requests_matched": 10, "requests_sent": 10, "prompt_rows_equal_client": True,
                            "fed_tokens_equal_client": True}
    assert_rows_agree(result, done, moved=True)

