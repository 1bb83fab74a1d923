"""Text in and out of models: chat templates, the tool-use agent loop, alignment, cross-tokenizer scoring, held-out evaluation."""
