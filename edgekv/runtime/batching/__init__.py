"""Continuous batching over one pool of KV cells (serve, chat): `Batcher` composes the scheduler,
the KV manager, the step runner and the post-processing (docs/runtime.md)."""
from edgekv.runtime.batching.batcher import Batcher
from edgekv.runtime.batching.poolseq import PoolSequence
from edgekv.runtime.batching.postprocess import FAULT_STEPS, Health
from edgekv.runtime.batching.request import Ask, Done, Event, Request, State, Token, Usage
from edgekv.runtime.batching.scheduler import HEADROOM

__all__ = ["Ask", "Batcher", "Done", "Event", "FAULT_STEPS", "HEADROOM", "Health", "PoolSequence", "Request",
           "State", "Token", "Usage"]
