"""The default model's own acceptance by draft position, per drafter, as profiles for ``moetrace record
--synthetic-acceptance`` (``moetrace/data/acceptance-profiles.json``): each from a trace of that drafter at k = 4.

    python benchmarks/acceptance_profiles.py                    # record n-gram, MTP and EAGLE-3 at k = 4 (CPU), write
    python benchmarks/acceptance_profiles.py --traces DIR ...   # or read traces already recorded (DIR: one k = 4 trace)

Rates are the report's own (``analysis.acceptance.acceptance_by_position``: request-steps that accepted at least i
drafts over every decoding request-step), rounded to 3 digits; each profile names the command and the vLLM that
made it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROFILES = Path(__file__).resolve().parents[1] / "moetrace" / "data" / "acceptance-profiles.json"
RECORD = ["--k", "4", "--num-prompts", "32", "--max-tokens", "128"]
DRAFTERS = ("ngram", "mtp", "eagle3")


def profile(trace_dir: Path, command: str) -> tuple[str, dict[str, object]]:
    """The profile name (``default-<drafter>``) and entry of the trace at ``trace_dir``."""
    from moetrace.analysis.acceptance import acceptance_by_position
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    if trace.manifest.acceptance_set_by != "drafter":
        raise SystemExit(f"{trace_dir}: its acceptance was set, not drafted: no profile of a drafter")
    rates = [round(float(rate), 3) for rate in acceptance_by_position(trace.steps(), trace.k)["acceptance_rate"]]
    method = str(trace.manifest.spec.method)
    versions = trace.manifest.document.get("versions") or {}
    return f"default-{method}", {
        "rates": rates, "drafter": method,
        "source": f"the embedded default model's own {method} drafts: `{command}` (vLLM {versions.get('vllm')}, "
                  f"{trace.manifest.counts.get('steps')} steps), rates from the trace"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, nargs="+", help="k = 4 traces of the default model to read instead")
    args = parser.parse_args()
    document = json.loads(PROFILES.read_text())
    with tempfile.TemporaryDirectory() as scratch:
        found: list[tuple[Path, str]] = []
        for method in ([] if args.traces else DRAFTERS):
            command = ["moetrace", "record", *RECORD, "--method", method, "--out", f"{scratch}/{method}"]
            subprocess.run([sys.executable, "-m", *command], check=True)
            found.append((next(Path(scratch, method).iterdir()), " ".join(command[:-2])))
        found += [(trace, f"moetrace record {' '.join(RECORD)} --method <drafter>") for trace in args.traces or []]
        for trace, command in found:
            name, entry = profile(trace, command)
            document["profiles"][name] = entry
            print(f"{name}: {entry['rates']}")
    # one profile's rates on one line: a list of numbers is read across, not down
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + ", ".join(re.split(r",\s+", m.group(1))) + "]",
                  json.dumps(document, indent=1))
    PROFILES.write_text(text + "\n")


if __name__ == "__main__":
    main()
