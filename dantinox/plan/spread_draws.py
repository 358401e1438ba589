"""Correlated step-time draws: a Gaussian-copula AR(1) stream of uniform numbers for CostModel.spread_factor.

The simulator multiplies each step's calibrated cost by a factor drawn from the profile's step-time spread
(CostModel.forward_spread / decode_spread: quantiles of real / fitted step time, mean 1) by inverse transform
sampling: factor = spread_factor(kind, u), u uniform in [0, 1). Drawn independently, a slow step is followed by
an ordinary one; on a real host slow steps come in runs (the clock, the caches or a neighbour process change
for a while), and a run of slow steps queues requests far more than the same slow steps spread out, so the
independent draws under-predict p99 TTFT near capacity (docs/explanation/planning.md, "Step-time correlation").

The stream here keeps every u exactly uniform, so each step's factor still has the stored quantiles as its
distribution and its mean stays 1 (throughput is unchanged), and correlates consecutive draws through a
latent Gaussian AR(1) process (the Gaussian copula of a stationary Markov chain: H. Joe, "Multivariate Models
and Dependence Concepts", 1997, section 8.1; X. Chen and Y. Fan, "Estimation of copula-based semiparametric time
series models", J. Econometrics 2006):

  z_0 ~ N(0, 1),   z_t = rho z_(t-1) + sqrt(1 - rho^2) e_t,   e_t ~ N(0, 1) i.i.d.,   u_t = Phi(z_t)

z_t is N(0, 1) at every t (stationary), so u_t is uniform; corr(z_t, z_(t+k)) = rho^k. rho is fitted by
``profile.spread_correlation`` from the calibration steps (the lag-1 correlation of their normal scores) and
stored as CostModel.spread_correlation. rho = 0 gives exactly the independent stream of before (the same
random.Random draws, byte for byte), so a profile without the field simulates as it did.
"""

from __future__ import annotations

import math
import random


def check_correlation(name: str, rho) -> float:
    """float(rho) when it is a number in [0, 1); ValueError naming ``name`` otherwise (1 would freeze the
    stream at its first draw; a negative lag-1 correlation of slow steps is not modelled)."""
    if isinstance(rho, (bool, str)) or not isinstance(rho, (int, float)) or not 0.0 <= float(rho) < 1.0:
        raise ValueError(f"{name}={rho!r} is not allowed: a number in [0, 1) (the lag-1 correlation of step times)")
    return float(rho)


class SpreadDraws:
    """A seeded stream of uniform numbers in [0, 1), consecutive ones correlated through the Gaussian-copula
    AR(1) process of the module docstring (rho = 0: independent, the plain ``random.Random(seed)`` stream).
    Deterministic: the same (rho, seed) gives the same stream."""

    def __init__(self, rho: float = 0.0, seed: int = 0):
        self.rho = check_correlation("rho", rho)
        self._rng = random.Random(seed)
        self._z: float | None = None     # the latent N(0, 1) state; None before the first draw

    def random(self) -> float:
        """The next uniform number (the name of random.Random's method: the simulator draws with either)."""
        if self.rho == 0.0:
            return self._rng.random()
        e = self._rng.gauss(0.0, 1.0)
        self._z = e if self._z is None else self.rho * self._z + math.sqrt(1.0 - self.rho ** 2) * e
        return min(0.5 * math.erfc(-self._z / math.sqrt(2.0)), math.nextafter(1.0, 0.0))   # Phi(z) in [0, 1)
