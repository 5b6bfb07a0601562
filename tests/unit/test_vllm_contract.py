"""The contract with vLLM, per release: every internal ``hooks/vllm_api/`` names, checked against the sources of
each release in ``CHECKED`` (their wheels, cached outside the repo: ``tools/vllm_contract.py``). A release that
lacks one fails here unless vllm_api tries the path it moved to or refuses that release's runner."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import vllm_contract
import vllm_wheels
from moetrace.hooks import vllm_api
from moetrace.hooks.vllm_api import (
    CHECKED,
    CPU_RUNNER_V2_PATH,
    EXPERT_MAP_PATHS,
    REFUSED,
    RUNNER_V1_PATH,
    RUNNER_V2_FIELDS,
    RUNNER_V2_PATH,
    SUPPORTED,
    TESTED,
    Reads,
    VllmApiError,
    WorkerApi,
)
from vllm_contract import Row
from vllm_wheels import Sources, WheelUnavailable

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "vllm-releases.md"
# one worker computes every release's rows once (the wheels are read, not the network)
pytestmark = pytest.mark.xdist_group("vllm-contract")


def release_sources(release: str) -> Sources:
    try:
        return Sources(vllm_wheels.release_wheel(release))
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    try:
        return vllm_contract.all_rows()
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


def test_the_committed_table_is_what_the_check_computes_today(rows: list[Row], tmp_path: Path) -> None:
    written = tmp_path / "vllm-releases.md"
    assert vllm_contract.main(["--write", str(written)]) == 0
    assert TABLE.read_text() == written.read_text() == vllm_contract.markdown(rows), (
        "docs/vllm-releases.md is stale: python3 tools/vllm_contract.py --write docs/vllm-releases.md")


def test_every_checked_release_has_every_internal_or_vllm_api_refuses_the_runner_that_lacks_one(
        rows: list[Row]) -> None:
    assert set(TESTED) <= set(SUPPORTED) <= set(CHECKED)
    for release in CHECKED:
        for runner in ("v1", "v2"):
            lacking = vllm_contract.unhandled(rows, release, runner)
            refused = REFUSED.get((release, runner))
            assert (refused is None) == (not lacking), (
                f"vLLM {release}, Model Runner {runner.upper()}: lacks {list(lacking)}, vllm_api.REFUSED says "
                f"{refused!r}: try the path it moved to in CONTRACT, or refuse the runner in REFUSED")
            assert refused is None or refused in lacking
    assert {release for release, _ in REFUSED} <= set(CHECKED)
    supported_runner = [(release, runner) for release in SUPPORTED for runner in ("v1", "v2")
                        if (release, runner) not in REFUSED]
    assert {release for release, _ in supported_runner} == set(SUPPORTED), "a supported release records on no runner"


def test_every_call_the_recorder_wraps_is_a_field_the_contract_checks() -> None:
    points = vllm_contract.hook_points()
    assert ("v1", "runner", "_update_states") in points and ("v2", "runner.speculator", "propose") in points
    assert vllm_contract.uncovered_hook_points() == []


def test_model_runner_v1_is_gone_in_0_34_and_both_runners_are_in_0_33(rows: list[Row]) -> None:
    status = {(row.release, row.internal): row.status for row in rows}
    for internal in (RUNNER_V1_PATH, vllm_api.CPU_RUNNER_V1_PATH, "vllm.envs.VLLM_USE_V2_MODEL_RUNNER"):
        assert status["0.34", internal] == "gone" and status["0.33", internal] == "present", internal
    for internal in (RUNNER_V2_PATH, CPU_RUNNER_V2_PATH):
        assert status["0.34", internal] == status["0.33", internal] == "present", internal
    assert vllm_contract.unhandled(rows, "0.34", "v2") == ()


def stand_in(sources: Sources, path: str) -> type:
    """A class with the module, name and base classes (those in vLLM's sources) that ``path`` has there."""
    found = vllm_contract.find(sources, path)
    assert found is not None and isinstance(found.node, ast.ClassDef), path
    bases = [vllm_contract.expression_target(sources, found.module, base) for base in found.node.bases]
    parents = tuple(stand_in(sources, base.path) for base in bases
                    if base is not None and isinstance(base.node, ast.ClassDef))
    module, _, name = found.path.rpartition(".")
    return type(name, parents, {"__module__": module})


def worker_api_of(version: str) -> WorkerApi:
    return WorkerApi(version=version, moe_runner_cls=object, cudagraph_none=None, get_forward_context=object,
                     is_forward_context_available=lambda: False, tp_rank=lambda: 0, pp_size=lambda: 1)


def test_recording_on_0_34_refuses_model_runner_v1_in_one_line_and_takes_its_cpu_runner_as_v2() -> None:
    sources = release_sources("0.34")
    cpu_runner = stand_in(sources, CPU_RUNNER_V2_PATH)()  # as 0.34's sources define it: a V2 GPU runner subclass
    for field in RUNNER_V2_FIELDS:
        setattr(cpu_runner, field, None)
    cpu_runner.req_states = type("RequestState", (), {"prompt_len": None})()
    assert worker_api_of("0.34.0").model_runner(cpu_runner).name == "v2"

    v1_runner = stand_in(release_sources("0.33"), RUNNER_V1_PATH)()  # 0.33's V1 runner, met on 0.34
    with pytest.raises(VllmApiError) as refused:
        worker_api_of("0.34.0").model_runner(v1_runner)
    message = str(refused.value)
    assert "\n" not in message and "vLLM 0.34.0" in message and RUNNER_V1_PATH in message and "V1" in message
    vllm_api.refuse_gone("0.33.0", "v1")  # 0.33 still ships it
    vllm_api.refuse_gone("0.34.1", "v2")


def test_a_release_outside_the_checked_ones_is_one_warning_line_and_recording_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert vllm_api.unchecked("0.32.0") is None and vllm_api.unchecked("0.34.1+cpu") is None
    line = vllm_api.unchecked("0.35.0")
    assert line is not None and "\n" not in line and "vLLM 0.35.0" in line and "0.26 to 0.34" in line
    pytest.importorskip("vllm")
    monkeypatch.setattr(vllm_api, "vllm_version", lambda: "0.35.0")
    with caplog.at_level(logging.WARNING, logger="moetrace"):
        api = vllm_api.worker_api.__wrapped__()  # resolved afresh on the installed vLLM, as if it were 0.35.0
    assert api.version == "0.35.0"
    assert [r.getMessage() for r in caplog.records if r.name == "moetrace"] == [f"moetrace: {line}"]


def test_a_warmup_request_id_vllm_api_does_not_know_is_found_in_the_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_contract, "WARMUP_REQUEST_PREFIXES", ("_warmup_", "_v2_mixed_warmup"))  # as before 0.34
    assert vllm_contract.check_warmup(release_sources("0.33"), "0.33").status == "present"
    new = vllm_contract.check_warmup(release_sources("0.34"), "0.34")
    assert (new.status, new.where, new.handled) == ("changed", "_context_warmup_", False)


