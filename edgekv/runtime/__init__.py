"""The runtime: memory, the KV cache, the sequence, backends, generation, sampling, text."""
