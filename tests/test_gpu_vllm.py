"""On a GPU vLLM: graph capture (torch.compile + FULL_AND_PIECEWISE CUDA graphs) records what eager capture
records, up to near-ties, and every row equals the float32 reference routing of its own router logits. Skipped
without CUDA; passed on an H200 with vLLM 0.26 (benchmarks/results/gpu-vllm-capture.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a GPU build of vLLM")


def test_compiled_graph_capture_equals_eager_up_to_near_ties_and_the_float32_reference(tmp_path: Path) -> None:
    out = tmp_path / "capture.json"
    script = Path(__file__).parent.parent / "benchmarks" / "gpu_vllm_capture.py"
    done = subprocess.run([sys.executable, str(script), "--max-tokens", "48", "--json", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] == {"eager": True, "compiled": True}
    assert result["acceptance_equals_vllm_counters"] == {"eager": True, "compiled": True}
    assert result["capture_mechanisms"]["compiled"].get("graph", 0) > 0, "the compiled run replayed CUDA graphs"
    assert result["rows_compared"] == result["rows_in_a"] > 0 and result["tokens_equal"]
    assert result["decoded_rows_compared"] > 0
    assert result["rows_unexplained"] == 0
    for run in ("eager", "compiled"):
        assert result["reference"][run]["rows_reference_unexplained"] == 0
    assert done.returncode == 0
