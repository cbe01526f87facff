"""Warnings attributed to the user's line: the first caller outside this package.

A fixed ``stacklevel`` names the right line only for the one call path it was counted on; the
trainer reaches the same warning from several (a per-step check, a block read, a snapshot)."""
from __future__ import annotations

import sys
import warnings

_PACKAGE = __name__.rpartition(".")[0]


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` at the innermost frame outside ``hybrid_trainer``."""
    level, frame = 2, sys._getframe(1)  # level 2: warn_user's caller
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == _PACKAGE:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
