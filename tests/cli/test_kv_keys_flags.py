"""--kv-keys token|channel and --kv-key-group on generate / verify / budget (issue 19 item 3): bad values are
one line naming the flag (exit 2); channel keys verify on the bundled model and budget counts them."""

import pytest
from cli_util import run_main


def _error(capsys, argv) -> str:
    status, _, err = run_main(argv, capsys)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["generate", "--prompt", "Nel", "--kv-keys", "channel"], "--kv-keys channel needs an int8"),
    (["verify", "--kv-dtype", "int8", "--kv-keys", "rows"], "--kv-keys 'rows' is not allowed: one of token, channel"),
    (["verify", "--kv-dtype", "int8", "--kv-keys", "channel", "--kv-key-group", "0"], "--kv-key-group 0 is not"),
    (["generate", "--prompt", "Nel", "--kv-dtype", "int8", "--kv-keys", "channel", "--kv-key-group", "4",
      "--speculative", "ngram", "--spec-tokens", "4"], "--spec-tokens 4 is not allowed with --kv-key-group 4"),
    (["verify", "--kv-dtype", "int8", "--kv-key-group", "4", "--speculative", "ngram", "--spec-tokens", "4"],
     "--spec-tokens 4 is not allowed with --kv-key-group 4"),
    (["generate", "--prompt", "Nel", "--kv-dtype", "int8", "--kv-key-group", "512"],
     "--kv-key-group 512 is not allowed: longer than the model's max_context=256"),
    (["budget", "--preset", "tiny", "--dtype", "int8", "--kv-keys", "token", "--kv-key-group", "8"],
     "--kv-key-group 8 is not allowed with --kv-keys token"),
    (["budget", "--preset", "tiny", "--kv-keys", "channel"], "--kv-keys channel needs --dtype int8"),
    (["budget", "--preset", "tiny-mla", "--dtype", "int8", "--kv-keys", "channel"], "attention='mla'"),
])
def test_bad_key_layouts_are_one_line_naming_the_flag(capsys, argv, says):
    assert says in _error(capsys, argv)


def test_budget_measures_the_channel_layout_exactly(capsys):
    status, out, _ = run_main(["budget", "--preset", "tiny", "--dtype", "int8", "--kv-keys", "channel",
                               "--kv-key-group", "8", "--measure"], capsys)
    assert status == 0 and "MISMATCH" not in out and "per-channel keys (G = 8;" in out, out


@pytest.mark.slow
def test_verify_passes_with_channel_keys_on_the_bundled_model(capsys):
    status, out, _ = run_main(["verify", "--kv-dtype", "int8", "--kv-keys", "channel", "--new_tokens", "140"], capsys)
    assert status == 0 and "PASS" in out and "cache faults (stored values the reference cannot reproduce): 0" in out


@pytest.mark.slow
def test_generate_with_channel_keys_gives_the_uncached_tokens(capsys):
    common = ["generate", "--prompt", "Nel mezzo del cammin", "--max_new_tokens", "24", "--temperature", "0",
              "--kv-dtype", "int8", "--kv-keys", "channel", "--kv-key-group", "8"]
    status, cached, _ = run_main(common, capsys)
    assert status == 0
    status, uncached, _ = run_main(common + ["--no_cache"], capsys)
    assert status == 0 and cached == uncached and cached.strip()


def test_budget_int8_counts_per_channel_keys_by_default_and_per_token_keys_on_request(capsys):
    """The int8 default on MHA / GQA / MQA is per-channel keys (the tiny preset's G: 64 clipped to its 32-slot
    context); --kv-keys token is the per-token layout. Both measured equal to the allocated arrays."""
    status, out, _ = run_main(["budget", "--preset", "tiny", "--dtype", "int8", "--measure"], capsys)
    assert status == 0 and "MISMATCH" not in out and "per-channel keys (G = 32;" in out, out
    status, out, _ = run_main(["budget", "--preset", "tiny", "--dtype", "int8", "--kv-keys", "token", "--measure"],
                              capsys)
    assert status == 0 and "MISMATCH" not in out and "per-channel keys" not in out, out
