"""Watching a run: logging, progress, metrics, SQL over the shards, the report."""
