"""Divergence monitor: decides, one step at a time, whether training has gone wrong.

The trainer asks :meth:`DivergenceMonitor.check` about a candidate loss (and gradient norm) *before* it
accepts a step, and records accepted steps with :meth:`DivergenceMonitor.observe`. Keeping the two apart is
what makes rollback possible: a CRITICAL report on a verification loss means "restore the anchor", and the
rejected loss never enters the statistics that later checks are judged against. When the trainer snapshots
its last good state it calls :meth:`DivergenceMonitor.remember_window`, and after a rollback to that state
:meth:`DivergenceMonitor.rewind_window`: statistics gathered on the abandoned trajectory do not linger, and
the window the good state was judged with judges the steps after it, so a second spike right after a
rollback is refused like the first (an emptied window would leave only the history-free rules).

Signals (units: the loss is whatever the user's loss function returns; gradient norms are global L2 norms
over all parameters, in the same units as the gradients):

========================  ==========  ===========================================================
kind                      severity    rule
========================  ==========  ===========================================================
``nan``                   CRITICAL    loss or grad norm is NaN or +-Inf
``loss_jump``             CRITICAL    loss - max > (``loss_jump_factor`` - 1) x max |loss| over the last
                                      ``window`` accepted losses (from the first one on: no
                                      ``min_history`` needed)
``loss_z``                WARNING /   z = (loss - median) / scale over the last ``window`` accepted
                          CRITICAL    losses; only rises count. scale = max(1.4826 * MAD, sample
                                      std, ``relative_scale_floor`` * abs(median)).
``grad_explosion``        CRITICAL    grad norm > ``grad_explosion_factor`` x median of the last
                                      ``window`` accepted grad norms; while fewer than
                                      ``min_history`` were accepted, grad norm >
                                      ``grad_jump_factor`` x the largest of them
``grad_vanish``           WARNING     grad norm < ``grad_vanish_threshold``
``oscillation``           WARNING     share of sign changes between consecutive loss differences
                                      over the last ``oscillation_window`` differences is above
                                      ``oscillation_threshold`` and the least-squares slope of the
                                      loss over those points is >= 0
========================  ==========  ===========================================================

Why the scale is the larger of the MAD-based and the sample standard deviation: minibatch losses are often
heavy-tailed. The MAD alone measures only the core of the distribution, so ordinary tail batches would score
z > 6 and trigger rollbacks; the sample std grows with the tails and keeps those false alarms rare. The
relative floor stops a nearly constant loss (scale ~ 0) from turning a rounding-level rise into an alarm.

What the z-score does *not* promise: that a loss ten times the step's own scores above the critical threshold.
While the loss falls, the window holds older, higher losses, which raise both its median and its std. Measured
with ``python -m bench.divergence_scores`` (plain AdamW, a default monitor, a loss 10x the step's own): on the
char-LM z was 87 to 347 at steps 12-400 (CRITICAL throughout); on digits z was 123, 17.8, **5.8**, 17.3, 13.1,
15.2 and 21.6 at steps 12, 30, 60, 100, 200, 300 and 400, so at step 60 that loss was only a WARNING (it was
2.1x the largest loss in the window); how low it goes depends on how fast a run's loss falls within the
window. What *is* promised for any run: a loss more than ``loss_jump_factor`` (10) times the largest loss of the window is
refused (``loss_jump``), whatever the z-score and however short the history, and a non-finite one always is.
Why the largest loss of the window rather than the step's own: a single minibatch loss several times its
neighbours is ordinary near a small training loss; ten times the largest of the last ``window`` is not.

Why history-free rules for the first steps: the z-score and the median grad-norm test need ``min_history``
accepted values, and a run (or, before ``rewind_window``, every rollback) began with that many steps in which
only a non-finite value was refused, so a 1e6x loss went through. The two jump rules need one value and are
conservative where a few values are a poor reference: the loss rule compares with the largest loss seen,
which early in a run is the initial, highest one; the grad rule, active only until ``min_history`` norms were
seen, compares with the largest norm seen and asks for 100x (the steady rule asks 10x the median).

Why the z-score reference is the median of the *whole* window rather than the last few values: on a falling
loss the window median sits above the newest values, so the ordinary downward trend can never look like a
rise. The cost is that a rise must clear the older, higher level before it is flagged; the grad-norm and NaN
signals, which need no history, cover the fast blow-ups.

Lone alarms (``blame_lone_alarms_on_the_batch``, on by default). One step cannot tell a batch that is
hard or corrupt from weights that went wrong; the next step can: weights gone wrong make every batch
lose more, a batch only itself. So a critical step right after one that raised nothing critical is
taken for the batch's: a lone loss z-score outlier with an ordinary gradient is tolerated (reported as
a WARNING, its update applied and its loss recorded), any other lone alarm is refused without going
back to the good state; the next critical step in a row is refused and goes back. Why: a batch far
above the window comes round again every epoch (a tail batch, a class learnt late, a new regime), and
the rules refused it each time, so it was never learnt; and going back to the good state threw away
every step since it, for a fault that was the batch's. ``python -m experiments.spike_cost`` measures
both sides, a healthy run whose data changes level and runs with a learning rate gone wrong or corrupt
batches (docs/trainer.md, "What a false alarm costs"). What is given up: the first step of a divergence
that only the z-score sees is applied before the next one is refused (the good state it goes back to
was taken before it).

Runs of hard batches (also ``blame_lone_alarms_on_the_batch``). A run of batches unlike the window
(data the model meets after learning the rest by heart: 1.7 against a window of 0.0002 on the 1 ms
MLP) is critical step after step, so "the next step tells" fails: each run was refused and rolled
back, and the batches were never learnt, where the plain loop took their loss from 1.7 to 0.09 in
two passes over the data and to 0.003 in four. The step right after a rollback runs at the good
state's weights. Those are the weights after an update judged by the loss before it; the step
after the snapshot is the first to see them, and where its loss raised nothing critical
(:attr:`DivergenceMonitor.good_state_seen_healthy`) a step critical at
them again is taken for the batch's. So a run of critical steps that meets such a good state's
weights (:attr:`DivergenceMonitor.at_good_state`) is taken for the batches' from there on: each of
its steps whose loss and gradient norm lie within the jump rules' bounds around the largest the run
has accepted (``loss_jump_factor`` x :attr:`~DivergenceMonitor.highest_loss`, ``grad_explosion_factor``
x :attr:`~DivergenceMonitor.highest_grad_norm`) is a WARNING and its update stands, until a step
raises nothing critical (the guard then takes a good state, :meth:`DivergenceMonitor.blamed_run_ended`).
A learning rate gone wrong shows on the steps after an update, so the step from a good state
taken before it is quiet and starts no run; one taken while it went on unseen can start one, and
then the bounds end it (on the 1 ms MLP, two or three more steps of a learning rate 100 times too
high, until a loss of 369 went back; the run still ended at the clean run's loss). A corrupt batch
(inputs a thousand times larger) lies far above the bounds and is refused even inside a run. What
is left: the first critical steps of a run, before the rollback whose next step meets the good
state, are refused each time the run comes round (``python -m experiments.spike_cost --model
mlp-1ms``; docs/trainer.md, "What a false alarm costs").
"""
from __future__ import annotations

