"""Workload prompts: the built-in set (code, prose, structured text) or a user's JSONL / plain-text file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from moetrace.errors import UserError

BUILTIN_PROMPTS: tuple[str, ...] = (
    # code: the first two from standard-library modules the default model was not trained on (heapq, textwrap)
    'def heappush(heap, item):\n    """Push item onto heap, maintaining the heap invariant."""\n'
    "    heap.append(item)\n    _siftdown(heap, 0, len(heap)-1)\n\ndef heappop(heap):\n"
    '    """Pop the smallest item off the heap, maintaining the heap invariant."""\n'
    "    lastelt = heap.pop()    # raises appropriate IndexError if heap is empty\n    if heap:\n",
    'def fill(text, width=70, **kwargs):\n    """Fill a single paragraph of text, returning a new string.\n\n'
    "    Reformat the single paragraph in 'text' to fit in lines of no more\n    than 'width' columns, and return",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n    if n < 2:\n        return 1\n    return n * factorial(n - 1)\n\ndef ",
    "for (int i = 0; i < n; i++) {\n    sum += a[i] * b[i];\n}\nfor (int i = 0; i < n; i++) {\n    ",
    "SELECT name, count(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
    "GROUP BY name ORDER BY count(*) DESC;\nSELECT ",
    # prose
    "The committee met on Tuesday to review the budget. After a long discussion, the committee agreed "
    "that the budget would be reviewed again on Thursday, when the committee",
    "Once upon a time there was a small village by the sea. Every morning the fishermen of the village "
    "went out to sea, and every evening the fishermen of the village",
    "Speculative decoding drafts several tokens and verifies them in one forward pass of the target model. "
    "When the drafts are accepted, speculative decoding",
    # structured text
    '{"id": 1, "name": "alpha", "tags": ["a", "b"]},\n{"id": 2, "name": "beta", "tags": ["b", "c"]},\n'
    '{"id": 3, "name": "gamma", "tags": [',
    "| layer | experts | tokens |\n|---|---|---|\n| 1 | 384 | 1024 |\n| 2 | 384 | 1024 |\n| 3 |",
)


def load_prompts(path: Path | None) -> list[str]:
    """Prompts from ``path`` (JSONL objects with a ``prompt`` field, or one prompt per plain-text line)."""
    if path is None:
        return list(BUILTIN_PROMPTS)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read prompt file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    prompts: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise UserError(f"{path}:{number}: a JSONL line needs a string field 'prompt'")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise UserError(f"prompt file {path} holds no prompts")
    return prompts


def repeated_in_a_step(prompts: Sequence[str], batch_size: int) -> str | None:
    """Why steps of this workload would repeat a prompt, or None: more requests than distinct prompts, and room for
    more of them at once than there are distinct prompts."""
    distinct, at_once = len(set(prompts)), min(len(prompts), batch_size)
    if at_once <= distinct:
        return None
    return (f"{len(prompts)} requests over {distinct} distinct prompts, up to {at_once} at once (--batch-size "
            f"{batch_size}): a step of more than {distinct} requests repeats a prompt, whose requests decode the same "
            f"tokens (greedy) and read the same experts, so the report does not take those steps as measured; give "
            f"at least {at_once} distinct prompts (--prompts) to measure them")
