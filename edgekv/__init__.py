"""edgekv: small chat LLMs with an INT8 KV cache, exported on a workstation, run on a Jetson."""
__version__ = "0.1.0"