import enum
import math
import sys
from bisect import bisect_left, insort
import numbers
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from statistics import median

__all__ = ["Severity", "DivergenceReport", "DivergenceMonitor", "QuietLimits", "REASON_KINDS"]

#: Keys of :attr:`DivergenceMonitor.counts`, one per kind of signal.
REASON_KINDS = ("nan", "loss_jump", "loss_z", "grad_explosion", "grad_vanish", "oscillation")
# The kinds every saved state holds; later ones are filled with 0 when an older state loads.
_FIRST_REASON_KINDS = ("nan", "loss_z", "grad_explosion", "grad_vanish", "oscillation")

# 1.4826 * MAD estimates the standard deviation of normally distributed data.
_MAD_TO_STD = 1.4826
# Guards the z-score division when the loss median is exactly zero and the window is flat.
_ABSOLUTE_SCALE_FLOOR = 1e-12
_LARGEST = sys.float_info.max
# Relative room left below the loss z-score rule's bound in :meth:`DivergenceMonitor._quiet_bounds`
# (far above the rounding of the rule's own arithmetic, far below any loss difference that matters).
_BOUND_ROOM = 1e-9
_STATE_VERSION = 1


class Severity(enum.IntEnum):
    """How bad a step looks. Ordered, so ``max`` over several signals gives the overall severity."""

    OK = 0
    WARNING = 1
    CRITICAL = 2


@dataclass
class DivergenceReport:
    """Result of one :meth:`DivergenceMonitor.check`.

    ``reasons`` are human-readable sentences; ``kinds`` holds the matching machine-readable kinds (entries of
    :data:`REASON_KINDS`, one per reason, same order) so callers can react without parsing text.
    """

    severity: Severity
    reasons: list[str]
    kinds: list[str] = field(default_factory=list)

    @property
    def critical(self) -> bool:
        """True when the step must not be accepted (the trainer rolls back)."""
        return self.severity >= Severity.CRITICAL


#: The report of a step no rule raised anything on, shared by every such check (nearly every
#: step; building one was most of the check's cost): reports are read, never changed.
QUIET_REPORT = DivergenceReport(severity=Severity.OK, reasons=[], kinds=[])


