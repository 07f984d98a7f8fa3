"""The batcher's old import path (it is edgekv/runtime/batching/ now; "engine" means a TensorRT
engine). Kept only until edgekv/chat/terminal.py, jetson/selftest.py, tests/test_bench.py,
tests/test_int4_determinism.py and tests/test_trt_fake.py import from edgekv.runtime.batching."""
import time  # noqa: F401  (tests/test_bench.py patches this; the batcher's clock is edgekv.runtime.batching.request.time)

from edgekv.runtime.batching import Batcher as Engine, PoolSequence as Held, Request  # noqa: F401
