"""How a lab check ends: its result printed as JSON (and written where asked), exit 1 where it did not hold."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn


def finish(result: dict[str, Any], path: Path | None) -> NoReturn:
    text = json.dumps(result, indent=1)
    print(text)
    if path is not None:
        path.write_text(text)
    sys.exit(0 if result["ok"] else 1)
