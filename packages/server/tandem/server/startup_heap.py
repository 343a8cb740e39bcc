"""The objects made at start-up (the model's modules, the tokenizer, the app: a few hundred
thousand) kept out of the garbage collector's full passes, as vLLM does after loading.

A full pass visits every tracked object while holding the GIL: about 120 ms here for a demo
model's server, paid whenever enough new objects survive (a burst of requests), and it stalls
the event loop (/health) and the engine's threads alike. Frozen objects are never collected,
so the garbage among them is collected first."""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect, then move every object that survives into the permanent generation; returns
    how many are there now."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%d start-up objects moved out of the garbage collector's passes", frozen)
    return frozen
