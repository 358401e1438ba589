"""Quality gates: per-slice thresholds from a YAML file, checked against ``dantinox eval`` results.

Gate file format (every slice named must be one given with ``--slice``; every metric one of GATE_METRICS)::

    slices:
      it-heldout:   {loss_change_pct: 0.5, agreement_min: 0.8, max_logit_diff: 1.0}
      rare-latin:   {loss_change_pct: 0.5}
      en-shakespeare: {loss_change_pct: 1.0, agreement_min: 0.5}

  loss_change_pct  fail when |candidate loss - baseline loss| / baseline loss x 100 exceeds the value (percent)
  agreement_min    fail when the greedy agreement with the baseline is below the value (a fraction in [0, 1])
  max_logit_diff   fail when the largest |logit difference| exceeds the value (logit units)

A slice left out of the file, or a metric left out of a slice, is not gated. Plain Python, no device.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

from ..runs.input_files import read_yaml

GATE_METRICS = ("loss_change_pct", "agreement_min", "max_logit_diff")


class GateError(ValueError):
    """A gate file that cannot be used; the message names the file, the entry and what is allowed."""


def load_gate(path: str | os.PathLike, slice_names) -> dict[str, dict[str, float]]:
    """Read a gate file; returns {slice: {metric: threshold}}.

    Raises GateError: a file that is a directory, unreadable, not UTF-8 or not YAML
    (``dantinox.runs.input_files``; InputFileNotFound for a missing one),
    no top-level ``slices`` mapping, a slice not among slice_names,
    a metric not in GATE_METRICS, a threshold that is not a finite number >= 0.
    """
    data = read_yaml(path, "--gate", GateError)
    if not isinstance(data, Mapping) or set(data) != {"slices"} or not isinstance(data["slices"], Mapping):
        raise GateError(f"--gate {path}: expected one top-level key 'slices' mapping slice names to thresholds")
    gate = {}
    for name, metrics in data["slices"].items():
        if name not in slice_names:
            raise GateError(f"--gate {path}: slice {name!r} is not one of the --slice names "
                            f"({', '.join(slice_names)})")
        if not isinstance(metrics, Mapping):
            raise GateError(f"--gate {path}: slice {name!r} needs a mapping of metric: threshold")
        for metric, value in metrics.items():
            if metric not in GATE_METRICS:
                raise GateError(f"--gate {path}: metric {metric!r} of slice {name!r} is not allowed: one of "
                                f"{', '.join(GATE_METRICS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise GateError(f"--gate {path}: {name}.{metric}={value!r} is not allowed: a number >= 0")
        gate[name] = {m: float(v) for m, v in metrics.items()}
    return gate


def gate_value(metric: str, row: Mapping[str, float]) -> float:
    """The figure a gate metric compares, from one slice's results (keys as in cli/eval.py's JSON rows)."""
    if metric == "loss_change_pct":
        return abs(row["loss_change_pct"])
    if metric == "agreement_min":
        return row["agreement"]
    return row["max_logit_diff"]


def gate_passes(metric: str, value: float, threshold: float) -> bool:
    """True when ``value`` (from gate_value) meets ``threshold``."""
    return value >= threshold if metric == "agreement_min" else value <= threshold


def check_gate(gate: Mapping[str, Mapping[str, float]], results: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Failures as 'slice.metric: value vs threshold' strings, in gate order; empty when every check passes."""
    failures = []
    for name, metrics in gate.items():
        for metric, threshold in metrics.items():
            value = gate_value(metric, results[name])
            if not gate_passes(metric, value, threshold):
                relation = "<" if metric == "agreement_min" else ">"
                failures.append(f"{name}.{metric}: {value:.4g} {relation} {threshold:g}")
    return failures
