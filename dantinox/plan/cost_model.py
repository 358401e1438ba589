"""The cost model the simulator advances its clock by: seconds per compiled call of the serving engine.

Fitted by ``dantinox.plan.profile`` from timed calls, kept in profile.json with the measured points. Letters:
B batch rows of a call, T chunk tokens, S attended tokens (block-table width M x block size P), n iterations
of a multi-step decode call.

  forward_step(B, T)       the measured (B, T) point; else a0 + a1 B + a2 B T (least squares, clipped at 0)
  decode_steps(B, S, n)    for a measured batch B: linear in n between the two measured n, then linear in S
                           between the measured S (both measured per B: one row runs a matrix-vector kernel,
                           two or more a matrix-matrix one, so cost is not linear in B); else
                           c0 + n (d0 + d1 B + d2 B S)
  verify(B, k)             a speculative verify call: forward_step over B rows x (k + 1) tokens: the measured
                           "B,k+1" point of ``plan profile --spec-tokens k`` (verify_points) when there is one,
                           else forward_step(B, k + 1) above (derived: T = k + 1 <= 17 lies between the
                           measured B x 1 decode points and the B x 8.. chunk points the fit is made on)
  swap out / swap in       seconds per preempted (read) / resumed (written) request
  copy_blocks              seconds per copy-on-write call
  step                     seconds every step costs besides its calls (0 from a profile)
  calibration              a real step of forward_step calls costs forward_overhead + scale x (its calls' cost);
                           a multi-step decode step costs decode_overhead + decode_scale x (its call's cost).
                           Fitted on real steps of the engine (host work per step, dispatch and fetch, calls
                           running slower among other calls than alone), see profile.calibrate_steps
  spread                   forward_spread / decode_spread: the 21 quantiles (probabilities 0, 0.05, .., 1) of a
                           calibration step's wall time divided by its calibrated cost h + s x calls, per kind,
                           scaled so that a draw's mean is 1 (the spread adds variance, not cost).
                           The simulator multiplies each step's calibrated cost by one draw from them (inverse
                           transform sampling from a seeded stream: the same inputs give the same plan), so the
                           steps vary as the real ones did around the fit. Queueing delay grows with the
                           variance of service times, not only their mean (Kingman's formula, J. F. C. Kingman,
                           "The single server queue in heavy traffic", 1961), so a plan priced at the mean cost
                           of every step under-predicts p99 TTFT; empty (profiles before 2026-12-04): factor 1
  spread_correlation       rho in [0, 1): consecutive steps' draws are correlated through a Gaussian-copula AR(1)
                           process (spread_draws.SpreadDraws; each draw's distribution is still the quantiles
                           above, mean 1), fitted as the lag-1 correlation of the calibration steps' normal
                           scores (profile.spread_correlation): real slow steps come in runs. 0 (profiles
                           without it): independent draws, as before
  wake                     ((idle seconds g, extra seconds, slower fraction), ...): after the engine sat idle
                           for g seconds, its first step costs wake_cost(g) more, and the steps that start
                           within cold_window seconds of that wake-up cost (1 + cold_fraction(g)) times more
                           (a CPU's caches, clock and the runtime's worker threads go cold while idle, and warm
                           up over a few steps; measured by profile.measure_wake), linear between the points
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

from .spread_draws import check_correlation


@dataclass(frozen=True)
class CostModel:
    """Seconds per call (see the module docstring). ``points``: measured forward_step seconds by "B,T";
    ``decode_points``: measured decode_steps seconds by "B,S,n"; ``verify_points``: measured verify calls
    (forward_step seconds) by "B,T", T = k + 1."""

    forward: tuple = (0.0, 0.0, 0.0)
    decode_call: float = 0.0
    decode_iter: tuple = (0.0, 0.0, 0.0)
    swap_out: float = 0.0
    swap_in: float = 0.0
    copy: float = 0.0
    step: float = 0.0
    forward_overhead: float = 0.0
    scale: float = 1.0
    decode_overhead: float = 0.0
    decode_scale: float = 1.0
    wake: tuple = ()
    cold_window: float = 0.0
    forward_spread: tuple = ()
    decode_spread: tuple = ()
    spread_correlation: float = 0.0
    points: dict = field(default_factory=dict)
    decode_points: dict = field(default_factory=dict)
    verify_points: dict = field(default_factory=dict)

    def __post_init__(self):
        check_correlation("cost model: field 'spread_correlation'", self.spread_correlation)
        object.__setattr__(self, "_grid", _decode_grid(self.decode_points))   # not a field: not serialized

    def forward_cost(self, B: int, T: int) -> float:
        """Seconds of one forward_step call of B rows x T tokens."""
        hit = self.points.get(f"{B},{T}")
        if hit is not None:
            return hit
        a0, a1, a2 = self.forward
        return a0 + a1 * B + a2 * B * T

    def verify_cost(self, B: int, k: int) -> float:
        """Seconds of one speculative verify call: B rows x (k + 1) tokens (the module docstring)."""
        hit = self.verify_points.get(f"{B},{k + 1}")
        return hit if hit is not None else self.forward_cost(B, k + 1)

    def verify_measured(self, k: int) -> bool:
        """True when a verify call of k proposals was profiled (at any batch), False when it is derived."""
        return any(key.split(",")[1] == str(k + 1) for key in self.verify_points)

    def decode_cost(self, B: int, S: int, n: int) -> float:
        """Seconds of one decode_steps call: B rows, S attended slots (M x P), n iterations."""
        measured = self._grid.get(B)
        if measured is not None:
            return _interpolate(measured, S, n)
        d0, d1, d2 = self.decode_iter
        return self.decode_call + n * (d0 + d1 * B + d2 * B * S)

    def step_seconds(self, multi_step: bool, calls: float, idle: float = 0.0, warming: float = 0.0,
                     draw: float | None = None) -> float:
        """Seconds of one engine step whose device calls cost ``calls`` seconds (their profiled sum, swaps and
        copies included): the fixed step cost, the wake-up after ``idle`` seconds, and the calibrated h + s x
        calls of its kind (multi_step: a multi-step decode call, else forward_step calls), slower by the cold
        fraction while ``warming`` (seconds idle before the current busy period, 0 outside cold_window), times
        the spread factor at ``draw`` (a uniform number in [0, 1); None: factor 1)."""
        h, s = (self.decode_overhead, self.decode_scale) if multi_step else (self.forward_overhead, self.scale)
        factor = 1.0 if draw is None else self.spread_factor(multi_step, draw)
        return self.step + self.wake_cost(idle) + (1.0 + self.cold_fraction(warming)) * factor * (h + s * calls)

    def spread_factor(self, multi_step: bool, draw: float) -> float:
        """The ratio real / calibrated step time at quantile ``draw`` in [0, 1] of the step kind's spread,
        linear between the stored quantiles (1.0 with no spread stored)."""
        q = self.decode_spread if multi_step else self.forward_spread
        if not q:
            return 1.0
        x = min(max(draw, 0.0), 1.0) * (len(q) - 1)
        k = min(int(x), len(q) - 2)
        return q[k] + (q[k + 1] - q[k]) * (x - k)

    def wake_cost(self, idle: float) -> float:
        """Extra seconds of the first step after ``idle`` seconds without work (0 when never measured)."""
        return self._after_idle(idle, 1)

    def cold_fraction(self, idle: float) -> float:
        """How much slower (a fraction) the steps within cold_window of a wake-up after ``idle`` seconds run."""
        return self._after_idle(idle, 2)

    def _after_idle(self, idle: float, column: int) -> float:
        """Column of ``wake`` at ``idle``: linear from (0, 0) through the points, the last value beyond."""
        if not self.wake or idle <= 0:
            return 0.0
        gaps = [0.0] + [p[0] for p in self.wake]
        values = [0.0] + [p[column] for p in self.wake]
        k = bisect.bisect_right(gaps, idle)
        if k >= len(gaps):
            return values[-1]
        g0, g1, v0, v1 = gaps[k - 1], gaps[k], values[k - 1], values[k]
        return v0 + (v1 - v0) * (idle - g0) / (g1 - g0)

    def to_dict(self) -> dict:
        """Every field (JSON-ready; tuples as lists); verify_points only when measured (profiles without
        speculation keep their bytes)."""
        d = asdict(self)
        d["forward"], d["decode_iter"] = list(self.forward), list(self.decode_iter)
        d["wake"] = [list(p) for p in self.wake]
        d["forward_spread"], d["decode_spread"] = list(self.forward_spread), list(self.decode_spread)
        if not self.verify_points:
            del d["verify_points"]
        for name in ("forward_spread", "decode_spread"):   # profiles without a spread keep their bytes
            if not d[name]:
                del d[name]
        if not self.spread_correlation:                     # nor those without a correlation
            del d["spread_correlation"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Raises ValueError naming the first field that is missing (a required one) or not of its type."""
        if not isinstance(d, dict):
            raise ValueError(f"cost model: {type(d).__name__} is not allowed: a mapping of its fields")
        required = ("forward", "decode_call", "decode_iter", "swap_out", "swap_in", "copy", "step")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"cost model: field {missing[0]!r} is missing")
        kwargs = {}
        for name, kind in _FIELD_KINDS.items():
            if name in d:
                kwargs[name] = _parse_field(name, kind, d[name])
        return cls(**kwargs)


