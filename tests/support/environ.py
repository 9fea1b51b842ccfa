"""Environment variables set for a while, in a rank process that serves other tests after
(``dist_utils.World`` keeps its processes): as torchrun would set them, restored after."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping


@contextlib.contextmanager
def environment(values: Mapping[str, str], *, also: tuple[str, ...] = ()) -> Iterator[None]:
    """``os.environ`` with ``values`` set; on leaving, those and the variables ``also`` names
    (set by the code inside) are as they were before."""
    saved = {k: os.environ.get(k) for k in (*values, *also)}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
