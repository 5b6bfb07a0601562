"""The report layer: from ``moetrace report``'s parsed options (``options``), one analysis per TRACE (``analyse``),
shaped into one payload (``payload``) that the terminal, ``--json`` and the dashboard render; ``pipeline`` runs the
whole."""
