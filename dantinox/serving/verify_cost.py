"""The engine's measured verify cost: c(B) = a verify call's wall time over B decode rows divided by a plain
decode step's over the same rows, from the calls the engine actually runs. Plain Python, no device.

The switch-off rule (``speculation``'s module docstring, the Generator's ``speculative_generate.break_even``)
needs c(B); serve's --spec-verify-cost gives it by hand (``SpecConfig.verify_costs``). Without it the engine
times its own calls: host wall seconds from dispatch to the fetched result (the fetch waits for the device) of
each verify call and each plain decode call (a multi-step decode call counts as its steps: seconds / steps), per
batch bucket B (the padded rows of the compiled call). The first call of each compiled shape (kind, B, M) is not
timed (it may compile). c(B) is the median of the last WINDOW verify times over the median of the last WINDOW
plain step times. Until MIN_SAMPLES plain steps are timed for B, the engine probes: it runs plain steps
(``needs_plain``), as the static-cache Generator measures its plain step before speculating; until MIN_SAMPLES
verify calls are timed, c(B) is 1.0 (speculation runs, so its cost gets measured, and each row's acceptance
probes go on as before).
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 5        # most recent timings per (kind, B) in the running median
MIN_SAMPLES = 2   # timings per (kind, B) before the median is used


class VerifyCostMeter:
    """Running medians of verify-call and plain-decode-step wall times per batch bucket B (rows of the compiled
    call, an int >= 1), and their ratio c(B). Times are host seconds (float > 0); ``steps``: the decode steps a
    plain call ran (>= 1). Raises ValueError naming the field on a bad time, step count or bucket."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES):
        if not isinstance(window, int) or not isinstance(min_samples, int) or not 1 <= min_samples <= window:
            raise ValueError(f"window={window!r}, min_samples={min_samples!r} are not allowed: integers with "
                             "1 <= min_samples <= window")
        self.window, self.min_samples = window, min_samples
        self.times: dict[tuple[str, int], deque] = {}
        self.seen: set[tuple] = set()

    def plain(self, B: int, M: int, seconds: float, steps: int = 1) -> None:
        """Book a plain decode call over bucket B (table bucket M) of ``steps`` steps taking ``seconds``."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r} is not allowed: an integer >= 1")
        self._book("plain", B, M, seconds, steps)

    def verify(self, B: int, M: int, seconds: float) -> None:
        """Book a verify call over bucket B (table bucket M) taking ``seconds``."""
        self._book("verify", B, M, seconds, 1)

    def needs_plain(self, B: int) -> bool:
        """True while fewer than min_samples plain steps of bucket B are timed: the engine probes plain."""
        return len(self.times.get(("plain", B), ())) < self.min_samples

    def cost(self, B: int) -> float:
        """c(B): median verify time over median plain step time; 1.0 while either has fewer than min_samples
        timings."""
        plain, verify = self.times.get(("plain", B), ()), self.times.get(("verify", B), ())
        if len(plain) < self.min_samples or len(verify) < self.min_samples:
            return 1.0
        return statistics.median(verify) / statistics.median(plain)

    def _book(self, kind: str, B: int, M: int, seconds: float, steps: int) -> None:
        if not isinstance(B, int) or B < 1:
            raise ValueError(f"B={B!r} is not allowed: batch rows, an integer >= 1")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"seconds={seconds!r} is not allowed: a wall time > 0")
        shape = (kind, B, M)
        if shape not in self.seen:   # a compiled shape's first call may include its compilation
            self.seen.add(shape)
            return
        self.times.setdefault((kind, B), deque(maxlen=self.window)).append(seconds / steps)
