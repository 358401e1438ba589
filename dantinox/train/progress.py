"""How training shows its progress to a person: a tqdm bar on a terminal, plain lines anywhere else.

When stderr is a terminal, a tqdm bar (steps, loss, validation loss, tokens/s, its own ETA) is redrawn in
place, and the trainer's log lines are written above it. When it is not (the output goes to a file, a pipe, a
batch system's log), a bar would write nothing a reader can follow, so a plain line is logged instead every
``every_s`` seconds of wall time (the first once ``every_s`` has passed since the steps began; 0: after every
step), as nanoGPT prints one every ``log_interval`` iterations and the HF Trainer one every ``logging_steps``::

    step 120/600  loss 2.3456  lr 9.87e-04  12,345 tok/s  ETA 3m12s

loss is the latest training batch's (nats per token), lr the learning rate of that step, tok/s the training
tokens per second of step time since the last validation run, and ETA the wall time the remaining steps of this
call take at the rate measured since its first step ended (so the compilation of the first step is left out
once a second step is done; evaluations and checkpoints are counted). Lines given to ``print`` are flushed at
once, so a file being written shows each line as it is logged.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

from tqdm.auto import tqdm

DEFAULT_EVERY_S = 30.0   # seconds between two plain progress lines


# ``print`` flushed at once (stdout to a file is block-buffered otherwise: minutes without a line); the trainer's
# default log, as ``print`` itself was
flushed_print = functools.partial(print, flush=True)


class StepProgress:
    """The progress of one call's steps: ``update`` after every step, ``emit`` for other log lines, ``close``.

    total: the run's steps (the bar's length); initial: the step this call starts at; until: the step it stops
    at; log: where lines go (``print`` means the console: flushed, and above the bar on a terminal); enabled:
    False shows nothing (--no_progress); every_s: seconds between plain lines (>= 0); terminal: whether stderr is
    a terminal (None: ask it); clock: seconds, monotonic (a test passes its own)."""

    def __init__(self, total: int, initial: int, until: int, log: Callable[[str], None], enabled: bool = True,
                 every_s: float = DEFAULT_EVERY_S, terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not (enabled and terminal))
        console = log is print or log is flushed_print
        self.emit = self.bar.write if (console and not self.bar.disable) else flushed_print if console else log
        self.plain = enabled and not terminal
        self.total, self.until, self.every_s, self.clock = total, until, every_s, clock
        self.began = self.last_line = self.clock()
        self.first: tuple[int, float] | None = None   # (step, time) at the end of this call's first step

    def update(self, step: int, loss: float, lr: float, tok_s: float, val: float) -> None:
        """After step ``step``: advance the bar, or log a plain line when ``every_s`` has passed."""
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}", tok_s=f"{tok_s:,.0f}")
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        if not self.plain or now - self.last_line < self.every_s:
            return
        self.last_line = now
        line = f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}"
        if step == self.first[0]:   # no rate yet: the first step's time is mostly compilation
            self.emit(f"{line}  (first step {format_duration(now - self.began)}, compilation included)")
        else:
            self.emit(f"{line}  {tok_s:,.0f} tok/s  ETA {self.eta(step, now)}")

    def eta(self, step: int, now: float) -> str:
        """The wall time the steps left until ``until`` take at the rate measured since the end of the first
        step (``step`` must be past it), as "1h02m", "3m12s" or "45s"."""
        first_step, first_time = self.first
        per_step = (now - first_time) / max(step - first_step, 1)
        return format_duration(max(self.until - step, 0) * per_step)

    def close(self) -> None:
        """Close the bar (a no-op for plain lines)."""
        self.bar.close()


def format_duration(seconds: float) -> str:
    """Seconds as "1h02m", "3m12s" or "45s" (rounded to the second)."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
