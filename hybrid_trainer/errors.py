"""Errors the trainer raises when it cannot keep its promises."""
from __future__ import annotations


class TrainingStalledError(RuntimeError):
    """The guard could not make progress: steps were refused ``max_refused_in_a_row`` times in a row, or
    weights, buffers or optimizer state turned non-finite, and restoring the last good state once did not
    help (or there was none). The message names what is non-finite.

    Attributes:
        non_finite: names of the non-finite tensors (``"weight 0.weight"``, ``"buffer 1.running_mean"``,
            ``"optimizer state 0.weight exp_avg_sq"``); empty when everything was finite and only the
            steps kept being refused.
    """

    def __init__(self, message: str, non_finite: list[str] | None = None):
        super().__init__(message)
        self.non_finite = list(non_finite or [])
