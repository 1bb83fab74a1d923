"""Settings: the config schema (ranges and choices), loading and overrides, and the checks that need no model."""
