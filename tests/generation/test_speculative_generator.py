"""Speculative decoding on the user path: ``Generator.generate`` / ``complete`` / ``stream`` with
speculative="ngram" give plain greedy's text (GQA run; an MLA run with an int8 cache), report their acceptance,
and refuse bad settings naming the argument; ``dantinox generate --speculative ngram`` prints the same text with
an acceptance line and refuses bad flags with one line, exit 2. The speculative loop itself (MHA / GQA / MLA,
int8, sampling, the cache) is tested in test_speculative.py."""

import pytest
from conftest import spiky_mla, tiny_config
from run_util import TEXT, make_run

from dantinox.cli import entrypoint as cli
from dantinox.generation.generator import Generator
from dantinox.generation.speculative_generate import SpecSettings, SpecStats
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer

PROMPT = "Nel mezzo del cammin"
SPEC = dict(speculative="ngram", spec_tokens=3, spec_ngram_max=3)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run") / "gqa", attention="gqa", kv_heads=2)


@pytest.fixture(scope="module")
def gen(run_dir):
    return Generator(run_dir, warmup=False)


def test_speculative_generate_complete_and_stream_equal_plain_greedy(gen):
    plain = gen.complete(PROMPT, 40, temperature=0, ignore_eos=True)
    spec = gen.complete(PROMPT, 40, temperature=0, ignore_eos=True, **SPEC)
    assert spec.text == plain.text and spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason
    assert plain.spec is None and isinstance(spec.spec, SpecStats) and gen.spec_stats is spec.spec
    assert spec.spec.verify_calls > 0 and sum(spec.spec.proposed) > 0
    assert 0.0 <= spec.spec.acceptance_rate <= 1.0 and 1.0 <= spec.spec.mean_accepted_length <= 4.0
    assert 0.0 <= gen.switch_off_threshold(3) <= 3.0 and gen.speculation("ngram", 3).min_accept == \
        gen.switch_off_threshold(3)
    assert gen.generate(PROMPT, 40, temperature=0, ignore_eos=True, **SPEC) == plain.text
    streamed = "".join(gen.stream(PROMPT, 40, temperature=0, ignore_eos=True, chunk_size=5, **SPEC))
    assert streamed == plain.text
    sampled = gen.generate(PROMPT, 20, temperature=1.0, seed=3, **SPEC)   # sampling runs (its law: test_speculative)
    assert isinstance(sampled, str)


@pytest.mark.slow   # compiles the batch-2 programs
def test_speculative_batch_equals_plain_greedy(gen):
    batch = gen.generate([PROMPT, "selva"], 30, temperature=0, **SPEC)
    assert batch == gen.generate([PROMPT, "selva"], 30, temperature=0)


@pytest.mark.slow   # compiles a second model's programs
def test_speculative_with_an_mla_model_and_an_int8_cache_equals_plain_greedy(tmp_path):
    tokenizer = train_tokenizer(TEXT, "char")
    cfg = tiny_config(vocab_size=tokenizer.vocab_size, max_context=64, attention="mla", kv_latent_dim=16)
    save_run(tmp_path / "mla", spiky_mla(cfg, scale=3.0), cfg, tokenizer)
    gen = Generator(str(tmp_path / "mla"), warmup=False, kv_dtype="int8")
    assert gen.cfg.cache_dtype == "int8"
    plain = gen.generate(PROMPT, 30, temperature=0, ignore_eos=True)
    assert gen.generate(PROMPT, 30, temperature=0, ignore_eos=True, **SPEC) == plain


