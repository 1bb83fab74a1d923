"""Models on a device: loading, chunked log-probs, the vLLM engine, and engines kept across stages."""
