"""The OpenAI-compatible server (`edgekv serve`, the serve extra)."""