def runtime_status(reads: Reads) -> list[tuple[str, str]]:
    """(internal, present / moved / gone) of ``reads`` on the installed vLLM, by importing it (a field: an attribute
    of the class, an annotated field, or ``self.<field>`` assigned in the source of a vLLM class of its MRO)."""
    found: Any = None
    status = "gone"
    for path in reads.paths:
        module, _, name = path.rpartition(".")
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(owner, name):
            found, status = getattr(owner, name), "present" if path == reads.paths[0] else "moved"
            break
    rows = [(reads.paths[0], status)]
    for field in reads.fields:
        defined = isinstance(found, type) and (hasattr(found, field) or any(
            field in vars(cls).get("__annotations__", {})
            or re.search(rf"\bself\.{field}\s*(:|=(?!=))", inspect.getsource(cls))
            for cls in found.__mro__ if cls.__module__.startswith("vllm")))
        rows.append((f"{reads.paths[0]}.{field}", status if defined else "gone"))
    return rows


def test_the_check_reads_the_installed_vllms_sources_as_python_imports_them() -> None:
    """On the installed vLLM: what the check finds in its release's wheel is what importing it finds, for every
    internal, and for names that are not there or moved to a path tried."""
    pytest.importorskip("vllm")
    release = vllm_api.release_of(vllm_api.vllm_version())
    sources = release_sources(release)
    controls = (Reads("v1", (RUNNER_V1_PATH,), ("_update_states", "no_such_field")),
                Reads("common", ("vllm.forward_context.no_such_function",)),
                Reads("common", ("vllm.no_such_module.determine_expert_map", EXPERT_MAP_PATHS[0])))
    for reads in (*vllm_api.CONTRACT, *controls):
        checked = [(row.internal, row.status) for row in vllm_contract.check_reads(sources, release, reads)]
        assert checked == runtime_status(reads)
    statuses = [[row.status for row in vllm_contract.check_reads(sources, release, reads)] for reads in controls]
    assert statuses[0] == ["present", "present", "gone"] and statuses[2] == ["moved"]


def test_the_check_imports_nothing_from_vllm() -> None:
    code = ("import sys\nimport vllm_contract\nvllm_contract.check_release('0.34')\n"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n")
    release_sources("0.34")  # cached, or skipped
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT / "tools")  # a development tool: importable from its folder, as its script runs
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_wheel_is_read_from_the_cache_and_one_pip_cannot_get_is_one_line_naming_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(vllm_wheels.WHEELS_ENV, str(tmp_path))
    cached = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    cached.touch()
    assert vllm_wheels.release_wheel("0.99") == cached  # no pip
    with pytest.raises(WheelUnavailable) as unavailable:
        vllm_wheels.release_wheel("0.0")  # vllm 0.0.0 was never released
    message = str(unavailable.value)
    assert "\n" not in message and "vLLM 0.0.0" in message and str(tmp_path) in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [cached.name], "no download folder left behind"


def test_kimi_k3_as_0_34_serves_it_routes_through_what_the_recorder_wraps_and_has_what_the_manifest_reads() -> None:
    for release in vllm_api.KIMI_K3_RELEASES:
        sources = release_sources(release)
        rows = vllm_contract.check_kimi_k3(release)
        assert [row for row in rows if row.status != "present"] == [], release
        assert len(rows) == sum(1 + len(reads.fields) for reads in vllm_api.KIMI_K3_CONTRACT)
        # the recorder finds MoE layers as MoE runners and wraps their router: K3's latent runner is one, its
        # grouped top-k router a BaseRouter
        runner, router = (reads.paths[0] for reads in vllm_api.KIMI_K3_CONTRACT[:2])
        assert vllm_api.MOE_RUNNER_PATH in vllm_contract.base_paths(sources, runner)
        assert "vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter" in vllm_contract.base_paths(
            sources, router)
