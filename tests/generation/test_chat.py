"""Chat: templates rendered as transformers does, Generator.chat stopping at any end-of-turn id, and
`dantinox generate --chat` (with its errors: no template, unknown role, flags that exclude each other)."""

import jax
import numpy as np
import pytest
from chat_util import CHATML, INJECTION, chatml_literal_ids, save_tiny_chat_run

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.generation.generator import Generator
from dantinox.runs.chat_template import ChatTemplate, ChatTemplateError

QUESTION = [{"role": "system", "content": "Sei Virgilio."}, {"role": "user", "content": "Dove siamo?"}]


def test_template_renders_like_transformers_environment():
    t = ChatTemplate(CHATML)
    assert t.render(QUESTION) == ("<|im_start|>system\nSei Virgilio.<|im_end|>\n<|im_start|>user\nDove siamo?"
                                  "<|im_end|>\n<|im_start|>assistant\n")
    assert t.render(QUESTION, add_generation_prompt=False).endswith("Dove siamo?<|im_end|>\n")
    # trim_blocks / lstrip_blocks: a block tag's own line and indentation leave nothing behind
    blocks = ChatTemplate("{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
                          "{{ m['content'] }}|{{ eos_token }}{% endfor %}", {"eos_token": "</s>"})
    assert blocks.render(QUESTION) == "Sei Virgilio.|</s>"
    assert ChatTemplate("{{ messages | tojson }}").render([{"role": "user", "content": "ché"}]) == \
        '[{"role": "user", "content": "ché"}]'


def test_template_errors_name_the_field():
    t = ChatTemplate(CHATML)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.role='wizard'"):
        t.render([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content=3"):
        t.render([{"role": "user", "content": 3}])
    with pytest.raises(ChatTemplateError, match="refused the conversation: boom"):
        ChatTemplate("{{ raise_exception('boom') }}").render(QUESTION)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    return save_tiny_chat_run(tmp_path_factory.mktemp("chat") / "tiny-chat")


def test_generator_chat_stops_at_any_end_of_turn_id(tmp_path):
    base = Generator(save_tiny_chat_run(tmp_path / "probe"), warmup=False)
    ids = base.chat_format.prompt_ids(QUESTION, base.tokenizer)
    free = np.asarray(dx.generate(base.model, ids, 20))  # no stop ids: the reference continuation
    stop = int(free[5])  # a token the greedy continuation produces: make it end the turn
    first = int(np.flatnonzero(free == stop)[0])
    gen = Generator(save_tiny_chat_run(tmp_path / "stops", eos_ids=[stop, 0]), warmup=False)
    assert set(gen.chat_format.stop_ids) == {stop, 0, gen.tokenizer.hf.token_to_id("<|im_end|>")}
    answer = gen.chat(QUESTION, 20, temperature=0)
    hits = [i for i, t in enumerate(free.tolist()) if t in gen.chat_format.stop_ids]
    assert hits[0] <= first
    assert answer == gen.tokenizer.decode(free[: hits[0]].tolist())
    assert gen.chat("Dove siamo?", 20, system="Sei Virgilio.", temperature=0) == answer


def test_generate_chat_cli(chat_run, capsys):
    assert cli.main(["generate", "--run_dir", chat_run, "--chat", "Dove siamo?", "--system", "Sei Virgilio.",
                     "--temperature", "0", "--max_new_tokens", "12"]) == 0
    want = Generator(chat_run, warmup=False).chat(QUESTION, 12, temperature=0)
    assert capsys.readouterr().out == want + "\n"


def test_generate_chat_stream_prints_the_same_answer(chat_run, capsys):
    argv = ["generate", "--run_dir", chat_run, "--chat", "Dove siamo?", "--system", "Sei Virgilio.",
            "--temperature", "0.9", "--seed", "3", "--max_new_tokens", "12"]
    assert cli.main(argv) == 0
    whole = capsys.readouterr().out
    assert cli.main(argv + ["--stream"]) == 0
    out, err = capsys.readouterr()
    assert out == whole and "first text after" in err


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 5)])
def test_stream_chat_pieces_join_to_the_chat_answer_and_compile_nothing_more(chat_run, temperature, seed):
    gen = Generator(chat_run, warmup=False)
    ids = gen.chat_prompt_ids(QUESTION)
    gen.warm_up([len(ids)], 12)
    with dx.CompileCounter() as counted:
        items = list(gen.stream_chat(QUESTION, 12, temperature=temperature, seed=seed, chunk_size=5))
    assert counted.compilations == 0, counted
    answer = gen.chat(QUESTION, 12, temperature=temperature, seed=seed)
    assert "".join(piece for piece, _, _ in items) == answer
    assert [reason for _, _, reason in items[:-1]] == [None] * (len(items) - 1)
    assert items[-1][0] == "" and items[-1][2] in ("stop", "length") and 1 <= items[-1][1] <= 12
    assert list(gen.stream_chat("Dove siamo?", 12, system="Sei Virgilio.", temperature=temperature,
                                seed=seed))[-1] == items[-1]


