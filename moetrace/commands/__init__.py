"""What the CLI's commands share (``common``); the commands themselves are registered in ``moetrace.cli``."""
