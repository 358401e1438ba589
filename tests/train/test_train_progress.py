"""What a person watching a training run sees: plain progress lines (step, loss, lr, tok/s, ETA) when stderr is
not a terminal, flushed as they are written; and a run stopped before the end of its learning-rate schedule (a
resumed 600-step run given --steps 70) says so at the start and in its last line, with the learning rate it
reached, instead of ending "done" at nearly the peak learning rate."""

import csv
import math
import re
import signal
import subprocess
import threading

import pytest
from cli_util import start_cli
from test_train import RUN, TEXT, tiny_cfg

from dantinox.runs.run_dir import read_summary
from dantinox.train.progress import StepProgress, format_duration
from dantinox.train.trainer import TrainError, train

LINE = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d{4})  lr (\S+)  ([\d,]+) tok/s  ETA (\S+)$")


def _reference_lr(step: int, peak: float, end: float, warmup: int, total: int) -> float:
    """Linear warmup from 0, then cosine from peak to end at ``total`` (written out, not optax)."""
    if step < warmup:
        return peak * step / warmup
    t = min(step - warmup, total - warmup) / (total - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_plain_lines_come_every_interval_with_the_eta_of_the_measured_rate():
    now = [0.0]
    lines = []
    progress = StepProgress(total=10, initial=0, until=10, log=lines.append, every_s=30, terminal=False,
                            clock=lambda: now[0])
    for step in range(1, 11):
        now[0] = 5.0 + 10.0 * step          # the first step ends at 15 s (compiling), then 10 s per step
        progress.update(step, loss=2.0 - step / 10, lr=1e-3, tok_s=1234.5, val=float("nan"))
    progress.close()
    # lines once 30 s have passed since the previous one: at 35 s (step 3), 65 s (step 6), 95 s (step 9);
    # the rate since the first step ended is 10 s per step: 7, 4 and 1 steps left
    assert lines == ["step 3/10  loss 1.7000  lr 1.00e-03  1,234 tok/s  ETA 1m10s",
                     "step 6/10  loss 1.4000  lr 1.00e-03  1,234 tok/s  ETA 40s",
                     "step 9/10  loss 1.1000  lr 1.00e-03  1,234 tok/s  ETA 10s"]


def test_the_first_line_says_it_compiled_and_a_terminal_gets_no_plain_lines():
    now = [0.0]
    lines = []
    progress = StepProgress(total=4, initial=0, until=4, log=lines.append, every_s=0, terminal=False,
                            clock=lambda: now[0])
    now[0] = 7.0
    progress.update(1, loss=3.0, lr=5e-4, tok_s=10.0, val=float("nan"))
    assert lines == ["step 1/4  loss 3.0000  lr 5.00e-04  (first step 7s, compilation included)"]
    quiet = []
    for terminal, enabled in ((True, True), (False, False)):
        bar = StepProgress(total=4, initial=0, until=4, log=quiet.append, enabled=enabled, every_s=0,
                           terminal=terminal, clock=lambda: now[0])
        bar.update(1, loss=3.0, lr=5e-4, tok_s=10.0, val=float("nan"))
        bar.close()
    assert quiet == []
    assert [format_duration(s) for s in (0.4, 59.6, 61, 3600 + 125)] == ["0s", "1m00s", "1m01s", "1h02m"]


def test_train_logs_a_progress_line_per_step_with_the_schedule_lr(data_file, tmp_path):
    lines = []
    opts = dict(RUN, progress=True, log=lines.append, eval_every=4)
    train(tiny_cfg(), data_file, tmp_path / "r", steps=6, progress_every_s=0, **opts)
    steps = [LINE.match(line) for line in lines if LINE.match(line)]
    assert [int(m.group(1)) for m in steps] == [2, 3, 4, 5, 6]            # step 1's line has no rate yet
    assert any(line.startswith("step 1/6  loss ") and "compilation included" in line for line in lines)
    for m in steps:
        step = int(m.group(1))
        assert float(m.group(4)) == pytest.approx(_reference_lr(step, 1e-2, 1e-3, 1, 6), rel=5e-3)
    with open(tmp_path / "r" / "training_log.csv", newline="") as f:
        logged = {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f)}
    assert float(steps[2].group(3)) == pytest.approx(logged[4], abs=1e-4)     # the same loss as the log's row
    with pytest.raises(TrainError, match="progress_every_s=-1 is not allowed"):
        train(tiny_cfg(), data_file, tmp_path / "bad", steps=2, progress_every_s=-1, **opts)


def test_dantinox_train_writing_to_a_pipe_shows_progress_while_it_runs(data_file, tmp_path):
    """stdout is a pipe (not a terminal): a progress line arrives while the run is still going (before this
    change nothing came until the buffer filled or the run ended), then Ctrl-C stops it cleanly."""
    proc = start_cli("train", "--data", data_file, "--out", tmp_path / "run", "--preset", "tiny", "--batch_size", "4",
                     "--seq_len", "16", "--steps", "1000000", "--eval_every", "1000000", "--progress_every", "0",
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, running = [], []

    def read():
        for line in proc.stdout:
            seen.append(line.rstrip("\n"))
            if LINE.match(seen[-1]):
                running.append(proc.poll() is None)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=240)          # a guard against a hang, not a measurement
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert running == [True], seen
    assert int(LINE.match(seen[-1]).group(2)) == 1000000
    assert proc.returncode == 130


def test_a_resumed_run_stopped_before_its_schedule_ends_says_so(data_file, tmp_path):
    out = tmp_path / "r"
    train(tiny_cfg(), data_file, out, steps=20, stop_at=3, **RUN)      # a 20-step run, interrupted at step 3
    lines = []
    summary = train(tiny_cfg(), data_file, out, steps=5, **{**RUN, "log": lines.append})   # resumed: --steps 5
    lr5 = _reference_lr(5, 1e-2, 1e-3, 1, 20)
    note = [line for line in lines if line.startswith("note: ")]
    assert note == [f"note: this call stops at step 5, but the learning-rate schedule of the run spans 20 steps: "
                    f"the learning rate there is {lr5:.3g} (peak 0.01, min_lr 0.001 at step 20); run it to step "
                    "20 to finish the schedule"]
    assert lines[-1].startswith(f"done: step 5 of a 20-step schedule (learning rate {lr5:.3g}, not yet decayed "
                                "to min_lr 0.001; run it to step 20 to finish the schedule), val ")
    assert summary["steps"] == 5 and read_summary(out)["schedule_steps"] == 20
    lines.clear()
    train(tiny_cfg(), data_file, out, steps=20, **{**RUN, "log": lines.append})   # finishing it: no note
    assert not any(line.startswith("note: ") for line in lines) and lines[-1].startswith("done: step 20, val ")
