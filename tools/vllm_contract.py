"""The vLLM internals ``vllm_api.CONTRACT`` names, checked against the Python sources of each release in
``vllm_api.CHECKED``, read from the release's wheel: nothing is installed, nothing is imported from vLLM.

The wheels come from PyPI once and stay cached (``vllm_wheels``). Each internal, in each release, is

- ``present``: at its path; a field where the class there, or a base class in vLLM's sources (across modules),
  defines it as a method or class attribute, or assigns ``self.<field>`` anywhere in its body;
- ``moved``: not at its first path, but at another one its ``Reads.paths`` lists (vllm_api tries it: handled), or
  only elsewhere in the package, as a class or function of the same name (vllm_api does not try it);
- ``gone``;

and V2's warm-up request ids are ``changed`` where vLLM spells one ``WARMUP_REQUEST_PREFIXES`` does not know.

``python3 tools/vllm_contract.py --write docs/vllm-releases.md`` regenerates the committed table;
``tests/unit/test_vllm_contract.py`` fails where it differs from what this computes, and where a release lacks an
internal that vllm_api neither finds at a path it tries nor refuses that release's runner for.

Development tooling, run from a checkout (``tools/`` is not installed): nothing of it runs inside vLLM.
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NamedTuple

from moetrace.hooks.vllm_api import (
    CHECKED,
    CONTRACT,
    KIMI_K3_CONTRACT,
    TESTED,
    WARMUP_PATH,
    WARMUP_REQUEST_PREFIXES,
    Reads,
    RunnerV1,
    RunnerV2,
)
from vllm_wheels import Sources, WheelUnavailable, release_wheel

# where a field of a class that is gone is said to be gone: the class is the cause, named in its own row
CLASS_GONE = "its class is gone"


class Row(NamedTuple):
    """One internal in one release: ``status`` present, moved, gone (or, for V2's warm-up request ids, changed);
    ``where`` it was found (a field inherited: the class defining it; moved: the path it moved to), why it is gone,
    or the ids unknown; ``handled``: present, or moved to a path vllm_api tries."""

    release: str
    runner: str
    internal: str
    status: str
    where: str
    handled: bool


@dataclass(frozen=True)
class Found:
    """A name as the sources define it: ``path`` where it is defined, its ``node`` (None for a module, or a name a
    module's ``__getattr__`` makes), in ``module``."""

    path: str
    node: ast.stmt | None
    module: str


def runtime_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's top-level statements as they run: into ``if`` and ``try`` blocks, past ``if TYPE_CHECKING:``."""
    for statement in body:
        if isinstance(statement, ast.If):
            test = statement.test
            if not (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                    or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                yield from runtime_statements(statement.body)
            yield from runtime_statements(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from runtime_statements(statement.body)
            for handler in statement.handlers:
                yield from runtime_statements(handler.body)
            yield from runtime_statements(statement.orelse)
            yield from runtime_statements(statement.finalbody)
        else:
            yield statement


def imported_module(sources: Sources, module: str, statement: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in ``module`` reads from."""
    if not statement.level:
        return statement.module or ""
    package = module if sources.is_package(module) else module.rpartition(".")[0]
    for _ in range(statement.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{statement.module}" if statement.module else package


def lookup(sources: Sources, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> Found | None:
    """What ``module.name`` is in the sources: defined there, imported there (followed to its definition, star
    imports too), made by the module's ``__getattr__``, or a submodule; None where it is none of those."""
    tree = sources.tree(module)
    if tree is None or (module, name) in seen:
        return None
    seen |= {(module, name)}
    stars: list[str] = []
    for statement in runtime_statements(tree.body):
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
            return Found(f"{module}.{name}", statement, module)
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                aliased = expression_target(sources, module, statement.value, seen)  # ``Name = OtherClass``
                return aliased if aliased is not None else Found(f"{module}.{name}", statement, module)
        if isinstance(statement, ast.ImportFrom):
            source = imported_module(sources, module, statement)
            for alias in statement.names:
                if alias.name == "*":
                    stars.append(source)
                elif (alias.asname or alias.name) == name:
                    found = lookup(sources, source, alias.name, seen)
                    if found is None and sources.file(f"{source}.{alias.name}"):
                        found = Found(f"{source}.{alias.name}", None, f"{source}.{alias.name}")
                    return found
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname == name or (alias.asname is None and alias.name.partition(".")[0] == name):
                    imported = alias.name if alias.asname else name
                    return Found(imported, None, imported)
    for source in stars:
        found = lookup(sources, source, name, seen)
        if found is not None:
            return found
    # a module ``__getattr__`` makes its names on first use: from a string it compares or a table it reads
    if any(isinstance(statement, ast.FunctionDef) and statement.name == "__getattr__" for statement in tree.body) \
            and any(isinstance(node, ast.Constant) and node.value == name for node in ast.walk(tree)):
        return Found(f"{module}.{name}", None, module)
    if sources.file(f"{module}.{name}"):
        return Found(f"{module}.{name}", None, f"{module}.{name}")
    return None


def expression_target(sources: Sources, module: str, expression: ast.expr,
                      seen: frozenset[tuple[str, str]] = frozenset()) -> Found | None:
    """What a name (``Base``) or dotted name (``layer.Base``) in ``module`` refers to, where the sources define
    it; a subscript (``Base[T]``) refers to what it subscripts."""
    if isinstance(expression, ast.Subscript):
        return expression_target(sources, module, expression.value, seen)
    if isinstance(expression, ast.Name):
        return lookup(sources, module, expression.id, seen)
    if isinstance(expression, ast.Attribute):
        owner = expression_target(sources, module, expression.value, seen)
        if owner is not None and owner.node is None:  # a module
            return lookup(sources, owner.module, expression.attr, seen)
    return None


def find(sources: Sources, path: str) -> Found | None:
    module, _, name = path.rpartition(".")
    return lookup(sources, module, name)


def class_fields(sources: Sources, found: Found) -> dict[str, str]:
    """Each field the class ``found`` or a base class in the sources defines (methods, class attributes, annotated
    fields, ``self.<field>`` assigned anywhere in its body) -> the class that defines it."""
    node = found.node
    assert isinstance(node, ast.ClassDef)
    own: set[str] = set()
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(statement.name)
        elif isinstance(statement, ast.Assign):
            own |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            own.add(statement.target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) \
                and sub.value.id == "self":
            own.add(sub.attr)
    fields: dict[str, str] = {}
    for base in reversed(node.bases):  # the first base's fields win, as in the method resolution order
        resolved = expression_target(sources, found.module, base)
        if resolved is not None and isinstance(resolved.node, ast.ClassDef) and resolved.path != found.path:
            fields.update(class_fields(sources, resolved))
    fields.update(dict.fromkeys(own, found.path))
    return fields


def listed_paths() -> set[str]:
    """Every path the contract names: a class found elsewhere by name is never one of these (V1's
    ``GPUModelRunner`` has not moved to V2's)."""
    return {path for reads in CONTRACT for path in reads.paths}


def check_reads(sources: Sources, release: str, reads: Reads) -> list[Row]:
    """The rows of one ``Reads`` in one release: the class or symbol, then each field read on it."""
    primary = reads.paths[0]
    found, status, where, handled = None, "gone", "", False
    for path in reads.paths:
        found = find(sources, path)
        if found is not None:
            status, handled = ("present", True) if path == primary else ("moved", True)
            where = (found.path if found.path != path else "") if path == primary else path
            break
    else:
        elsewhere = [p for p in sources.defined_in(primary.rpartition(".")[2]) if p not in listed_paths()]
        if elsewhere:
            found = find(sources, elsewhere[0])
            status, where = "moved", ", ".join(elsewhere)
    rows = [Row(release, reads.runner, primary, status, where, handled)]
    fields = class_fields(sources, found) if found is not None and isinstance(found.node, ast.ClassDef) else None
    for field in reads.fields:
        internal = f"{primary}.{field}"
        if found is None:
            rows.append(Row(release, reads.runner, internal, "gone", CLASS_GONE, False))
        elif fields is None:
            rows.append(Row(release, reads.runner, internal, "gone", f"{found.path} is not a class", False))
        elif field not in fields:
            rows.append(Row(release, reads.runner, internal, "gone", f"not on {found.path} or its bases", False))
        elif status == "present":
            rows.append(Row(release, reads.runner, internal, "present",
                            "" if fields[field] == found.path else fields[field], True))
        else:
            rows.append(Row(release, reads.runner, internal, "moved", f"{found.path}.{field}", handled))
    return rows


def check_warmup(sources: Sources, release: str) -> Row:
    """Whether every request id V2's warm-up spells (a string, or an f-string's head, that starts with ``_`` and
    names a warm-up) starts with one of ``WARMUP_REQUEST_PREFIXES``: ``changed`` names those that do not."""
    internal = f"{WARMUP_PATH} request ids"
    tree = sources.tree(WARMUP_PATH)
    if tree is None:
        return Row(release, "v2", internal, "gone", "", False)
    spelled = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            node = node.values[0]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_") \
                and "warmup" in node.value:
            spelled.add(node.value)
    unknown = sorted(s for s in spelled if not s.startswith(WARMUP_REQUEST_PREFIXES))
    if unknown:
        return Row(release, "v2", internal, "changed", ", ".join(unknown), False)
    return Row(release, "v2", internal, "present", "", True)


def check_wheel(wheel: Path, release: str) -> list[Row]:
    """Every internal of ``vllm_api.CONTRACT`` in the sources of ``wheel`` (vLLM ``release``), in contract order,
    then V2's warm-up request ids."""
    sources = Sources(wheel)
    return [row for reads in CONTRACT for row in check_reads(sources, release, reads)] + [
        check_warmup(sources, release)]


def check_kimi_k3(release: str) -> list[Row]:
    """Every internal of ``vllm_api.KIMI_K3_CONTRACT`` in ``release``'s sources (one of ``KIMI_K3_RELEASES``)."""
    sources = Sources(release_wheel(release))
    return [row for reads in KIMI_K3_CONTRACT for row in check_reads(sources, release, reads)]


def base_paths(sources: Sources, path: str) -> list[str]:
    """The class at ``path`` and every base class of it in the sources, nearest first."""
    found = find(sources, path)
    if found is None or not isinstance(found.node, ast.ClassDef):
        return []
    bases = [expression_target(sources, found.module, base) for base in found.node.bases]
    return [found.path, *(p for base in bases if base is not None for p in base_paths(sources, base.path))]


@cache
def check_release(release: str) -> list[Row]:
    """``check_wheel`` of ``release``'s wheel (cached or downloaded: ``WheelUnavailable`` where neither)."""
    return check_wheel(release_wheel(release), release)


def unhandled(rows: list[Row], release: str, runner: str) -> tuple[str, ...]:
    """What vllm_api lacks in ``release`` for ``runner``: every internal neither present nor at a path it tries
    (a field of a class that is gone counts as its class), the runner's own and the common ones."""
    return tuple(row.internal for row in rows if row.release == release and row.runner in ("common", runner)
                 and not row.handled and row.where != CLASS_GONE)


class Probe:
    """Stands in for a vLLM runner while its ``HookPoint`` list is built: every attribute read on it is another probe,
    named by how it was reached (``runner.speculator``)."""

    def __init__(self, reached: str) -> None:
        self.reached = reached

    def __getattr__(self, name: str) -> Probe:
        return Probe(f"{self.reached}.{name}")


def hook_points() -> list[tuple[str, str, str]]:
    """Every call the recorder wraps, as (runner, how its owner is reached, name), from the runners' own
    ``hook_points``."""
    points = []
    for view in (RunnerV1.__new__(RunnerV1), RunnerV2.__new__(RunnerV2)):
        view.runner = Probe("runner")
        for point in view.hook_points():
            assert isinstance(point.owner, Probe)
            points.append((view.name, point.owner.reached, point.name))
    return points


def uncovered_hook_points() -> list[str]:
    """The hook points no ``Reads`` of their runner lists among the fields of what reaches their owner."""
    return [f"{runner}: {reached}.{name}" for runner, reached, name in hook_points()
            if not any(r.runner == runner and r.reached == reached and name in r.fields for r in CONTRACT)]


def cell(row: Row) -> str:
    if row.status == "present":
        return "present"
    if row.status == "changed":
        return f"new: `{row.where}`"
    if row.status == "moved":
        return f"moved to `{row.where}`" + ("" if row.handled else " (not tried)")
    return "gone (class)" if row.where == CLASS_GONE else "gone"


def markdown(rows: list[Row]) -> str:
    """The committed table: counts per release and runner, then every internal per release."""
    releases = list(dict.fromkeys(row.release for row in rows))
    prose = [
        "Generated by `python3 tools/vllm_contract.py --write docs/vllm-releases.md` from each release's wheel "
        "(PyPI's `vllm==X.Y.0`, read as a zip: nothing installed, nothing imported) against `CONTRACT` in "
        "`hooks/vllm_api/`; `tests/unit/test_vllm_contract.py` fails where this file differs from what the check "
        f"computes. Checked is not tested: of these releases only vLLM {', '.join(TESTED[:-1])} and {TESTED[-1]} "
        "(`TESTED`) ran moetrace, on a GPU or the CPU build; the others were only read.",
        "",
        "- **present**: at its path; a field where the class there or a base class in vLLM's sources defines it "
        "(method, class attribute) or assigns `self.<field>` in its body.",
        "- **moved to X**: not at its first path but at X, another path `vllm_api` tries; **(not tried)**: found "
        "only by name elsewhere in the package, which `vllm_api` does not try (a class of the same name may be "
        "another class).",
        "- **gone**: neither; **gone (class)**: a field of a class that is gone. **new**: V2's warm-up spells a "
        "request id that `WARMUP_REQUEST_PREFIXES` does not know.",
        "- **refused**: the runner lacks internals in that release (the common ones counted too), so `vllm_api` "
        "refuses to record on it there, in one line naming the first (`REFUSED`).",
    ]
    lines = ["# vLLM internals per release", ""]
    for paragraph in prose:
        indent = "  " if paragraph.startswith("- ") else ""
        lines += textwrap.wrap(paragraph, 120, subsequent_indent=indent, break_on_hyphens=False) or [""]
    lines += ["", "## Per release and runner", "",
              "| release | runner | present | moved (tried) | moved (not tried) | gone or new | recording |",
              "|---|---|---|---|---|---|---|"]
    for release in releases:
        for runner in ("v1", "v2"):
            mine = [row for row in rows if row.release == release and row.runner in ("common", runner)]
            counts = [sum(1 for row in mine if row.status == "present"),
                      sum(1 for row in mine if row.status == "moved" and row.handled),
                      sum(1 for row in mine if row.status == "moved" and not row.handled),
                      sum(1 for row in mine if row.status in ("gone", "changed"))]
            lacking = unhandled(rows, release, runner)
            verdict = f"refused: lacks {len(lacking)}, first `{lacking[0]}`" if lacking else "all found"
            lines.append(f"| {release} | {runner.upper()} | {' | '.join(map(str, counts))} | {verdict} |")
    lines += ["", "## Every internal", "",
              f"| runner | internal | {' | '.join(releases)} |", "|---|---|" + "---|" * len(releases)]
    by_internal: dict[tuple[str, str], dict[str, Row]] = {}
    for row in rows:
        by_internal.setdefault((row.runner, row.internal), {})[row.release] = row
    # a field is shown under its class's row, by the class's own name
    fields = {f"{reads.paths[0]}.{field}": f"{reads.paths[0].rpartition('.')[2]}.{field}"
              for reads in CONTRACT for field in reads.fields}
    for (runner, internal), per_release in by_internal.items():
        cells = [cell(per_release[release]) if release in per_release else "" for release in releases]
        lines.append(f"| {runner.upper() if runner != 'common' else runner} | `{fields.get(internal, internal)}` | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def all_rows() -> list[Row]:
    return [row for release in CHECKED for row in check_release(release)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/vllm_contract.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="FILE", type=Path, help="write the table there (else print it)")
    args = parser.parse_args(argv)
    try:
        table = markdown(all_rows())
    except WheelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.write is None:
        sys.stdout.write(table)
    else:
        args.write.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
