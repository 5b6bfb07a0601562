"""The package's modules import one another without a cycle, and its packages one way, in the order data flows,
deferred imports included (a cycle makes the import order matter and hides which layer depends on which: commands
on recording and formats, never the other way)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where each installed package's modules live (pyproject.toml's package-dir)
PACKAGES = {"moetrace": ROOT / "moetrace", "moetrace.hooks": ROOT / "hooks", "moetrace.analysis": ROOT / "analysis"}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = [part for part in file.relative_to(folder).with_suffix("").parts if part != "__init__"]
            modules[".".join([package, *parts])] = file
    return modules


def imports_of(file: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``file`` imports anywhere in it (``from a.b import c`` counts a.b, and a.b.c where c is
    a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & set(modules)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the modules along it, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_package_import_graph_has_no_cycle() -> None:
    modules = module_files()
    graph = {name: imports_of(file, modules) - {name} for name, file in modules.items()}
    assert len(modules) > 50 and sum(map(len, graph.values())) > 100  # the graph was really read
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle_and_none_where_there_is_none() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The packages in the order data flows, as arrows from a package to those it may import (and, through them, those they
# may): the commands drive a recording, which spawns the hooks inside vLLM, which hand rows to the writer process,
# which writes the trace; the report runs the analyses over the trace. The two paths meet only in the trace: the report
# and the analyses never reach into a recording (or vLLM), the recording side never into an analysis. The engine
# formats import into a recording's trace and export what the analyses found. (``moetrace`` itself, the package's
# facade, is left out: every module's parent.)
FLOWS = (
    ("__main__", "cli", "commands", "recording", "hooks", "writer", "trace", "errors"),
    ("commands", "report", "analysis", "trace"),
    ("commands", "formats", "recording"),
    ("formats", "analysis", "calibrate"),
    ("commands", "calibrate"),
    ("recording", "default_model", "errors"),
)


def reachable(flows: tuple[tuple[str, ...], ...]) -> dict[str, set[str]]:
    """Every package of ``flows`` with the packages it reaches along their arrows (itself left out)."""
    arrows: dict[str, set[str]] = {}
    for flow in flows:
        for source, target in zip(flow, flow[1:]):
            arrows.setdefault(source, set()).add(target)
            arrows.setdefault(target, set())
    reached = {}
    for start in arrows:
        seen: set[str] = set()
        todo = list(arrows[start])
        while todo:
            if (package := todo.pop()) not in seen:
                seen.add(package)
                todo += arrows[package]
        reached[start] = seen
    return reached


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def stray_edges(graph: dict[str, set[str]], flows: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import from a package to another that ``flows`` does not lead it to, as "a -> b"."""
    reached = reachable(flows)
    found = []
    for module, targets in graph.items():
        source = package_of(module)
        for target in targets:
            into = package_of(target)
            if "moetrace" not in (source, into) and into != source and into not in reached[source]:
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_packages_depend_one_way_in_the_order_data_flows() -> None:
    modules = module_files()
    graph = {name: imports_of(file, modules) - {name} for name, file in modules.items()}
    assert {package_of(name) for name in modules} - {"moetrace"} == set(reachable(FLOWS))
    assert stray_edges(graph, FLOWS) == []


def test_the_recording_and_the_report_meet_only_in_the_trace() -> None:
    reached = reachable(FLOWS)
    recording = {"recording", "hooks", "writer"}
    assert not reached["report"] & recording  # nor do the analyses: the report reaches them
    assert not set().union(*(reached[package] for package in recording)) & {"report", "analysis"}
    assert reached["report"] & reached["recording"] == {"trace", "errors"}


def test_a_stray_edge_between_packages_is_found() -> None:
    graph = {"moetrace.trace.reader": {"moetrace.recording.record"}, "moetrace.recording.record": set(),
             "moetrace.report.placements": {"moetrace.hooks.vllm_api"}, "moetrace.hooks.vllm_api": set()}
    assert stray_edges(graph, FLOWS) == ["moetrace.report.placements -> moetrace.hooks.vllm_api",
                                         "moetrace.trace.reader -> moetrace.recording.record"]