_FIELD_KINDS = {"forward": "triple", "decode_call": "number", "decode_iter": "triple", "swap_out": "number",
                "swap_in": "number", "copy": "number", "step": "number", "forward_overhead": "number",
                "scale": "number", "decode_overhead": "number", "decode_scale": "number", "wake": "points",
                "cold_window": "number", "points": "seconds", "decode_points": "seconds",
                "verify_points": "seconds", "forward_spread": "quantiles", "decode_spread": "quantiles",
                "spread_correlation": "correlation"}


def _number(x) -> float:
    """float(x) for an int or float (TypeError for a string, a bool or anything else)."""
    if isinstance(x, (bool, str)) or not isinstance(x, (int, float)):
        raise TypeError
    return float(x)


def _parse_field(name: str, kind: str, value):
    """One cost-model field as its dataclass type; ValueError naming the field and what is allowed."""
    allowed = {"number": "a number", "triple": "a list of 3 numbers", "points": "a list of lists of numbers",
               "seconds": "a mapping of shape keys to seconds",
               "quantiles": "an empty list or 2 or more ascending positive numbers",
               "correlation": "a number in [0, 1)"}[kind]
    try:
        if kind == "number":
            return _number(value)
        if kind == "correlation":
            rho = _number(value)
            if not 0.0 <= rho < 1.0:
                raise TypeError
            return rho
        if kind == "seconds":
            if not isinstance(value, dict):
                raise TypeError
            return {str(k): _number(v) for k, v in value.items()}
        if not isinstance(value, (list, tuple)):
            raise TypeError
        if kind == "quantiles":
            q = tuple(_number(x) for x in value)
            if len(q) == 1 or any(x <= 0 for x in q) or any(b < a for a, b in zip(q, q[1:])):
                raise TypeError
            return q
        if kind == "triple":
            if len(value) != 3:
                raise TypeError
            return tuple(_number(x) for x in value)
        return tuple(tuple(_number(v) for v in p) for p in value)
    except TypeError:
        raise ValueError(f"cost model: field {name!r} = {str(value)[:40]!r} is not allowed: {allowed}") from None