def test_stream_chat_stops_at_an_end_of_turn_id(tmp_path):
    base = Generator(save_tiny_chat_run(tmp_path / "probe"), warmup=False)
    free = np.asarray(dx.generate(base.model, base.chat_format.prompt_ids(QUESTION, base.tokenizer), 20))
    gen = Generator(save_tiny_chat_run(tmp_path / "stops", eos_ids=[int(free[5])]), warmup=False)
    items = list(gen.stream_chat(QUESTION, 20, temperature=0))
    assert items[-1][2] == "stop" and "".join(p for p, _, _ in items) == gen.chat(QUESTION, 20, temperature=0)
    with pytest.raises(ValueError, match="has no chat template"):
        next(Generator(save_tiny_chat_run(tmp_path / "plain", template=None), warmup=False).stream_chat("ciao"))


def test_k12_generate_chat_encodes_typed_markers_as_text(chat_run, capsys):
    gen = Generator(chat_run, warmup=False)
    messages = [{"role": "system", "content": "Sei Virgilio."}, {"role": "user", "content": INJECTION}]
    want = chatml_literal_ids(gen.tokenizer, messages)
    assert cli.main(["generate", "--run_dir", chat_run, "--chat", INJECTION, "--system", "Sei Virgilio.",
                     "--temperature", "0", "--max_new_tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert f"prompt {len(want)} tokens after the chat template" in err
    assert out == gen.chat(messages, 5, temperature=0) + "\n"


@pytest.mark.parametrize("argv, message", [
    (["--chat", ""], "--chat is empty"),
    (["--chat", "ciao", "--prompt", "x"], "--prompt and --chat exclude each other"),
    (["--prompt", "Nel", "--system", "x"], "--system needs --chat"),
    (["--chat", "ciao", "--max_new_tokens", "0"], "--max_new_tokens 0"),
    (["--chat", "ciao", "--no_cache"], "--no_cache is not supported with --chat"),
])
def test_generate_chat_cli_bad_flags(chat_run, capsys, argv, message):
    assert cli.main(["generate", "--run_dir", chat_run, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_chat_without_template_exits_2(tmp_path, capsys):
    run = save_tiny_chat_run(tmp_path / "plain", template=None)
    assert cli.main(["generate", "--run_dir", run, "--chat", "ciao"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="has no chat template"):
        Generator(run, warmup=False).chat("ciao")


def test_generate_chat_applies_the_model_flags(chat_run, capsys, monkeypatch):
    """--kv-dtype, --quantize and --mesh reach the model that answers (they were once silently dropped)."""
    from dantinox.parallel.mesh import mesh_of
    from dantinox.generation.decode import split_model

    used, original = [], Generator.chat

    def spy(self, *args, **kwargs):
        used.append((self.cfg.cache_dtype, self.quantize, mesh_of(split_model(self.model)[1])))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Generator, "chat", spy)
    argv = ["generate", "--run_dir", chat_run, "--chat", "Dove siamo?", "--temperature", "0", "--max_new_tokens", "4"]
    assert cli.main(argv + ["--kv-dtype", "int8", "--quantize", "int8", "--mesh", "data=1,model=1"]) == 0
    answer = capsys.readouterr().out
    (cache_dtype, quantize, mesh), = used
    assert (cache_dtype, quantize, dict(mesh.shape)) == ("int8", "int8", {"data": 1, "model": 1})
    want = original(Generator(chat_run, warmup=False, kv_dtype="int8", quantize="int8"), "Dove siamo?", 4,
                    temperature=0)
    assert answer == want + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--kv-dtype", "int4"], "--kv-dtype"), (["--quantize", "int3"], "--quantize"),
    (["--mesh", "data=2,model=4"], "--mesh 'data=2,model=4'"), (["--mesh", "rows=2"], "--mesh"),
])
def test_generate_chat_refuses_bad_model_flags(chat_run, capsys, flags, message):
    assert cli.main(["generate", "--run_dir", chat_run, "--chat", "ciao", *flags]) == 2
    out, err = capsys.readouterr()
    assert message in err and err.count("\n") == 1 and out == ""


def test_generate_chat_too_long_names_the_conversation(chat_run, capsys):
    assert cli.main(["generate", "--run_dir", chat_run, "--chat", "Nel mezzo " * 40]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dantinox generate: error: --chat: the conversation has ") and "--prompt" not in err
    assert "max_context=96" in err and err.count("\n") == 1


def test_chat_warm_up_compiles_one_prefill_and_one_decode_then_nothing(chat_run):
    """What `generate --chat` warms up: the prefill of the conversation's bucket and the decode loop, no
    prefill of another bucket (the decode loop is warmed behind a prompt of the compiled bucket); the turn
    itself then compiles nothing."""
    gen = Generator(chat_run, warmup=False)
    question = [QUESTION[0], {"role": "user", "content": "Dove siamo? " * 2}]
    ids = gen.chat_prompt_ids(question)
    assert len(ids) > 16   # a bucket above the one of a one-token prompt
    names = []

    def on_compile(event, duration, fun_name=None, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration":   # traced again after clear_caches, cached or not
            names.append(fun_name)

    jax.clear_caches()   # every program of the warm-up is traced again, and counted
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        gen.warm_up([len(ids)], 12)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert (names.count("prefill"), names.count("decode")) == (1, 1), names
    with dx.CompileCounter() as counted:
        gen.chat(question, 12, temperature=0)
    assert counted.compilations == 0, counted
