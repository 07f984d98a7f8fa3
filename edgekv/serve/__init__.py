"""The OpenAI-compatible server (`edgekv serve`, the serve extra)."""

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}  # a bind to one of these is reachable from this machine only
