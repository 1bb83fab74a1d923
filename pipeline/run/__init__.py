"""A run: the Run object stages read (frozen config, records, policy paths) and its imported prompts."""
