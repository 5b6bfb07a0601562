"""Prompts of a long context for the demo, as JSONL on stdout: the first 1,024 bytes (the default model's tokens
are bytes) of eight Python standard-library modules, read from this Python's own sources, nothing downloaded.

    python3 scripts/long_prompts.py > traces/long-prompts.jsonl
"""

from __future__ import annotations

import importlib
import inspect
import json

MODULES = ("heapq", "textwrap", "bisect", "functools", "string", "difflib", "shlex", "fnmatch")
TOKENS = 1024

if __name__ == "__main__":
    for name in MODULES:
        source = inspect.getsource(importlib.import_module(name)).encode()[:TOKENS].decode(errors="ignore")
        print(json.dumps({"prompt": source}))