@pytest.mark.parametrize("settings, message", [
    (dict(speculative="draft"), "speculative='draft' needs a draft model: Generator"),
    (dict(speculative="medusa"), "speculative='medusa' is not allowed: one of 'ngram', 'draft'"),
    (dict(speculative="ngram", spec_tokens=0), "spec_tokens=0 is not allowed"),
    (dict(speculative="ngram", spec_tokens=17), "spec_tokens=17 is not allowed: at most 16"),
    (dict(speculative="ngram", spec_ngram_max=2, spec_ngram_min=3), "ngram_min=3, ngram_max=2 is not allowed"),
    (dict(speculative="ngram", use_cache=False), "not allowed with use_cache=False"),
])
def test_bad_speculative_arguments_name_the_argument(gen, settings, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(PROMPT, 5, **settings)


def test_speculation_with_a_diffusion_model_is_refused():
    gen = Generator("dante-diffusion", warmup=False)
    with pytest.raises(ValueError, match="speculative='ngram' needs an autoregressive model"):
        gen.speculation("ngram")
    assert gen.speculation(None) is None


def test_cli_generate_speculative_prints_the_plain_text_and_the_acceptance(run_dir, gen, capsys):
    common = ["generate", "--run_dir", run_dir, "--prompt", PROMPT, "--max_new_tokens", "30", "--temperature", "0",
              "--ignore_eos"]
    plain = PROMPT + gen.generate(PROMPT, 30, temperature=0, ignore_eos=True) + "\n"
    assert cli.main(common + ["--speculative", "ngram", "--spec-tokens", "3", "--spec-ngram-max", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "speculative ngram (k=3, n-gram 2..1):" in captured.err and "proposed tokens accepted" in captured.err


@pytest.mark.slow   # one more CLI run
def test_cli_generate_speculative_stream_prints_the_plain_text(run_dir, capsys):
    common = ["generate", "--run_dir", run_dir, "--prompt", PROMPT, "--max_new_tokens", "30", "--temperature", "0",
              "--ignore_eos"]
    assert cli.main(common) == 0
    plain = capsys.readouterr().out
    assert cli.main(common + ["--stream", "--speculative", "ngram"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and "proposed tokens accepted" in captured.err


@pytest.mark.parametrize("bad, message", [
    (["--speculative", "ngram", "--spec-tokens", "0"], "--spec-tokens 0 is not allowed"),
    (["--speculative", "ngram", "--spec-tokens", "17"], "--spec-tokens 17 is not allowed: at most 16"),
    (["--speculative", "ngram", "--spec-ngram-max", "2", "--spec-ngram-min", "3"],
     "--spec-ngram-min 3, --spec-ngram-max 2 is not allowed"),
    (["--spec-tokens", "3"], "--spec-tokens needs --speculative ngram or draft:RUN"),
    (["--speculative", "ngram", "--no_cache"], "--speculative needs the cache"),
])
def test_cli_bad_speculative_flags_are_one_line_exit_2(run_dir, capsys, bad, message):
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--max_new_tokens", "5"] + bad) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["draft", "draft:", "medusa"])
def test_cli_unknown_proposer_is_one_line_exit_2(run_dir, capsys, value):
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--speculative", value]) == 2
    err = capsys.readouterr().err
    assert f"--speculative {value} is not allowed: ngram or draft:RUN" in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A 1-block draft over the same char tokenizer (max_context 64, as the target's)."""
    return make_run(tmp_path_factory.mktemp("draft") / "small", attention="gqa", kv_heads=2, num_blocks=1)


def test_cli_draft_with_another_tokenizer_is_one_line_exit_2(run_dir, tmp_path, capsys):
    other = make_run(tmp_path / "bpe", kind="bpe", attention="gqa", kv_heads=2)
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--speculative", f"draft:{other}"]) == 2
    err = capsys.readouterr().err
    assert "does not share the target's tokenizer: the draft's vocabulary holds 260 tokens" in err, err
    assert err.count("\n") == 1, err


@pytest.mark.slow   # compiles the draft's programs
def test_generator_and_cli_with_a_draft_run_equal_plain_greedy(run_dir, draft_dir, gen, capsys):
    drafted = Generator(run_dir, warmup=False, draft_run=draft_dir)
    plain = gen.complete(PROMPT, 30, temperature=0, ignore_eos=True)
    spec = drafted.complete(PROMPT, 30, temperature=0, ignore_eos=True, speculative="draft", spec_tokens=3)
    assert spec.text == plain.text and spec.spec.verify_calls > 0
    assert 0.0 <= drafted.switch_off_threshold(3, "draft") <= 3.0
    streamed = "".join(drafted.stream(PROMPT, 30, temperature=0, ignore_eos=True, chunk_size=4,
                                      speculative="draft", spec_tokens=3))
    assert streamed == plain.text
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", PROMPT, "--max_new_tokens", "30",
                     "--temperature", "0", "--ignore_eos", "--speculative", f"draft:{draft_dir}"]) == 0
    captured = capsys.readouterr()
    assert captured.out == PROMPT + plain.text + "\n" and "speculative draft (k=4, draft model):" in captured.err


def test_cli_speculative_with_a_diffusion_model_names_the_flag(capsys):
    assert cli.main(["generate", "--run_dir", "dante-diffusion", "--prompt", "Nel", "--speculative", "ngram"]) == 2
    err = capsys.readouterr().err
    assert "--speculative is only for autoregressive models" in err and err.count("\n") == 1, err


def test_settings_default():
    assert SpecSettings() == SpecSettings("ngram", 4, 4, 1)
