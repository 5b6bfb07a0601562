"""The analyses the report runs: functions of Polars frames that return Polars frames (no plotting)."""

from moetrace import require_same_checkout

require_same_checkout(__file__, __name__)
