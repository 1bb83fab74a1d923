"""The embedded default tasks (toy models, tokenizers, prompts) and the packaged real models."""