@dataclass(frozen=True)
class QuietLimits:
    """A loss at most ``loss_ceiling`` and a gradient norm in [``grad_floor``, ``grad_ceiling``]
    raise nothing (:meth:`DivergenceMonitor.quiet_limits`)."""

    loss_ceiling: float
    grad_ceiling: float
    grad_floor: float

    def quiet(self, loss: float, grad_norm: float | None) -> bool:
        # A NaN fails every comparison; the infinities fail the open bounds: neither is ever quiet.
        return (-math.inf < loss <= self.loss_ceiling
                and (grad_norm is None or (self.grad_floor <= grad_norm <= self.grad_ceiling and grad_norm < math.inf)))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require_int(name: str, value, minimum: int, allowed: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def _require_float(name: str, value, ok, allowed: str) -> float:
    if not _is_number(value) or not math.isfinite(float(value)) or not ok(float(value)):
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")
    return float(value)


def _as_optional_float(name: str, value) -> float | None:
    """Accept python/numpy/torch scalars; anything else is a caller bug worth a clear error."""
    if value is None or type(value) is float:  # the trainer's case, on every step: skip the ABC checks
        return value
    if hasattr(value, "item") and not _is_number(value):
        value = value.item()  # 0-d numpy array or torch tensor
    if not _is_number(value):
        raise ValueError(f"{name} must be a real number or None, got {type(value).__name__}")
    return float(value)


def _median_of_sorted(ordered: Sequence[float]) -> float:
    """``statistics.median`` of values already in order (the same arithmetic, without its sort)."""
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


_HIGHEST = ("highest_loss", "highest_grad_norm")


def _finite_or_none(value: float) -> float | None:
    """A largest-accepted value for a JSON-able state: None while nothing was accepted (-inf)."""
    return value if math.isfinite(value) else None


def _highest(state: dict, where: str) -> tuple[float, float]:
    """The largest accepted loss and gradient norm saved in ``state`` (:data:`_HIGHEST`); for a
    state saved before they were, the largest of its own windows (-inf for none)."""
    values = []
    for key, window in zip(_HIGHEST, ("losses", "grad_norms")):
        value = state.get(key)
        if value is None:
            value = max(state[window], default=-math.inf)
        elif not (_is_number(value) and math.isfinite(value)):
            raise ValueError(f"{where}[{key!r}] must be None or a finite number, got {value!r}")
        values.append(float(value))
    return values[0], values[1]


def _fmt(value: float) -> str:
    return f"{value:.3g}"


class DivergenceMonitor:
    """Flags NaNs, loss spikes, exploding/vanishing gradients and loss oscillation.

    Args:
        window: number of accepted steps the loss and grad-norm statistics look back over (>= 2).
        loss_z_warning: loss z-score above which a rise is a WARNING (> 0).
        loss_z_critical: loss z-score above which a rise is CRITICAL (>= loss_z_warning).
        grad_explosion_factor: a grad norm above this multiple of the recent median is CRITICAL (> 1).
        grad_vanish_threshold: a grad norm below this absolute value is a WARNING (>= 0; 0 disables).
        oscillation_window: number of recent loss differences the oscillation test looks at (>= 3).
        oscillation_threshold: share of sign changes above which a non-decreasing loss is a WARNING (0, 1].
        min_history: accepted values needed before the loss z-score and grad-explosion tests run
            (2 <= min_history <= window); below it only the history-free tests apply.
        relative_scale_floor: lower bound of the loss scale as a fraction of abs(median loss) (>= 0).
        loss_jump_factor: a loss more than this many times the largest accepted loss in the window (in
            magnitude: its rise above that loss exceeds ``loss_jump_factor - 1`` times the largest
            ``abs(loss)`` there) is CRITICAL from the first accepted loss on (> 1).
        grad_jump_factor: while fewer than ``min_history`` grad norms were accepted, one above this multiple
            of the largest of them is CRITICAL (> 1).
        max_refused_in_a_row: refused steps in a row (:meth:`record_refusal`, with no accepted step between)
            after which :attr:`stalled` is True: the trainer then restores its last good state once and, if
            that does not get it going, stops with an error (>= 1).
        blame_lone_alarms_on_the_batch: a critical step right after one that raised nothing
            critical (a lone alarm) is taken for the batch's fault, not the weights': when its only
            critical finding is the loss z-score, it is a WARNING (its reasons say so; counted in
            :attr:`tolerated`) and its update stands; any other (a loss jump, an exploding or
            non-finite gradient) is refused without going back to the good state
            (:meth:`StepGuard.refuse_update`). The next critical step in a row is the weights':
            refused, and a finite one goes back to the good state, unless the run met the good
            state's weights (then the batches', within bounds; module docstring, "Runs of hard
            batches"). False: every critical step is refused and every finite one goes back (the
            rule before). Module docstring, "Lone alarms".
        blame_runs_at_the_good_state: with ``blame_lone_alarms_on_the_batch``, a run of critical
            steps that meets the weights of a good state seen healthy, right after a rollback, is
            taken for the batches' (module docstring, "Runs of hard batches"). False: such a run
            is refused and goes back at each step, as before the rule.
    """

    def __init__(
        self,
        window: int = 50,
        loss_z_warning: float = 3.0,
        loss_z_critical: float = 6.0,
        grad_explosion_factor: float = 10.0,
        grad_vanish_threshold: float = 1e-10,
        oscillation_window: int = 20,
        oscillation_threshold: float = 0.85,
        min_history: int = 10,
        relative_scale_floor: float = 0.01,
        loss_jump_factor: float = 10.0,
        grad_jump_factor: float = 100.0,
        max_refused_in_a_row: int = 20,
        blame_lone_alarms_on_the_batch: bool = True,
        blame_runs_at_the_good_state: bool = True,
    ):
        self.window = _require_int("window", window, 2, ">= 2")
        self.loss_z_warning = _require_float("loss_z_warning", loss_z_warning, lambda v: v > 0, "> 0")
        self.loss_z_critical = _require_float(
            "loss_z_critical", loss_z_critical, lambda v: v >= self.loss_z_warning,
            f">= loss_z_warning ({self.loss_z_warning})",
        )
        self.grad_explosion_factor = _require_float(
            "grad_explosion_factor", grad_explosion_factor, lambda v: v > 1, "> 1"
        )
        self.grad_vanish_threshold = _require_float(
            "grad_vanish_threshold", grad_vanish_threshold, lambda v: v >= 0, ">= 0"
        )
        self.oscillation_window = _require_int("oscillation_window", oscillation_window, 3, ">= 3")
        self.oscillation_threshold = _require_float(
            "oscillation_threshold", oscillation_threshold, lambda v: 0 < v <= 1, "in (0, 1]"
        )
        self.min_history = _require_int("min_history", min_history, 2, f"in [2, window={self.window}]")
        if self.min_history > self.window:
            raise ValueError(f"min_history must be an integer in [2, window={self.window}], got {min_history!r}")
        self.relative_scale_floor = _require_float(
            "relative_scale_floor", relative_scale_floor, lambda v: v >= 0, ">= 0"
        )
        self.loss_jump_factor = _require_float("loss_jump_factor", loss_jump_factor, lambda v: v > 1, "> 1")
        self.grad_jump_factor = _require_float("grad_jump_factor", grad_jump_factor, lambda v: v > 1, "> 1")
        self.max_refused_in_a_row = _require_int("max_refused_in_a_row", max_refused_in_a_row, 1, ">= 1")
        if not isinstance(blame_lone_alarms_on_the_batch, bool):
            raise ValueError(f"blame_lone_alarms_on_the_batch must be a bool, got {blame_lone_alarms_on_the_batch!r}")
        self.blame_lone_alarms_on_the_batch = blame_lone_alarms_on_the_batch
        if not isinstance(blame_runs_at_the_good_state, bool):
            raise ValueError(f"blame_runs_at_the_good_state must be a bool, got {blame_runs_at_the_good_state!r}")
        self.blame_runs_at_the_good_state = blame_runs_at_the_good_state

        # The oscillation test needs oscillation_window + 1 losses, which may exceed the z-score window.
        self._loss_capacity = max(self.window, self.oscillation_window + 1)
        self._losses: deque[float] = deque(maxlen=self._loss_capacity)
        # Kept in step with _losses by _record_loss, so that the oscillation test, which runs on every
        # step, need not rebuild the differences: for the most recent pairs of consecutive differences
        # of accepted losses, whether they change sign; and the last difference.
        self._sign_changes: deque[bool] = deque(maxlen=self.oscillation_window - 1)
        self._sign_change_count = 0  # sum(self._sign_changes), kept in step with it
        self._last_difference: float | None = None
        self._grad_norms: deque[float] = deque(maxlen=self.window)
        # Sorted copies of the last ``window`` accepted losses and of the grad-norm window, kept in
        # step on every accepted value: the per-step rules read their median, largest and smallest
        # by index instead of sorting or scanning up to ``window`` floats per check (the monitor was
        # the largest Python cost of a step). Same values, so the same decisions, bit for bit.
        self._losses_sorted: list[float] = []
        self._grad_norms_sorted: list[float] = []
        self.counts: dict[str, int] = {kind: 0 for kind in REASON_KINDS}
        self.refused_in_a_row = 0  # refused steps since the last accepted one (record_refusal)
        # Critical checks in a row (tolerated ones included), ended by a check or a quiet step
        # that raises nothing critical: a lone outlier is one with none before it.
        self.critical_in_a_row = 0
        # Critical steps reported as warnings, their updates applied (blame_lone_alarms_on_the_batch):
        # lone outliers and the steps of runs taken for the batches'.
        self.tolerated = 0
        self._remembered: tuple | None = None  # the window at the last good state (remember_window)
        # A rollback rewound the window and no good state has been taken since: a guard that
        # reads its checks once per block reads them every step meanwhile (StepGuard.defers).
        self.rewound = False
        # The largest loss and gradient norm accepted since the run began (rewound with the window):
        # how high this run's healthy steps have gone, the range a hard batch's values must lie in
        # to be taken for the batch's (_blamed_on_batches).
        self.highest_loss = -math.inf
        self.highest_grad_norm = -math.inf
        # The weights are the good state's, just restored by a rollback, with no step accepted since,
        # and the first step judged at them after it was taken raised no critical loss alarm.
        self.at_good_state = False
        # A good state's weights are those after an update whose step was judged before it: they are
        # seen first by the next step, which remember_window leaves to judge them (_judge_snapshot).
        self._snapshot_unjudged = False
        self.good_state_seen_healthy = False
        # The run of critical checks going on met the good state's weights (_blamed_on_batches).
        self._run_blamed = False
        # (loss ceiling, grad-norm floor, grad-norm ceiling) inside which a step is surely quiet
        # against the window as it is; None when the window changed since (_quiet_bounds).
        self._bounds: tuple[float, float, float] | None = None

    # ------------------------------------------------------------------ recording
    def observe(self, loss: float | None, grad_norm: float | None = None) -> None:
        """Record an accepted step. Non-finite (or None) values are ignored, so they never poison the baseline."""
        # The trainer passes floats on every step: no conversion call for them.
        loss_value = loss if type(loss) is float else _as_optional_float("loss", loss)
        grad_value = grad_norm if type(grad_norm) is float else _as_optional_float("grad_norm", grad_norm)
        # A step tolerated from a run of critical ones (critical_in_a_row) widens the window, not the
        # range such steps must lie in (_blamed_on_batches): runs cannot raise it run after run.
        quiet = self.critical_in_a_row == 0
        if loss_value is not None and -math.inf < loss_value < math.inf:  # NaN fails both
            self._record_loss(loss_value, quiet)
        if grad_value is not None and -math.inf < grad_value < math.inf:
            self._record_grad_norm(grad_value, quiet)
        self.refused_in_a_row = 0
        self.at_good_state = False
        self._bounds = self._quiet_bounds()  # here, where the window was just read: the next check only compares

    def _record_loss(self, loss: float, raise_highest: bool) -> None:
        """Append an accepted loss to the window (``raise_highest``: and to :attr:`highest_loss`)."""
        self._bounds = None
        if raise_highest and loss > self.highest_loss:
            self.highest_loss = loss
        losses = self._losses
        if losses:
            difference = loss - losses[-1]
            if self._last_difference is not None:
                changes = self._sign_changes
                if len(changes) == changes.maxlen:
                    self._sign_change_count -= changes[0]  # dropped by the append
                changed = self._last_difference * difference < 0
                changes.append(changed)
                self._sign_change_count += changed
            self._last_difference = difference
            if len(losses) >= self.window:  # the loss leaving the last-``window`` view
                ordered = self._losses_sorted
                del ordered[bisect_left(ordered, losses[-self.window])]
        insort(self._losses_sorted, loss)
        losses.append(loss)

    def _record_grad_norm(self, grad_norm: float, raise_highest: bool) -> None:
        """Append an accepted gradient norm to the window (``raise_highest``: and to
        :attr:`highest_grad_norm`)."""
        self._bounds = None
        if raise_highest and grad_norm > self.highest_grad_norm:
            self.highest_grad_norm = grad_norm
        norms = self._grad_norms
        if len(norms) == self.window:  # the deque drops its oldest on append
            ordered = self._grad_norms_sorted
            del ordered[bisect_left(ordered, norms[0])]
        insort(self._grad_norms_sorted, grad_norm)
        norms.append(grad_norm)

    def _resort(self) -> None:
        """Rebuild the sorted copies after the windows were replaced wholesale."""
        self._bounds = None
        self._losses_sorted = sorted(list(self._losses)[-self.window:])
        self._grad_norms_sorted = sorted(self._grad_norms)

    def reset_window(self) -> None:
        """Forget the recent loss and grad-norm history; event counts are kept. A trainer that rolls back
        uses :meth:`remember_window` and :meth:`rewind_window` instead, which leave no blind spell."""
        self._bounds = None
        self._losses.clear()
        self._sign_changes.clear()
        self._sign_change_count = 0
        self._last_difference = None
        self._grad_norms.clear()
        self._losses_sorted.clear()
        self._grad_norms_sorted.clear()
        self.highest_loss = self.highest_grad_norm = -math.inf

    def remember_window(self) -> None:
        """Keep a copy of the current history (at most ``window`` + ``oscillation_window`` floats) to go back to
        with :meth:`rewind_window`: the trainer calls it when it snapshots its last good state."""
        self._remembered = (list(self._losses), list(self._sign_changes), self._last_difference,
                            list(self._grad_norms), self.highest_loss, self.highest_grad_norm)
        self.rewound = False
        self._snapshot_unjudged, self.good_state_seen_healthy = True, False

    def rewind_window(self) -> None:
        """Go back to the history kept by :meth:`remember_window` (after a rollback to the good state it was
        kept with), or forget the history when none was kept.

        Why not forget it: an empty history leaves only the history-free rules for ``min_history`` steps, and
        the trajectory just rolled back to is the one the remembered statistics describe, so they judge the
        next steps as well as they judged the steps before the spike. A second spike right after a rollback
        is then refused like the first (with an empty history it was accepted).

        The weights are then the good state's until a step is accepted (:attr:`at_good_state`,
        where the step after it was taken saw them healthy)."""
        self.rewound = True
        self.at_good_state = self._remembered is not None and self.good_state_seen_healthy
        if self._remembered is None:
            self.reset_window()
            return
        losses, sign_changes, last_difference, grad_norms, highest_loss, highest_grad_norm = self._remembered
        self._losses = deque(losses, maxlen=self._loss_capacity)
        self._sign_changes = deque(sign_changes, maxlen=self.oscillation_window - 1)
        self._sign_change_count = sum(self._sign_changes)
        self._last_difference = last_difference
        self._grad_norms = deque(grad_norms, maxlen=self.window)
        self._resort()
        self.highest_loss, self.highest_grad_norm = highest_loss, highest_grad_norm

    def record_refusal(self) -> bool:
        """Count a refused step; returns :attr:`stalled`. An accepted step (:meth:`observe`) ends the run of
        refusals."""
        self.refused_in_a_row += 1
        return self.stalled

    @property
    def stalled(self) -> bool:
        """True once ``max_refused_in_a_row`` steps in a row were refused: the guard is not making progress."""
        return self.refused_in_a_row >= self.max_refused_in_a_row

    @property
    def history_length(self) -> int:
        """Number of accepted losses currently remembered."""
        return len(self._losses)

    # ------------------------------------------------------------------ blocks of steps
    def block_is_quiet(self, values: Sequence[tuple[float, float | None]]) -> bool:
        """Whether every one of a block of steps' ``(loss, grad norm)`` values lies inside the
        window's bounds of a surely quiet step (the ones :meth:`check` compares with first: no
        pass over the window, kept until it changes), as nearly every block's do. Those bounds
        lie inside :meth:`quiet_limits`' (the largest loss, a lower bound of the spread, the
        oscillation test included), so such a block needs no :meth:`quiet_limits`, which passes
        over the window twice, and none of its values a test of its own."""
        if not self._losses:
            return False
        ceiling, floor, grad_ceiling = self._bounds or self._quiet_bounds()
        return all(-math.inf < loss <= ceiling and (norm is None or floor <= norm <= grad_ceiling)
                   for loss, norm in values)

    def quiet_limits(self) -> QuietLimits | None:
        """Bounds inside which a step's loss and gradient norm raise nothing against the window as
        it is now (no loss jump, a loss z-score at most ``loss_z_warning``, a norm neither exploding
        nor vanishing), for judging a block of steps read at once; None while there is no history.
        The oscillation warning is not covered (:meth:`check_oscillation_once`)."""
        losses = self._losses
        if not losses:
            return None
        recent, ordered = list(losses)[-self.window:], self._losses_sorted
        magnitude = max(abs(ordered[0]), abs(ordered[-1]), _ABSOLUTE_SCALE_FLOOR)
        ceiling = ordered[-1] + (self.loss_jump_factor - 1) * magnitude  # the loss_jump rule's bound
        if len(losses) >= self.min_history:  # the z-score rule's: z <= warning
            center = _median_of_sorted(ordered)
            mad_scale = _MAD_TO_STD * median(abs(v - center) for v in recent)
            mean = sum(recent) / len(recent)
            std = math.sqrt(sum((v - mean) ** 2 for v in recent) / (len(recent) - 1))
            ceiling = min(ceiling, center + self.loss_z_warning * max(mad_scale, std, self._scale_floor(center)))
        norms = self._grad_norms
        grad_ceiling = math.inf
        if len(norms) >= self.min_history:
            reference = _median_of_sorted(self._grad_norms_sorted)
            if reference > self.grad_vanish_threshold:
                grad_ceiling = self.grad_explosion_factor * reference
        elif norms:
            highest = self._grad_norms_sorted[-1]
            if highest > self.grad_vanish_threshold:
                grad_ceiling = self.grad_jump_factor * highest
        return QuietLimits(ceiling, grad_ceiling, self.grad_vanish_threshold)

    def observe_quiet(self, loss: float, grad_norm: float | None) -> None:
        """:meth:`observe` for values already found finite and inside :meth:`quiet_limits`."""
        self._record_loss(loss, True)
        if grad_norm is not None:
            self._record_grad_norm(grad_norm, True)
        self.refused_in_a_row = 0
        self.critical_in_a_row = 0
        self.at_good_state = False
        if self._snapshot_unjudged:
            self._judge_snapshot(True)

    def _judge_snapshot(self, healthy: bool) -> None:
        """The first step judged after :meth:`remember_window`, at the good state's weights: whether
        its loss raised nothing critical (:attr:`good_state_seen_healthy`). Its gradient norm is not
        asked: right after a run of batches the model met late, the batches it knew by heart have
        gradients ten times the window's (its median is of a model sure of them), at healthy weights."""
        self._snapshot_unjudged = False
        self.good_state_seen_healthy = healthy

    def check_oscillation_once(self) -> bool:
        """The oscillation test on the accepted losses as they are now, counted as one warning
        when it fires (a block of steps read at once is looked at once)."""
        if not self._check_oscillation(None):
            return False
        self.counts["oscillation"] += 1
        return True

    # ------------------------------------------------------------------ checking
    def check(self, loss: float | None, grad_norm: float | None = None, *, count: bool = True) -> DivergenceReport:
        """Judge a candidate step against the accepted history without recording it.

        Args:
            loss: the step's loss, or None when no loss was computed (only grad tests run then).
            grad_norm: global L2 gradient norm, or None when no backward pass was done.
            count: add the report's kinds to :attr:`counts` and count the check as a step judged (a lone
                alarm, ``blame_lone_alarms_on_the_batch``, is one whose counted check before it raised
                nothing critical). Pass False to re-check the same step without double counting; the
                statistics themselves are never changed by ``check``.
        """
        if type(loss) is float and type(grad_norm) is float:
            bounds = self._bounds
            if bounds is None:
                bounds = self._bounds = self._quiet_bounds()
            # Nearly every step: three compares against bounds computed when the window last changed
            # (a NaN fails them); anything outside goes to the exact test and the rules.
            if (-_LARGEST <= loss <= bounds[0] and bounds[1] <= grad_norm <= bounds[2]) or self._quiet(loss, grad_norm):
                if count:
                    self.critical_in_a_row = 0
                    if self._snapshot_unjudged:
                        self._judge_snapshot(True)
                return QUIET_REPORT
        loss_value = _as_optional_float("loss", loss)
        grad_value = _as_optional_float("grad_norm", grad_norm)
        if grad_value is not None and grad_value < 0:
            raise ValueError(f"grad_norm must be >= 0 (it is a norm), got {grad_value!r}")

        findings: list[tuple[Severity, str, str]] = []  # (severity, kind, reason)

        if loss_value is not None and not math.isfinite(loss_value):
            findings.append((Severity.CRITICAL, "nan", f"loss is {self._name_non_finite(loss_value)}"))
        if grad_value is not None and not math.isfinite(grad_value):
            findings.append((Severity.CRITICAL, "nan", f"grad norm is {self._name_non_finite(grad_value)}"))

        if loss_value is not None and math.isfinite(loss_value):
            findings.extend(self._check_loss_jump(loss_value))
            findings.extend(self._check_loss_z(loss_value))
            findings.extend(self._check_oscillation(loss_value))
        if grad_value is not None and math.isfinite(grad_value):
            findings.extend(self._check_grad(grad_value))

        if not findings:  # nearly every step: skip building the report from an empty list
            if count:
                self.critical_in_a_row = 0
                if self._snapshot_unjudged:
                    self._judge_snapshot(True)
            return QUIET_REPORT
        severity = max((f[0] for f in findings), default=Severity.OK)
        kinds = [f[1] for f in findings]
        reasons = [f[2] for f in findings]
        if count:
            for kind in set(kinds):  # one event per kind per check, even if loss and grad are both NaN
                self.counts[kind] += 1
            if self._snapshot_unjudged:
                self._judge_snapshot(all(kind == "grad_explosion" for level, kind, _ in findings
                                         if level is Severity.CRITICAL))
            if severity is not Severity.CRITICAL:
                self.critical_in_a_row = 0
            else:
                self.critical_in_a_row += 1
                if self.critical_in_a_row == 1:
                    self._run_blamed = False  # a new run of critical checks
                if self.critical_in_a_row == 1 and self._tolerable(findings):
                    severity = Severity.WARNING
                    reasons.append("a lone outlier, tolerated: the step before raised nothing critical")
                    self.tolerated += 1
                elif self._blamed_on_batches(loss_value, grad_value, kinds):
                    severity = Severity.WARNING
                    reasons.append("taken for the batches': this run of critical steps met the good state's "
                                   "weights, and its values lie within the jump rules' bounds around the "
                                   "largest the run has accepted")
                    self.tolerated += 1
        return DivergenceReport(severity=Severity(severity), reasons=reasons, kinds=kinds)

    def _tolerable(self, findings: list[tuple[Severity, str, str]]) -> bool:
        """Whether a lone critical step stands (``blame_lone_alarms_on_the_batch``): its only
        critical finding is the loss z-score. An exploding gradient is what its update would carry
        into the weights, and a loss jump or a non-finite value is no tail of the window."""
        if not self.blame_lone_alarms_on_the_batch:
            return False
        return all(kind == "loss_z" for level, kind, _ in findings if level is Severity.CRITICAL)

    def _blamed_on_batches(self, loss: float | None, grad_norm: float | None, kinds: list[str]) -> bool:
        """Whether a critical step of a run of them stands as the batches' fault
        (``blame_lone_alarms_on_the_batch``): the run met the good state's weights (a critical
        step right after a rollback, :attr:`at_good_state`), and the step's loss and gradient norm
        are finite and within the jump rules' bounds around the largest this run has accepted
        (:attr:`highest_loss`, :attr:`highest_grad_norm`): a loss at most ``loss_jump_factor``
        times the largest, a norm at most ``grad_explosion_factor`` times the largest.

        Why: the good state's weights were seen healthy (:meth:`_judge_snapshot`), so a step that
        is critical at them is the batch's; weights gone wrong (a learning rate too high) show on
        the steps after an update, not on the first one from a good state taken before it, whose
        loss is measured before its update. A run of batches unlike the window (a class or a
        source of data the model meets late, after learning the rest by heart) is critical step
        after step; refused each time, they were never learnt, and each run rolled the weights
        back. Their losses lie in the
        range of the run's own first steps, their norms near it (a model sure of its answers has
        larger gradients on what it gets wrong than it had untrained: 11 against 3.3 on the 1 ms
        MLP); a corrupt batch's (inputs scaled up a thousandfold) lie far above both, and stay
        refused. The run ends at the first step that raises nothing critical."""
        highest = self.highest_loss  # -inf while nothing was accepted: then no bound holds
        if (not (self.blame_lone_alarms_on_the_batch and self.blame_runs_at_the_good_state)
                or loss is None or "nan" in kinds or not math.isfinite(highest)
                or not loss - highest <= (self.loss_jump_factor - 1) * abs(highest)
                or (grad_norm is not None and not grad_norm <= self.grad_explosion_factor * self.highest_grad_norm)):
            return False
        if self.at_good_state:
            self._run_blamed = True
        return self._run_blamed

    def blamed_run_ended(self) -> bool:
        """Whether a run of critical steps taken for the batches' (:meth:`_blamed_on_batches`)
        has just ended with a step that raised nothing critical; True once per such run. The
        guard then takes a good state: that step shows the weights the run trained are healthy,
        and without one the run's next rollback would throw away what it learnt."""
        if self._run_blamed and self.critical_in_a_row == 0:
            self._run_blamed = False
            return True
        return False

    def _quiet_bounds(self) -> tuple[float, float, float]:
        """(loss ceiling, grad-norm floor, grad-norm ceiling): a finite loss at most the ceiling with
        a norm between floor and ceiling passes :meth:`_quiet` against the window as it is now. The
        same tests as :meth:`_quiet`, solved for the loss and the norm; the z-score bound is lowered
        by a relative ``_BOUND_ROOM`` so that the rounding of ``(loss - center) / scale`` cannot
        make a value inside it fail the rule. A value outside is not judged by them: it goes to
        :meth:`_quiet` itself, so the decisions are the same as without the bounds."""
        ordered = self._losses_sorted
        ceiling = ordered[-1] if ordered else _LARGEST  # the loss_jump rule looks further above the largest
        count = len(self._losses)
        if count >= self.min_history:
            center = _median_of_sorted(ordered)
            spread_bound = 0.999 * (ordered[-1] - ordered[0]) / math.sqrt(2 * (len(ordered) - 1))
            allowed = self.loss_z_warning * max(spread_bound, self._scale_floor(center))
            ceiling = min(ceiling, center + allowed - _BOUND_ROOM * (abs(center) + allowed))
        if (count >= self.oscillation_window
                and (self._sign_change_count + 1) / (self.oscillation_window - 1) > self.oscillation_threshold):
            ceiling = -math.inf  # the oscillation test may fire whatever the loss: no step is surely quiet
        norms = self._grad_norms_sorted
        if not norms:
            grad_ceiling = _LARGEST
        elif len(norms) < self.min_history:
            grad_ceiling = self.grad_jump_factor * norms[-1]
        else:
            grad_ceiling = self.grad_explosion_factor * _median_of_sorted(norms)
        return ceiling, self.grad_vanish_threshold, min(grad_ceiling, _LARGEST)

    def _quiet(self, loss: float, grad_norm: float) -> bool:
        """True only when no rule can raise anything on this step: every rule's own early exit,
        in one call (a real step's check is on every step; the rules' calls and the lists they
        return were half of its cost). False sends the step to the rules themselves."""
        if not (-math.inf < loss < math.inf and 0.0 <= grad_norm < math.inf):  # NaN fails every comparison
            return False
        ordered = self._losses_sorted
        if ordered and loss > ordered[-1]:  # the loss_jump rule would look further
            return False
        if len(self._losses) >= self.min_history and not self._z_surely_quiet(loss, _median_of_sorted(ordered)):
            return False
        # Oscillation: the candidate's share counts at most every remembered sign change plus its own.
        if (len(self._losses) >= self.oscillation_window
                and (self._sign_change_count + 1) / (self.oscillation_window - 1) > self.oscillation_threshold):
            return False
        if grad_norm < self.grad_vanish_threshold:
            return False
        norms = self._grad_norms_sorted
        if norms:
            if len(norms) < self.min_history:
                return not grad_norm > self.grad_jump_factor * norms[-1]
            return not grad_norm > self.grad_explosion_factor * _median_of_sorted(norms)
        return True

    @staticmethod
    def _name_non_finite(value: float) -> str:
        if math.isnan(value):
            return "nan"
        return "inf" if value > 0 else "-inf"

    def loss_z_score(self, loss: float) -> float | None:
        """z-score of ``loss`` against the accepted window, or None while the history is too short."""
        recent = self._z_window()
        return None if recent is None else self._z_score(float(loss), recent, median(recent))

    def _z_window(self) -> Sequence[float] | None:
        losses = self._losses
        if len(losses) < self.min_history:
            return None
        # The whole history unless the oscillation test keeps a longer one (no copy on every step).
        return losses if len(losses) <= self.window else list(losses)[-self.window:]

    def _scale_floor(self, center: float) -> float:
        return max(self.relative_scale_floor * abs(center), _ABSOLUTE_SCALE_FLOOR)

    def _z_score(self, loss: float, recent: Sequence[float], center: float) -> float:
        mad_scale = _MAD_TO_STD * median(abs(v - center) for v in recent)
        mean = sum(recent) / len(recent)
        std = math.sqrt(sum((v - mean) ** 2 for v in recent) / (len(recent) - 1))
        return (loss - center) / max(mad_scale, std, self._scale_floor(center))

    def _z_surely_quiet(self, loss: float, center: float) -> bool:
        """An upper bound of ``loss``'s z-score is at most ``loss_z_warning`` (the window's median
        ``center`` given). The scale is at least the sample std, and the two extreme losses alone
        put range²/2 into its sum of squares, so std >= range / sqrt(2 (n - 1)); the 0.999 leaves
        room for the rounding of the computed std. A smaller scale gives a larger z."""
        ordered = self._losses_sorted  # the last ``window`` losses in order: the range by index
        spread_bound = 0.999 * (ordered[-1] - ordered[0]) / math.sqrt(2 * (len(ordered) - 1))
        return (loss - center) / max(spread_bound, self._scale_floor(center)) <= self.loss_z_warning

    def _check_loss_z(self, loss: float) -> list[tuple[Severity, str, str]]:
        if len(self._losses) < self.min_history:
            return []
        center = _median_of_sorted(self._losses_sorted)
        if self._z_surely_quiet(loss, center):  # most steps end here, without the MAD and std passes
            return []
        z = self._z_score(loss, self._z_window(), center)
        # Only rises are divergence: a sudden drop (new data regime, LR decay) is good news.
        if z <= self.loss_z_warning:
            return []
        if z > self.loss_z_critical:
            return [(Severity.CRITICAL, "loss_z", f"loss z-score {z:.1f} > {self.loss_z_critical:g}")]
        return [(Severity.WARNING, "loss_z", f"loss z-score {z:.1f} > {self.loss_z_warning:g}")]

    def _check_loss_jump(self, loss: float) -> list[tuple[Severity, str, str]]:
        ordered = self._losses_sorted  # the last ``window`` accepted losses (fewer early on), in order
        if not ordered:
            return []
        highest = ordered[-1]
        if loss <= highest:  # nearly every step ends here
            return []
        magnitude = max(abs(ordered[0]), abs(highest), _ABSOLUTE_SCALE_FLOOR)
        if loss - highest <= (self.loss_jump_factor - 1) * magnitude:
            return []
        return [(Severity.CRITICAL, "loss_jump",
                 f"loss {_fmt(loss)} > {self.loss_jump_factor:g}x the largest of the last {len(ordered)} "
                 f"accepted losses ({_fmt(highest)})")]

    def _check_grad(self, grad_norm: float) -> list[tuple[Severity, str, str]]:
        findings = []
        if grad_norm < self.grad_vanish_threshold:
            findings.append((Severity.WARNING, "grad_vanish",
                             f"grad norm {_fmt(grad_norm)} < {_fmt(self.grad_vanish_threshold)} (vanishing)"))
        if 0 < len(self._grad_norms) < self.min_history:
            # Too few for a median; the largest seen is a conservative reference (it is at least the median,
            # and the factor is larger), so a blow-up in the first steps or right after a rollback is refused.
            highest = self._grad_norms_sorted[-1]
            if highest > self.grad_vanish_threshold and grad_norm > self.grad_jump_factor * highest:
                findings.append((Severity.CRITICAL, "grad_explosion",
                                 f"grad norm {_fmt(grad_norm)} > {self.grad_jump_factor:g}x the largest of the "
                                 f"{len(self._grad_norms)} accepted so far ({_fmt(highest)})"))
        elif len(self._grad_norms) >= self.min_history:
            reference = _median_of_sorted(self._grad_norms_sorted)
            # A zero (or vanished) reference makes any ratio meaningless; the vanish test covers that regime.
            if reference > self.grad_vanish_threshold and grad_norm > self.grad_explosion_factor * reference:
                findings.append((Severity.CRITICAL, "grad_explosion",
                                 f"grad norm {_fmt(grad_norm)} > {self.grad_explosion_factor:g}x "
                                 f"median {_fmt(reference)}"))
        return findings

    def oscillation_share(self, loss: float | None = None) -> float | None:
        """Share of sign changes between consecutive differences of the last ``oscillation_window`` + 1 losses
        (the accepted ones plus ``loss`` when given), or None while there are too few."""
        if loss is None:
            if len(self._losses) <= self.oscillation_window:
                return None
            changes = sum(self._sign_changes)
        else:
            if len(self._losses) < self.oscillation_window:
                return None
            accepted_pairs = self.oscillation_window - 2  # the last pair is the one that ends at ``loss``
            changes = sum(islice(self._sign_changes, len(self._sign_changes) - accepted_pairs, None))
            changes += self._last_difference * (float(loss) - self._losses[-1]) < 0
        return changes / (self.oscillation_window - 1)

    def _oscillation_points(self, loss: float | None) -> list[float] | None:
        points = list(self._losses)
        if loss is not None:
            points.append(float(loss))
        needed = self.oscillation_window + 1
        return points[-needed:] if len(points) >= needed else None

    @staticmethod
    def _slope(points: list[float]) -> float:
        """Least-squares slope in loss units per step."""
        n = len(points)
        x_mean = (n - 1) / 2
        y_mean = sum(points) / n
        numerator = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(points))
        denominator = sum((i - x_mean) ** 2 for i in range(n))
        return numerator / denominator

    def _check_oscillation(self, loss: float | None) -> list[tuple[Severity, str, str]]:
        """The oscillation rule with ``loss`` appended to the accepted losses (None: on them as they are)."""
        share = self.oscillation_share(loss)
        if share is None or share <= self.oscillation_threshold:
            return []
        slope = self._slope(self._oscillation_points(loss))
        # Zig-zagging on the way down is normal for noisy SGD; it is only a problem when it goes nowhere.
        if slope < 0:
            return []
        return [(Severity.WARNING, "oscillation",
                 f"loss oscillating: {share:.0%} sign changes over {self.oscillation_window} steps "
                 f"> {self.oscillation_threshold:.0%}, slope {_fmt(slope)} >= 0")]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """Plain-python (JSON-able) snapshot: recent history, event counts and, for reference, the settings."""
        return {
            "version": _STATE_VERSION,
            "losses": list(self._losses),
            "grad_norms": list(self._grad_norms),
            "counts": dict(self.counts),
            "refused_in_a_row": self.refused_in_a_row,
            "critical_in_a_row": self.critical_in_a_row,
            "tolerated": self.tolerated,
            "rewound": self.rewound,
            "highest_loss": _finite_or_none(self.highest_loss),
            "highest_grad_norm": _finite_or_none(self.highest_grad_norm),
            "at_good_state": self.at_good_state,
            "run_blamed": self._run_blamed,
            "snapshot_unjudged": self._snapshot_unjudged,
            "good_state_seen_healthy": self.good_state_seen_healthy,
            "remembered": None if self._remembered is None else {
                "losses": list(self._remembered[0]), "sign_changes": list(self._remembered[1]),
                "last_difference": self._remembered[2], "grad_norms": list(self._remembered[3]),
                "highest_loss": _finite_or_none(self._remembered[4]),
                "highest_grad_norm": _finite_or_none(self._remembered[5]),
            },
            "config": {
                "window": self.window,
                "loss_z_warning": self.loss_z_warning,
                "loss_z_critical": self.loss_z_critical,
                "grad_explosion_factor": self.grad_explosion_factor,
                "grad_vanish_threshold": self.grad_vanish_threshold,
                "oscillation_window": self.oscillation_window,
                "oscillation_threshold": self.oscillation_threshold,
                "min_history": self.min_history,
                "relative_scale_floor": self.relative_scale_floor,
                "loss_jump_factor": self.loss_jump_factor,
                "grad_jump_factor": self.grad_jump_factor,
                "max_refused_in_a_row": self.max_refused_in_a_row,
                "blame_lone_alarms_on_the_batch": self.blame_lone_alarms_on_the_batch,
                "blame_runs_at_the_good_state": self.blame_runs_at_the_good_state,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore history and counts from :meth:`state_dict`.

        The monitor's own constructor settings win over ``state["config"]`` (thresholds may be retuned on
        resume); history longer than this monitor's window is truncated to the most recent values. A state
        written before some keys existed (kinds of signal added later, the refusal run, the run of critical
        checks, the tolerated count, the remembered window) loads with zeros and no remembered window for
        them; without the largest accepted loss and gradient norm, the largest of its windows stand for
        them, and the weights are not taken for the good state's.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict from DivergenceMonitor.state_dict(), got {type(state).__name__}")
        missing = {"version", "losses", "grad_norms", "counts"} - state.keys()
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"state version {state['version']!r} is not supported (expected {_STATE_VERSION})")
        for key in ("losses", "grad_norms"):
            values = state[key]
            if not isinstance(values, list) or not all(_is_number(v) and math.isfinite(v) for v in values):
                raise ValueError(f"state[{key!r}] must be a list of finite numbers")
        counts = state["counts"]
        if not isinstance(counts, dict) or not set(_FIRST_REASON_KINDS) <= set(counts) <= set(REASON_KINDS):
            raise ValueError(f"state['counts'] must have the keys {list(REASON_KINDS)}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()):
            raise ValueError("state['counts'] values must be non-negative integers")
        runs = {key: state.get(key, 0) for key in ("refused_in_a_row", "critical_in_a_row", "tolerated")}
        for key, value in runs.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"state[{key!r}] must be a non-negative integer, got {value!r}")
        flags = {key: state.get(key, False) for key in ("rewound", "at_good_state", "run_blamed", "snapshot_unjudged",
                                                         "good_state_seen_healthy")}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"state[{key!r}] must be a bool, got {value!r}")
        highest = _highest(state, "state")
        remembered = state.get("remembered")
        if remembered is not None:
            window_keys = {"losses", "sign_changes", "last_difference", "grad_norms"}
            if not isinstance(remembered, dict) or not window_keys <= set(remembered) <= window_keys | set(_HIGHEST):
                raise ValueError("state['remembered'] must be None or a dict from DivergenceMonitor.state_dict()")
            for key in ("losses", "grad_norms"):
                if not all(_is_number(v) and math.isfinite(v) for v in remembered[key]):
                    raise ValueError(f"state['remembered'][{key!r}] must be a list of finite numbers")
            remembered = (remembered["losses"], [bool(v) for v in remembered["sign_changes"]],
                          remembered["last_difference"], remembered["grad_norms"],
                          *_highest(remembered, "state['remembered']"))

        self.reset_window()
        for value in state["losses"]:
            self._record_loss(float(value), False)  # the saved largest values are set below
        self._grad_norms = deque((float(v) for v in state["grad_norms"]), maxlen=self.window)
        self._resort()
        self.counts = {kind: int(counts.get(kind, 0)) for kind in REASON_KINDS}
        self.refused_in_a_row, self.critical_in_a_row, self.tolerated = runs.values()
        self._remembered = remembered
        (self.rewound, self.at_good_state, self._run_blamed, self._snapshot_unjudged,
         self.good_state_seen_healthy) = flags.values()
        self.highest_loss, self.highest_grad_norm = highest
