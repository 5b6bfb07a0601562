"""The index of ``benchmarks/results/``: every file there, the docs that cite it, the command that made it and the
commit, as ``docs/results.md``. A file no doc cites does not belong there (git keeps superseded runs); a
``*-measurements.json`` is cited through the validation it feeds (``compare`` reads it: the same run's name).

    python tools/results_index.py            # rewrite docs/results.md from the files and the docs
    python tools/results_index.py --check    # exit 1 where a file is uncited or the index is not current (CI)

The commit is the one the file names (``commit``), else the one that added it to git ("added in": the run's code is
that commit's or an earlier one's); the command is the one the file names (``command``), else its first line: the
command itself (``$ python ...``, ``# python ...``) or, in markdown, ``Command: `...` `` (what the backticks hold).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "docs" / "results.md"
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MEASUREMENTS = re.compile(r"^speedup-(?P<run>.+)-measurements\.json$")
COMMAND_LINE = re.compile(r"^Command: `(?P<command>[^`]+)`")  # a markdown file's first line
HEADER = """# Evidence files: what each one is, who cites it, how it was made

Every file in `benchmarks/results/`, the docs that cite it, the command that made it and its commit (the file's own,
or the commit that added it: the run's code is that commit's or an earlier one's). A `*-measurements.json` is what a
GPU measured; the `speedup-validation-*.json` of the same run sets the report's predictions beside it. Written by
`python tools/results_index.py`; CI checks it is current and that no file is uncited.

| file | cited by | command | commit |
|---|---|---|---|
"""


def results() -> list[Path]:
    """Every file under ``benchmarks/results/``, in name order."""
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def name_of(path: Path) -> str:
    return path.relative_to(RESULTS).as_posix()


def citing(path: Path) -> list[str]:
    """The docs that name the file (by its name under results/, or its bare name), the index itself left out; a
    measurements file also through the validation of the same run."""
    names = {name_of(path), path.name}
    match = MEASUREMENTS.match(path.name)
    if match:
        names |= {p.name for p in RESULTS.glob(f"speedup-validation-{match['run']}*.json")}
        names |= {p.name for p in RESULTS.glob(f"speedup-validation-{match['run'].removeprefix('closed-loop-')}*.json")}
    return [doc.relative_to(ROOT).as_posix() for doc in CITING
            if doc != INDEX and any(name in doc.read_text() for name in names)]


def provenance(path: Path) -> tuple[str, str]:
    """(command, commit) as the file names them, else its first line and the commit that added it."""
    document: Any = None
    if path.suffix == ".json":
        try:
            document = json.loads(path.read_text())
        except ValueError:
            document = None
    command = document.get("command") if isinstance(document, dict) else None
    commit = document.get("commit") if isinstance(document, dict) else None
    if not command:
        first = next((line for line in path.read_text(errors="replace").splitlines() if line.strip()), "")
        named = COMMAND_LINE.match(first)
        command = (named["command"] if named else
                   first if first.lstrip("#$ ").startswith(("python", "moetrace", "bash")) else "-")
    if not commit:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--", str(path)], cwd=ROOT,
                               capture_output=True, text=True, check=False).stdout.strip()
        commit = f"added in {added}" if added else "-"
    return str(command), str(commit)


def cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text[:limit]}{'…' if len(text) > limit else ''}`" if text != "-" else "-"


def index_text() -> str:
    rows = []
    for path in results():
        command, commit = provenance(path)
        cited = ", ".join(f"[{doc}]({Path(doc).name if doc.startswith('docs/') else '../' + doc})"
                          for doc in citing(path)) or "**none**"
        rows.append(f"| `{name_of(path)}` | {cited} | {cell(command)} | {commit} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a file is uncited or the index is stale")
    args = parser.parse_args()
    uncited = [name_of(p) for p in results() if not citing(p)]
    if not args.check:
        INDEX.write_text(index_text())
        print(f"{INDEX.relative_to(ROOT)}: {len(results())} files" + (f"; uncited: {', '.join(uncited)}"
                                                                       if uncited else ""))
        return
    listed = set(re.findall(r"^\| `([^`]+)` \|", INDEX.read_text(), re.M)) if INDEX.exists() else set()
    stale = sorted(set(map(name_of, results())) ^ listed)
    for name in uncited:
        print(f"benchmarks/results/{name}: no doc cites it (cite it, or remove it: git keeps it)")
    for name in stale:
        print(f"docs/results.md: {name} is {'not listed' if name not in listed else 'listed but gone'}: "
              "run python tools/results_index.py")
    sys.exit(1 if uncited or stale else 0)


if __name__ == "__main__":
    main()
