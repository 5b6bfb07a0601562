"""What runs inside vLLM: the plugin, routing capture, the per-worker recorder."""

from moetrace import require_same_checkout

require_same_checkout(__file__, __name__)
