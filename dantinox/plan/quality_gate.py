"""Quality gates of the plan: each model variant a candidate uses must pass ``dantinox eval --gate`` per slice.

The float variant (kv_dtype float32, quantize none) is the baseline the gate compares against, so it passes
by definition. Any other variant is evaluated once, by running ``dantinox eval`` (the quantized-path issue)
in a subprocess with the gate file and the slices; its exit status decides (0 pass, 1 fail, naming the
failed slices and metrics). Where this dantinox has no ``eval`` command, or no gate was given, a non-float
variant is "not measured" and the planner drops its candidates: a variant whose quality nobody checked is
never recommended.

``GateResult``: passed (True / False / None = not measured), failed (["slice: metric ..." lines]), detail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

FLOAT_VARIANT = ("float32", "none")


@dataclass(frozen=True)
class GateResult:
    """Outcome of a quality gate for one variant. passed: True, False, or None when it was not measured."""

    passed: bool | None
    failed: tuple = field(default_factory=tuple)
    detail: str = ""

    def to_dict(self) -> dict:
        """passed, failed (list), detail."""
        return {"passed": self.passed, "failed": list(self.failed), "detail": self.detail}


def eval_command(run_dir: str | None, gate: str, slices: list, kv_dtype: str, quantize: str, json_out: str,
                 extra: tuple = ()) -> list:
    """The ``dantinox eval`` argv for a variant (figures and failures written to ``json_out``; ``extra``: more
    eval flags, e.g. ("--prompts", "2"))."""
    cmd = [sys.executable, "-m", "dantinox.cli", "eval", "--gate", gate, "--kv-dtype", kv_dtype, "--json", json_out,
           *extra]
    if quantize != "none":
        cmd += ["--quantize", quantize]
    if run_dir:
        cmd += ["--run_dir", run_dir]
    for item in slices:
        cmd += ["--slice", item]
    return cmd


def run_eval_gate(run_dir: str | None, gate: str | None, slices: list, kv_dtype: str, quantize: str,
                  timeout_s: float = 600.0, extra: tuple = ()) -> GateResult:
    """Evaluate one variant with ``dantinox eval --gate`` (see the module docstring)."""
    import json
    import tempfile

    if (kv_dtype, quantize) == FLOAT_VARIANT:
        return GateResult(True, detail="the float baseline itself")
    if not gate:
        return GateResult(None, detail="no --gate given: quality of a non-float variant not measured")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "eval.json")
        try:
            done = subprocess.run(eval_command(run_dir, gate, slices, kv_dtype, quantize, out, extra),
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return GateResult(None, detail=f"dantinox eval took more than {timeout_s:.0f} s")
        figures = json.load(open(out)) if os.path.exists(out) else {}
    text = (done.stdout + done.stderr).strip()
    if done.returncode == 0:
        return GateResult(True, detail="dantinox eval --gate passed")
    if done.returncode == 1:
        failed = tuple(figures.get("failures") or [ln.split("gate failed: ", 1)[-1] for ln in text.splitlines()
                                                   if "gate failed" in ln])
        return GateResult(False, failed, "dantinox eval --gate failed")
    last = text.splitlines()[-1] if text else ""
    raise ValueError(f"dantinox eval for kv {kv_dtype}, weights {quantize} exited {done.returncode}: {last}")


def gate_variants(variants: list, evaluate) -> dict:
    """{(kv_dtype, quantize): GateResult} for each distinct variant, evaluated once with
    ``evaluate(kv_dtype, quantize) -> GateResult``, in sorted order."""
    return {v: evaluate(*v) for v in sorted(set(variants))}
