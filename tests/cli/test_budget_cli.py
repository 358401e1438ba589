"""``dantinox budget``: memory-size parsing, the per-sequence and max-batch tables, --measure against real
allocations, the three config sources, and bad input."""

import argparse
import json
import re

import pytest

import dantinox as dx
from dantinox.budget.memory import parse_memory_size
from dantinox.cli.budget import add_budget_arguments, attention_variants, run_budget


def budget(argv, capsys):
    """Run the subcommand through its own parser; returns (exit status, stdout)."""
    parser = argparse.ArgumentParser()
    add_budget_arguments(parser)
    status = run_budget(parser.parse_args(argv))
    return status, capsys.readouterr().out


def row(out: str, prefix: str, title: str) -> list[str]:
    """The cells of the row starting with `prefix` in the table titled `title`."""
    section = out.split(title, 1)[1]
    line = next(ln for ln in section.splitlines() if ln.strip().lstrip("*").startswith(prefix))
    return line.split(")", 1)[1].split()


@pytest.mark.parametrize("text, size", [
    ("40GB", 40 * 10 ** 9), ("40GiB", 40 * 2 ** 30), ("512MiB", 512 * 2 ** 20), ("2e9", 2 * 10 ** 9),
    ("1.5 gb", 1_500_000_000), ("100", 100), ("1KiB", 1024), ("3 TB", 3 * 10 ** 12), (2048, 2048),
])
def test_parse_memory_size(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text, match", [
    ("", "not allowed"), ("GB", "not allowed"), ("-1GB", "not allowed"), ("0", "at least 1 byte"),
    ("1e-9", "at least 1 byte"), ("40G", "ambiguous"), ("40XB", "unknown unit 'XB'"), ("abc", "not allowed"),
    ("nan", "not allowed"), ("inf", "not allowed"), ("4 0GB", "not allowed"), (None, "not allowed"),
])
def test_parse_memory_size_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        parse_memory_size(text)


UNITS = "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"


