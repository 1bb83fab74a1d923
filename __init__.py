"""gndpo: offline, resumable, round-based on-policy distillation with cached teacher scores."""

__version__ = "0.1.0"
