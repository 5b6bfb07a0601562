"""The one door to vLLM's internals: resolved on the installed vLLM, and one line naming what is missing."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from moetrace.hooks.vllm_api import (
    expert_placement,
    SUPPORTED,
    VllmApiError,
    engine_arg_exists,
    require_fields,
    symbol,
    vllm_version,
    worker_api,
)

pytestmark = pytest.mark.vllm


def test_every_internal_resolves_on_the_installed_vllm() -> None:
    api = worker_api()
    assert api.version == vllm_version() and api.version.rsplit(".", 1)[0] in SUPPORTED
    assert api.moe_runner_cls.__name__ == "MoERunner"
    assert api.graph_key() is None, "outside a forward there is no CUDA graph"
    assert engine_arg_exists("speculative_config") and not engine_arg_exists("no_such_engine_argument")


def test_a_missing_symbol_is_one_line_naming_it_the_version_found_and_the_versions_supported() -> None:
    with pytest.raises(VllmApiError) as raised:
        symbol("vllm.forward_context.get_forward_context_v9")
    message = str(raised.value)
    assert "\n" not in message
    assert "vllm.forward_context.get_forward_context_v9" in message
    assert f"vLLM {vllm_version()}" in message and "0.26, 0.32" in message


def test_a_runner_missing_a_field_is_named_with_its_class() -> None:
    runner = SimpleNamespace(model=None, max_num_tokens=8, input_batch=None, query_start_loc=None, positions=None,
                             input_ids=None, execute_model=None, _sample=None)  # no _model_forward
    with pytest.raises(VllmApiError, match=r"model runner\._model_forward \(types\.SimpleNamespace\)"):
        require_fields(runner, ("execute_model", "_sample", "_model_forward"), "model runner")


def test_hooks_and_writer_never_import_polars_or_plotly() -> None:
    """What runs inside vLLM's workers stays light: analysis libraries are for the reader side only."""
    code = (
        "import sys\n"
        "import moetrace.hooks.plugin, moetrace.hooks.recorder, moetrace.hooks.capture, moetrace.hooks.rows\n"
        "import moetrace.hooks.vllm_api, moetrace.hooks.manifest, moetrace.writer.process\n"
        "print(sorted(m for m in ('polars', 'plotly') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_expert_placement_recorded_is_vllms_own_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetrace.analysis.placement import linear_placement, round_robin_placement
    from moetrace.hooks import manifest, vllm_api

    assert expert_placement(384, 8, "linear") == linear_placement(384, 8).tolist()
    assert expert_placement(384, 8, "round_robin") == round_robin_placement(384, 8).tolist()
    # 10 experts over 4 ranks: vLLM gives each rank 10 // 4 and the first 10 % 4 ranks one more
    assert expert_placement(10, 4, "linear") == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3] == linear_placement(10, 4).tolist()
    assert manifest.placement_facts(10, 1, "linear")["expert_placement"] == "linear"
    monkeypatch.setattr(vllm_api.resolve, "EXPERT_MAP_PATHS", ("vllm.no_such_module.determine_expert_map",))
    facts = manifest.placement_facts(10, 4, "round_robin")
    assert facts["expert_placement"] == "round_robin" and "no_such_module" in facts["expert_placement_note"]


def test_model_runner_v2_fields_read_are_those_of_the_installed_vllm() -> None:
    """vLLM's GPU default runner cannot run on this CPU: its fields are checked against the installed source."""
    import dataclasses
    import inspect

    from vllm.v1.worker.gpu import cudagraph_utils, input_batch, model_runner

    from moetrace.hooks.vllm_api import GRAPH_MANAGER_V2_FIELDS, INPUT_BATCH_V2_FIELDS, RUNNER_V2_FIELDS

    runner_source = inspect.getsource(model_runner.GPUModelRunner)
    for field in RUNNER_V2_FIELDS:
        assert callable(getattr(model_runner.GPUModelRunner, field, None)) or f"self.{field} =" in runner_source \
            or f"self.{field}:" in runner_source, field
    assert set(INPUT_BATCH_V2_FIELDS) <= {f.name for f in dataclasses.fields(input_batch.InputBatch)}
    manager_source = inspect.getsource(cudagraph_utils.CudaGraphManager)
    for field in GRAPH_MANAGER_V2_FIELDS:
        assert callable(getattr(cudagraph_utils.CudaGraphManager, field, None)) or f"self.{field}:" in manager_source
    assert "self.graphs[desc] = graph" in manager_source, "V2 files each captured FULL graph under its descriptor"


