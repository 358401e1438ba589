"""The cost model the simulator advances its clock by: seconds per compiled call of the serving engine.

Fitted by ``dantinox.plan.profile`` from timed calls (least squares, coefficients clipped at 0), kept in
profile.json with the measured points. Letters: B batch rows of a call, T chunk tokens, S attended tokens
(block-table width M x block size P).

  forward_step(B, T)          a0 + a1 B + a2 B T                     (a measured (B, T) point is used as is)
  decode_steps(B, S, n)       c0 + n (d0 + d1 B + d2 B S)             one multi-step call of n iterations
  swap out / swap in          seconds per preempted (read) / resumed (written) request
  copy_blocks                 seconds per copy-on-write call
  step                        seconds every step costs besides its calls (0 from a profile)
  forward_overhead, scale     a step of forward_step calls costs step + forward_overhead + scale x (its calls'
                              costs), fitted on a real burst through the engine (host work, dispatch and
                              fetch that isolated timings miss); a multi-step decode step costs step + its call
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CostModel:
    """Seconds per call (see the module docstring). ``points``: measured forward_step seconds by "B,T"."""

    forward: tuple = (0.0, 0.0, 0.0)
    decode_call: float = 0.0
    decode_iter: tuple = (0.0, 0.0, 0.0)
    swap_out: float = 0.0
    swap_in: float = 0.0
    copy: float = 0.0
    step: float = 0.0
    forward_overhead: float = 0.0
    scale: float = 1.0
    points: dict = field(default_factory=dict)

    def forward_cost(self, B: int, T: int) -> float:
        """Seconds of one forward_step call of B rows x T tokens."""
        hit = self.points.get(f"{B},{T}")
        if hit is not None:
            return hit
        a0, a1, a2 = self.forward
        return a0 + a1 * B + a2 * B * T

    def decode_cost(self, B: int, S: int, n: int) -> float:
        """Seconds of one decode_steps call: B rows, S attended slots (M x P), n iterations."""
        d0, d1, d2 = self.decode_iter
        return self.decode_call + n * (d0 + d1 * B + d2 * B * S)

    def to_dict(self) -> dict:
        """Every field (JSON-ready; tuples as lists)."""
        d = asdict(self)
        d["forward"], d["decode_iter"] = list(self.forward), list(self.decode_iter)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Raises ValueError naming a missing or non-numeric field."""
        try:
            return cls(forward=tuple(float(x) for x in d["forward"]), decode_call=float(d["decode_call"]),
                       decode_iter=tuple(float(x) for x in d["decode_iter"]), swap_out=float(d["swap_out"]),
                       swap_in=float(d["swap_in"]), copy=float(d["copy"]), step=float(d["step"]),
                       forward_overhead=float(d.get("forward_overhead", 0.0)), scale=float(d.get("scale", 1.0)),
                       points={str(k): float(v) for k, v in d.get("points", {}).items()})
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"cost model: field {err} is missing or not a number") from None


def constant(seconds: float) -> CostModel:
    """Every step costs ``seconds`` whatever it runs (used to compare orders with the real engine)."""
    return CostModel(step=seconds)
