"""What the ``zerocore`` logger says while a piece of code runs, for tests of its lines."""

from __future__ import annotations

import logging
from typing import Any, Callable


def logged(build: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``build()``, and the messages the ``zerocore`` logger emitted meanwhile (INFO and up);
    the logger's level and handlers are as they were afterwards."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("zerocore")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        return build(), records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