def test_a_v2_full_graph_filed_by_vllm_names_the_routing_kept_while_it_was_captured() -> None:
    import torch

    from moetrace.hooks.capture import Kept, RoutingCapture
    from moetrace.hooks.vllm_api import GraphsNamingCaptures

    capture = RoutingCapture(8, 1, 2, 0, torch.device("cpu"))
    kept = Kept(torch.tensor([[3, 1]] * 4, dtype=torch.int32), torch.full((4, 2), 0.5), None, None)
    capture.graphs[None] = [kept]  # kept during a capture whose forward context named no graph
    graphs = GraphsNamingCaptures({}, capture.name_captured)
    graphs["desc-4-tokens"] = "the graph"  # vLLM files the graph it captured
    assert graphs == {"desc-4-tokens": "the graph"} and None not in capture.graphs
    mechanism, columns = capture.collect(3, replayed=("FULL", "desc-4-tokens"))  # ids, weights: one layer
    assert mechanism == "graph" and columns[0][:3].tolist() == [[3, 1]] * 3  # the graph's padding row follows


def test_model_runner_v2_kernel_warm_up_batches_are_told_from_requests_by_the_ids_vllm_gives_them() -> None:
    """V2 warms its kernels up through execute_model with requests of its own: none of them may become rows."""
    import inspect
    import re

    from vllm.v1.worker.gpu import warmup

    from moetrace.hooks.vllm_api import WARMUP_REQUEST_PREFIXES, RunnerV2

    # every request id that vLLM's warm-up builds, as its source spells them
    spelled = re.findall(r'(?:req_ids = \[f|req_id_prefix: str = )"([^"{]+)', inspect.getsource(warmup))
    assert len(spelled) == 2 and all(s.startswith(WARMUP_REQUEST_PREFIXES) for s in spelled)
    warm_up = SimpleNamespace(num_scheduled_tokens={"_warmup_0_": 4, "_warmup_1_": 4})
    mixed = SimpleNamespace(num_scheduled_tokens={"_v2_mixed_warmup_decode_": 1})
    served = SimpleNamespace(num_scheduled_tokens={"cmpl-7f3a-0": 4, "_warmup_0_": 1})
    assert RunnerV2.is_warmup(warm_up) and RunnerV2.is_warmup(mixed) and not RunnerV2.is_warmup(served)


def test_v1_hooks_return_before_the_forward_and_name_its_graph_as_vllm_chose_it() -> None:
    """The step hook and the graph hook sit on calls that vLLM's own execute_model makes, in this order, before the
    forward; the graph is named from what the second returns (CUDA-graph mode, descriptor, ..., DP tokens)."""
    import inspect

    import torch
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from moetrace.hooks.vllm_api import RunnerV1

    source = inspect.getsource(GPUModelRunner.execute_model)
    order = [source.index(call) for call in ("self._update_states(", "self._determine_batch_execution_and_padding(",
                                              "self._model_forward(")]
    assert order == sorted(order)
    runner = RunnerV1.__new__(RunnerV1)  # only its api is read
    runner.api = worker_api()
    descriptor = ("4 tokens", "uniform")
    assert runner.forward_plan((CUDAGraphMode.FULL, descriptor, False, None, None)) == (("FULL", descriptor), None)
    assert runner.forward_plan((CUDAGraphMode.PIECEWISE, descriptor, False, torch.tensor([4, 7]), None)) == (
        ("PIECEWISE", descriptor), [4, 7])
    assert runner.forward_plan((CUDAGraphMode.NONE, descriptor, False, None, None)) == (None, None)


def test_v2_graph_hooks_name_a_full_graph_by_its_descriptor_and_a_piecewise_one_by_the_forward_context() -> None:
    from moetrace.hooks.vllm_api import RunnerV2

    manager = SimpleNamespace(graphs={}, run_fullgraph=None, run_pw_graph=None)
    runner = SimpleNamespace(model=None, max_num_tokens=8, req_states=SimpleNamespace(prompt_len=None),
                             execute_model=None, sample=None, sample_tokens=None, capture_model=None, speculator=None,
                             cudagraph_manager=manager)
    points = {point.name: point for point in RunnerV2(worker_api(), runner).hook_points()}
    assert points["execute_model"].role == "step"
    full, piecewise = points["run_fullgraph"].plan, points["run_pw_graph"].plan
    assert full is not None and piecewise is not None
    assert full("hidden states", "desc-4") == (("FULL", "desc-4"), None)  # (result, desc) as run_fullgraph(desc)
    assert piecewise("hidden states", "model", {}) == (None, None)  # no forward context here: no graph


def test_every_drafter_moetrace_knows_is_a_speculative_method_vllm_names() -> None:
    """The drafter table (``trace.drafters``) against vLLM's own list of speculative methods."""
    import typing

    from vllm.config.speculative import SpeculativeMethod

    from moetrace.trace.drafters import DRAFTERS

    assert set(DRAFTERS) <= set(typing.get_args(SpeculativeMethod))
