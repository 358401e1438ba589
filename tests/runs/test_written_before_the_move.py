"""Files written before the package moved to its layout by concept still load: the bundled run directories
(written by the flat-layout trainer), the planning example's profile (format 2, dantinox 0.1.0) and its cost
model. None of them stores a module path, so the move changes no user data."""

import json
import os

import numpy as np
import pytest
from paths import REPO

import dantinox as dx
from dantinox.plan.cost_model import CostModel
from dantinox.plan.profile import check_profile, model_identity
from dantinox.runs.bundled import bundled_names, bundled_run_dir
from dantinox.runs.run_dir import load_run

EXAMPLE = os.path.join(REPO, "docs", "planning-example", "profile.json")


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_bundled_runs_written_before_the_move_load_and_answer():
    for name in bundled_names():
        model, cfg, tok, summary = load_run(bundled_run_dir(name))
        assert summary["dantinox_version"] == dx.__version__
        ids = tok.encode("Nel mezzo")
        logits = model(np.asarray([ids], np.int32))[0]
        assert logits.shape == (1, len(ids), cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_example_profile_written_before_the_move_matches_the_bundled_model():
    with open(EXAMPLE) as f:
        profile = json.load(f)
    run_dir = bundled_run_dir("dante")
    _, cfg, _, _ = load_run(run_dir)
    check_profile(profile, model_identity(run_dir, cfg), "example profile")  # raises on any difference
    cost = CostModel.from_dict(profile["cost_model"])
    assert cost.decode_cost(4, 64, 8) > 0
