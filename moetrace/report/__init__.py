"""Rendering of analyses: the summary, terminal tables, the offline HTML dashboard and the CLI commands."""
