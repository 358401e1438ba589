"""The plan's quality gate runs the real ``dantinox eval --gate`` per model variant: a strict gate fails the
quantized variant (naming the slice and metric), a lenient one passes it, the float variant passes unrun."""

import pytest
from conftest import spiky_model, tiny_config

from dantinox.plan.quality_gate import run_eval_gate
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer

pytestmark = pytest.mark.slow   # runs `dantinox eval --gate` in child processes

TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura.\n" * 6
FAST = ("--prompts", "2", "--prompt-tokens", "8", "--continuation", "4", "--prefix", "16")
RARE = "Tan m'abellis vostre cortes deman, qu'ieu no me puesc ni voill a vos cobrire.\n" * 4


def test_eval_gate_fails_strict_and_passes_lenient(tmp_path):
    tok = train_tokenizer(TEXT + RARE, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size, max_context=128)
    save_run(tmp_path / "run", spiky_model(cfg, qk_scale=3.0), cfg, tok)
    (tmp_path / "rare.txt").write_text(RARE)
    slices = [f"rare={tmp_path / 'rare.txt'}"]
    strict, lenient = tmp_path / "strict.yaml", tmp_path / "lenient.yaml"
    strict.write_text("slices:\n  rare: {max_logit_diff: 0.0}\n")
    lenient.write_text("slices:\n  rare: {max_logit_diff: 1000.0}\n")
    run = str(tmp_path / "run")
    assert run_eval_gate(run, str(strict), slices, "float32", "none").passed is True   # the baseline itself
    failed = run_eval_gate(run, str(strict), slices, "int8", "int8", extra=FAST)
    assert failed.passed is False and any("rare" in f and "max_logit_diff" in f for f in failed.failed), failed
    assert run_eval_gate(run, str(lenient), slices, "int8", "int8", extra=FAST).passed is True
    assert run_eval_gate(run, None, slices, "int8", "int8").passed is None
