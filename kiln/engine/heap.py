"""Python's garbage collector after boot. A booted engine holds hundreds of thousands of
long-lived Python objects (the model's modules, Dynamo's and Inductor's graphs and guards,
transformers' and torch's own): 500,000 for the embedded model in mode 3, which a full
collection walks in about 245 ms on a 2-core Zen 4. Python runs one whenever the objects that
survived its younger collections reach a quarter of the long-lived ones, so a server meets that
pause in the middle of its decode steps at some point of its life. Boot ends by collecting once
and freezing what is left (gc.freeze: the collector no longer walks those objects; a full
collection afterwards took 0.1 ms), as vLLM does after its engine starts. An engine's close()
unfreezes them, so what it held in reference cycles can still be freed."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_boot_heap() -> int:
    """Collect, then move every object left out of the collector's walks; returns how many are
    frozen (those of any engine booted before in this process included)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug(
        "froze %d boot objects out of the garbage collector's passes (%.0f ms)",
        gc.get_freeze_count(), (time.perf_counter() - t0) * 1e3,
    )  # fmt: skip
    return gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Give frozen objects back to the collector (an engine closing: its cycles can be freed)."""
    gc.unfreeze()