@pytest.mark.parametrize("argv, flag", [
    (["budget", "--preset", "dante"], "--device-memory"),
    (["plan", "--trace", "t.jsonl", "--slo", "ttft_p99=500"], "--device-memory"),
    (["serve"], "--kv-memory"),
    (["serve"], "--max-request-bytes"),
])
@pytest.mark.parametrize("value, reason", [
    ("-1GB", f"the size is negative; allowed: a positive number with an optional unit {UNITS}, e.g. 40GB"),
    ("0", "at least 1 byte"),
    ("40G", "unit 'G' is ambiguous; write GB (powers of 1000) or GiB (powers of 1024)"),
    ("40XB", "unknown unit 'XB'; allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
    ("lots", f"a positive number with an optional unit {UNITS}, e.g. 40GB"),
    ("", f"a positive number with an optional unit {UNITS}, e.g. 40GB"),
])
def test_a_memory_size_flag_names_the_flag_the_value_and_what_is_allowed(capsys, argv, flag, value, reason):
    from cli_util import run_main

    status, out, err = run_main(argv + [f"{flag}={value}"], capsys)
    shown = value or "''"
    assert status == 2 and out == ""
    assert err == f"dantinox {argv[0]}: error: {flag} {shown} is not allowed: {reason}\n"


def test_seed_reference_table_from_the_cli(capsys):
    """The corrected seed table: 12 blocks, head_size 32, bf16: MHA 6, GQA 1.5, MQA 0.75, MLA d_c=96 without
    a RoPE key 1.125 MiB per sequence at 512 tokens (and x2, x8 at 1024, 4096)."""
    status, out = budget(["--preset", "reference", "--context", "512", "1024", "4096", "--dtype", "bf16",
                          "--kv-latent-dim", "96", "--rope-head-dim", "0"], capsys)
    assert status == 0
    title = "KV cache per sequence (MiB)"
    assert row(out, "mha", title)[1:] == ["6", "12", "48"]
    assert row(out, "gqa", title)[1:] == ["1.5", "3", "12"]
    assert row(out, "mqa", title)[1:] == ["0.75", "1.5", "6"]
    assert row(out, "mla", title)[1:] == ["1.125", "2.25", "9"]
    assert "*gqa (H_kv=2)" in out and "mla (d_c=96, d_rope=0)" in out


def test_max_batch_table_equals_max_batch_size(capsys):
    status, out = budget(["--preset", "tiny", "--device-memory", "8MiB", "--context", "16", "32", "--dtype",
                          "fp32"], capsys)
    assert status == 0
    for label, cfg in attention_variants(dx.ModelConfig.from_preset("tiny")):
        kind = label.strip().lstrip("*").split()[0]
        cells = row(out, kind, "Max batch at 8MiB")
        expected = [dx.max_batch_size(cfg, 8 * 2 ** 20, n, dtype="fp32") for n in (16, 32)]
        assert [int(c) for c in cells[1:]] == expected, kind
        assert float(cells[0]) == pytest.approx(dx.param_bytes(cfg) / 2 ** 20, rel=1e-3)


def test_measure_prints_allocations_equal_to_the_formula(capsys):
    status, out = budget(["--preset", "tiny-mla", "--context", "8", "32", "--measure"], capsys)
    assert status == 0 and "MISMATCH" not in out
    measured = out.split("Measured on", 1)[1]
    rows = [ln.split() for ln in measured.splitlines() if ln.strip().endswith(" ok")]
    assert len(rows) == 4 * 2                                   # mha, gqa, mqa, mla x 2 contexts
    for cells in rows:
        assert cells[-4] == cells[-3] == cells[-2]              # formula == nbytes == allocated
    assert "*mla (d_c=16, d_rope=8)" in out
    assert "memory_stats" in out


def test_config_sources_yaml_json_and_run_dir(tmp_path, capsys):
    fields = dict(dx.PRESETS["tiny"], attention="gqa", kv_heads=4)
    (tmp_path / "model.yaml").write_text("model:\n" + "".join(f"  {k}: {json.dumps(v)}\n"
                                                              for k, v in fields.items()))
    (tmp_path / "flat.json").write_text(json.dumps(fields))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(dx.ModelConfig.from_dict(fields).to_json())
    for argv in (["--config", str(tmp_path / "model.yaml")], ["--config", str(tmp_path / "flat.json")],
                 ["--run_dir", str(run_dir)]):
        status, out = budget(argv + ["--context", "32"], capsys)
        assert status == 0 and "*gqa (H_kv=4)" in out and "2 blocks, dim 64" in out


def test_bad_input(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="missing.yaml: no such file"):
        budget(["--config", str(tmp_path / "missing.yaml")], capsys)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        budget(["--run_dir", str(tmp_path)], capsys)
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        budget(["--config", str(tmp_path / "bad.yaml")], capsys)
    (tmp_path / "unknown.yaml").write_text("dim: 64\nlearning_rate: 0.1\n")
    with pytest.raises(dx.ConfigError, match="learning_rate"):
        budget(["--config", str(tmp_path / "unknown.yaml")], capsys)
    with pytest.raises(ValueError, match="--context 0"):
        budget(["--preset", "tiny", "--context", "0"], capsys)
    with pytest.raises(ValueError, match="--dtype .fp8. is not allowed"):
        budget(["--preset", "tiny", "--dtype", "fp8"], capsys)
    with pytest.raises(ValueError, match="ambiguous"):
        budget(["--preset", "tiny", "--device-memory", "40G"], capsys)
    with pytest.raises(SystemExit):
        budget(["--preset", "tiny", "--config", "x.yaml"], capsys)   # one source only


def test_device_smaller_than_the_weights_says_how_much_is_missing(capsys):
    status, out = budget(["--preset", "reference", "--device-memory", "10MB", "--context", "512"], capsys)
    assert status == 0
    weights = dx.param_bytes(dx.ModelConfig.from_preset("reference"))
    missing = weights + 1_000_000 - 10_000_000
    assert "does not fit in 10000000 B" in out
    assert f"{missing} B more than the device has" in out
    assert not re.search(r"\s-\d", out.split("Max batch at 10MB", 1)[1])     # never a negative batch


def test_cli_wiring_exit_status():
    """Through ``dantinox.cli.entrypoint.main`` (the CLI owner wires the subcommand): 0 on success, 2 on bad input."""
    cli = pytest.importorskip("dantinox.cli")
    assert cli.main(["budget", "--preset", "tiny", "--context", "32"]) == 0
    assert cli.main(["budget", "--preset", "tiny", "--device-memory", "lots"]) == 2


@pytest.mark.parametrize("size", ["1e400GB", "1e30GB", "2000000TiB", "1e19"])
def test_absurd_device_memory_names_the_flag(size, capsys):
    with pytest.raises(ValueError, match=r"--device-memory .*at most 2\^60 bytes"):
        budget(["--preset", "tiny", "--device-memory", size], capsys)
    cli = pytest.importorskip("dantinox.cli")
    assert cli.main(["budget", "--preset", "tiny", "--device-memory", size]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device-memory" in err


def test_default_contexts_fit_the_model_and_longer_ones_are_marked(capsys):
    status, out = budget(["--preset", "tiny"], capsys)                  # max_context 32
    assert status == 0 and "8 tok" in out and "16 tok" in out and "32 tok" in out and "^" not in out
    status, out = budget(["--preset", "tiny", "--context", "32", "64"], capsys)
    assert status == 0 and "64 tok^" in out and "max_context=32: the model cannot run it" in out


def test_a_model_source_is_required(capsys):
    with pytest.raises(ValueError, match="no model shape given: pass one of --preset"):
        budget([], capsys)


def test_diffusion_run_with_shifted_prediction(tmp_path, capsys):
    """An AR-adapted diffusion run (shifted_prediction=True) is budgeted with its DualCache next to the AR cache."""
    cfg = dx.ModelConfig.from_preset("tiny", paradigm="diffusion", mask_token_id=127, shifted_prediction=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(cfg.to_json())
    status, out = budget(["--run_dir", str(run_dir)], capsys)
    assert status == 0 and "DualCache" in out


def test_a_run_with_stored_weights_other_than_float32_says_its_real_bytes(capsys, tmp_path):
    """The max-batch table counts float32 weights for every variant; a run whose weights are stored otherwise
    (GGUF blocks, bf16, int8) gets a note with its file's real size, a float32 run none."""
    import os
    import shutil

    from dantinox.runs.bundled import resolve_run_dir
    run = tmp_path / "blocks-run"
    shutil.copytree(resolve_run_dir("dante"), run)
    summary = json.loads((run / "model_summary.json").read_text())
    assert summary.get("weight_format", "float32") == "float32"
    status, out = budget(["--run_dir", str(run), "--device-memory", "64MiB"], capsys)
    assert status == 0 and "stores its weights" not in out
    summary["weight_format"] = "GGUF blocks Q4_1+Q8_0"
    (run / "model_summary.json").write_text(json.dumps(summary))
    status, out = budget(["--run_dir", str(run), "--device-memory", "64MiB"], capsys)
    size = os.path.getsize(run / "model.safetensors") / 2 ** 20
    assert status == 0 and f"stores its weights as GGUF blocks Q4_1+Q8_0: {size:.4g} MiB" in out, out