def _decode_grid(points: dict) -> dict:
    """{B: {S: {n: seconds}}} from "B,S,n" keys."""
    grid: dict = {}
    for key, seconds in points.items():
        B, S, n = (int(v) for v in key.split(","))
        grid.setdefault(B, {}).setdefault(S, {})[n] = seconds
    return grid


def _line(xs: list, ys: list, x: float) -> float:
    """Linear interpolation (extrapolation beyond the ends) through the points (xs ascending)."""
    if len(xs) == 1:
        return ys[0]
    k = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _in_n(by_n: dict, n: int) -> float:
    """Seconds of n iterations from {n: seconds}: linear through the measured n; below the smallest one,
    linear from (0, the line's intercept clipped at 0) to that point, so a short call never costs <= 0."""
    ns = sorted(by_n)
    if n >= ns[0]:
        return _line(ns, [by_n[k] for k in ns], n)
    low = by_n[ns[0]]
    intercept = max(_line(ns, [by_n[k] for k in ns], 0), 0.0) if len(ns) > 1 else 0.0
    intercept = min(intercept, low)
    return intercept + (low - intercept) * n / ns[0]


def _interpolate(by_s: dict, S: int, n: int) -> float:
    """decode_steps seconds at (S, n) from one batch size's measured {S: {n: seconds}}: in n (_in_n), then
    linear in S (beyond the measured S: the nearer end's slope, the result at least the nearest point's
    seconds scaled by S)."""
    s_values = sorted(by_s)
    at_s = [_in_n(by_s[s], n) for s in s_values]
    value = _line(s_values, at_s, S)
    if S < s_values[0] and value <= 0:
        value = at_s[0] * S / s_values[0]
    return value


def constant(seconds: float) -> CostModel:
    """Every step costs ``seconds`` whatever it runs (used to compare orders with the real engine)."""
    return CostModel(step=seconds)
