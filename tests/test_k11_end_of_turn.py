"""Case K11 (../shared/cases/ACCEPTANCE.md): the model's end-of-turn token is a stop token after import, on every
path. A tiny Llama Hugging Face directory whose tokenizer_config.json names <|eot_id|> as eos_token while its
generation_config.json names only <|end_of_text|>, and a tiny GGUF file whose eot_token_id / eom_token_id differ
from its eos_token_id, both with weights that force a known greedy answer ("Roma") followed by <|eot_id|>.
After ``dantinox import`` every path stops there without printing it: Generator.chat / generate / stream,
``generate --chat`` and ``--prompt``, /v1/completions and /v1/chat/completions; ``ignore_eos`` and
``--ignore_eos`` generate past it; the stop ids are listed by the import and in the run's summary."""

import contextlib
import io
import json
import os

import gguf
import httpx
import numpy as np
import pytest
import safetensors.numpy
from chat_util import TEXT
from cli_util import run_main
from gguf_util import BLOCKS, DIM, FFN, HEAD, HEADS, KV_HEADS, gguf_name, hf_tensors, llama_cpp_permute
from paths import FIXTURES
from tokenizers import AddedToken

from dantinox.generation.generator import Generator
from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run, read_summary
from dantinox.runs.stop_ids import read_stop_ids
from dantinox.runs.tokenizer import TextTokenizer, train_tokenizer
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>"]
# Llama 3's shape, with its `| trim` (so the chat paths also take the exact segmentation's slower route, K12)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QUESTION = [{"role": "user", "content": "Dove siamo?"}]
ANSWER = "Roma"


def tokenizer_with_specials():
    """Byte-level BPE of TEXT (260 ids) plus SPECIALS as special added tokens (ids 260..265)."""
    hf = train_tokenizer(TEXT, "bpe", 260).hf
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return hf


def forced_tensors(vocab: int, chain: dict) -> dict:
    """HF Llama tensors whose greedy next token depends only on the last token: token s -> chain[s].

    Attention and MLP outputs are zero (o_proj, down_proj), so the last position's hidden state is its own
    embedding; lm_head row chain[s] is that embedding RMS-normalized, every other row small. Checked here with
    numpy, so the test below compares dantinox against a known answer."""
    tensors = hf_tensors(vocab, seed=1)
    rng = np.random.default_rng(2)
    embed = rng.standard_normal((vocab, DIM)).astype(np.float32)
    normed = embed / np.sqrt((embed**2).mean(-1, keepdims=True) + 1e-5)
    head = (0.01 * rng.standard_normal((vocab, DIM))).astype(np.float32)
    for source, target in chain.items():
        head[target] = normed[source]
    tensors.update({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                    "model.norm.weight": np.ones(DIM, np.float32)})
    for i in range(BLOCKS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.o_proj.weight"] = np.zeros((DIM, HEADS * HEAD), np.float32)
        tensors[p + "mlp.down_proj.weight"] = np.zeros((DIM, FFN), np.float32)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = np.ones(DIM, np.float32)
    for source, target in chain.items():
        assert int(np.argmax(head @ normed[source])) == target  # the forced answer, by numpy
    return tensors


def forced_chain(hf) -> dict:
    """The answer the weights force: after the chat prompt's last token "Roma", then <|eot_id|>, then
    <|end_of_text|> (seen only with ignore_eos); after "Q": "!" then <|eom_id|>."""
    tid = hf.token_to_id
    last = hf.encode("<|end_header_id|>\n\n", add_special_tokens=False).ids[-1]
    letters = [tid(c) for c in ANSWER]
    chain = {last: letters[0], **dict(zip(letters, letters[1:])), letters[-1]: tid("<|eot_id|>"),
             tid("<|eot_id|>"): tid("<|end_of_text|>"), tid("Q"): tid("!"), tid("!"): tid("<|eom_id|>")}
    assert len(set(chain.values())) == len(chain) and last not in letters + [tid("Q"), tid("!")]
    return chain


def write_hf_dir(path) -> None:
    """The HF directory: <|eot_id|> only in tokenizer_config.json, <|end_of_text|> in the configs."""
    hf = tokenizer_with_specials()
    os.makedirs(path)
    with open(os.path.join(FIXTURES, "parity", "llama", "config.json")) as f:
        config = json.load(f)
    config.update(vocab_size=hf.get_vocab_size(), tie_word_embeddings=False, num_key_value_heads=KV_HEADS,
                  bos_token_id=hf.token_to_id("<|begin_of_text|>"), eos_token_id=hf.token_to_id("<|end_of_text|>"))
    files = {"config.json": config,
             "generation_config.json": {"bos_token_id": config["bos_token_id"],
                                        "eos_token_id": config["eos_token_id"]},
             "tokenizer_config.json": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                       "chat_template": TEMPLATE}}
    for name, data in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(hf.to_str())
    safetensors.numpy.save_file(forced_tensors(hf.get_vocab_size(), forced_chain(hf)),
                                os.path.join(path, "model.safetensors"))


def write_gguf(path) -> None:
    """The GGUF file: eos <|end_of_text|>, eot <|eot_id|>, eom <|eom_id|>; the same forced weights."""
    hf = tokenizer_with_specials()
    model = json.loads(hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + SPECIALS
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, BLOCKS), (w.add_context_length, 64), (w.add_embedding_length, DIM),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_rope_dimension_count, HEAD), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "gpt-2"),
                       (w.add_token_list, tokens), (w.add_token_merges, merges), (w.add_chat_template, TEMPLATE),
                       (w.add_token_types, [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))):
        add(value)
    for add, token in ((w.add_bos_token_id, "<|begin_of_text|>"), (w.add_eos_token_id, "<|end_of_text|>"),
                       (w.add_eot_token_id, "<|eot_id|>"), (w.add_eom_token_id, "<|eom_id|>")):
        add(tokens.index(token))
    for name, array in forced_tensors(len(tokens), forced_chain(hf)).items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, HEADS if "q_proj" in name else KV_HEADS)
        w.add_tensor(gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"hf": run directory, "gguf": run directory, "printed": what each import printed}, through the CLI."""
    from dantinox.cli.entrypoint import main

    d = tmp_path_factory.mktemp("k11")
    write_hf_dir(d / "hf-src")
    write_gguf(d / "tiny.gguf")
    out = {"printed": {}}
    for name, source in (("hf", d / "hf-src"), ("gguf", d / "tiny.gguf")):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["import", str(source), "--out", str(d / name)]) == 0
        out[name], out["printed"][name] = str(d / name), printed.getvalue()
    return out


def tokenizer_of(run) -> TextTokenizer:
    return TextTokenizer.load(os.path.join(run, "tokenizer.json"))


def ids_of(run, *texts):
    return [tokenizer_of(run).hf.token_to_id(t) for t in texts]


def test_k11_import_merges_the_stop_ids_of_every_file_and_lists_them(runs):
    eot, end, eom = ids_of(runs["hf"], "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
    for name, want in (("hf", [end, eot]), ("gguf", [end, eot, eom])):
        with open(os.path.join(runs[name], "generation_config.json")) as f:
            assert json.load(f)["eos_token_ids"] == want
        assert read_stop_ids(runs[name], tokenizer_of(runs[name])) == tuple(want)
        summary = read_summary(runs[name])
        assert summary["stop_token_ids"] == want
        assert summary["stop_tokens"][want.index(eot)] == "<|eot_id|>"
    with open(os.path.join(runs["hf"], "tokenizer_config.json")) as f:
        assert json.load(f)["eos_token"] == "<|eot_id|>"  # a template's {{ eos_token }} stays the turn's end
    printed = runs["printed"]["gguf"]
    assert f"stops at token ids: {end} (<|end_of_text|>), {eot} (<|eot_id|>), {eom} (<|eom_id|>)" in printed


@pytest.mark.parametrize("name", ["hf", "gguf"])
def test_k11_generator_stops_at_end_of_turn_on_every_path(runs, name):
    gen = Generator(runs[name], warmup=False)
    prompt = gen.chat_format.template.render(QUESTION)  # a chat-shaped prompt for the plain paths
    assert gen.chat(QUESTION, 10, temperature=0) == ANSWER
    done = gen.complete(prompt, 10, temperature=0)
    assert (done.text, done.tokens, done.finish_reason) == (ANSWER, len(ANSWER) + 1, "stop")
    assert gen.generate(prompt, 10, temperature=0) == ANSWER
    assert "".join(gen.stream(prompt, 10, temperature=0, chunk_size=2)) == ANSWER
    past = gen.complete(prompt, 7, temperature=0, ignore_eos=True)
    assert past.text.startswith(ANSWER + "<|eot_id|><|end_of_text|>") and past.finish_reason == "length"
    assert gen.chat(QUESTION, 7, temperature=0, ignore_eos=True).startswith(ANSWER + "<|eot_id|>")
    eom = gen.complete("Q", 4, temperature=0)  # only the GGUF file names <|eom_id|>
    if name == "gguf":
        assert (eom.text, eom.finish_reason) == ("!", "stop")
    else:
        assert eom.text.startswith("!<|eom_id|>")  # the HF files name no <|eom_id|>: not a stop id there


def test_k11_generate_cli_stops_at_end_of_turn(runs, capsys):
    run = runs["hf"]
    prompt = load_chat_format(run, tokenizer_of(run)).template.render(QUESTION)
    rc, out, err = run_main(["generate", "--run_dir", run, "--chat", "Dove siamo?", "--temperature", "0"], capsys)
    assert rc == 0 and out == ANSWER + "\n", err
    rc, out, err = run_main(["generate", "--run_dir", run, "--prompt", prompt, "--temperature", "0"], capsys)
    assert rc == 0 and out == prompt + ANSWER + "\n", err
    assert f"{len(ANSWER) + 1} new tokens" in err and "ended by stop id" in err and "<|eot_id|>" in err
    rc, out, _ = run_main(["generate", "--run_dir", run, "--prompt", prompt, "--temperature", "0", "--stream",
                           "--ignore_eos", "--max_new_tokens", "6"], capsys)
    assert rc == 0 and out == prompt + ANSWER + "<|eot_id|><|end_of_text|>\n"
    rc, out, _ = run_main(["generate", "--run_dir", run, "--chat", "Dove siamo?", "--temperature", "0",
                           "--ignore_eos", "--max_new_tokens", "6"], capsys)
    assert rc == 0 and out == ANSWER + "<|eot_id|><|end_of_text|>\n"


@pytest.mark.slow  # the paged engine compiles for ~15 s on two CPUs; the Generator test above is the cheap one
def test_k11_server_stops_at_end_of_turn(runs):
    run = runs["gguf"]
    model, _, tokenizer, _ = load_run(run)
    chat = load_chat_format(run, tokenizer)
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=32, max_running=1, max_batched_tokens=16,
                                             decode_buckets=(1,), prefill_buckets=(1,), chunk_buckets=(16,),
                                             max_decode_steps=1))  # one request at a time: few programs
    prompt = chat.template.render(QUESTION)
    with ServerThread(create_app(engine, tokenizer, "tiny", chat, read_stop_ids(run, tokenizer))) as server:
        post = lambda path, **body: httpx.post(server.url + path, json=body, timeout=60).json()  # noqa: E731
        done = post("/v1/completions", prompt=prompt, max_tokens=10, temperature=0)
        assert done["choices"][0]["text"] == ANSWER and done["choices"][0]["finish_reason"] == "stop"
        assert done["usage"]["completion_tokens"] == len(ANSWER) + 1  # the stop token counts, unseen
        eom = post("/v1/completions", prompt="Q", max_tokens=4, temperature=0)["choices"][0]
        assert (eom["text"], eom["finish_reason"]) == ("!", "stop")
        past = post("/v1/completions", prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True)["choices"][0]
        assert past["text"] == ANSWER + "<|eot_id|><|end_of_text|>" and past["finish_reason"] == "length"
        streamed = httpx.post(server.url + "/v1/completions", json=dict(prompt=prompt, max_tokens=10, temperature=0,
                              stream=True), timeout=60).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ANSWER
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        answer = post("/v1/chat/completions", messages=QUESTION, max_tokens=10, temperature=0)["choices"][0]
        assert answer["message"]["content"] == ANSWER and answer["finish_reason"] == "stop"
        past = post("/v1/chat/completions", messages=QUESTION, max_tokens=6, temperature=0, ignore_eos=True)
        assert past["choices"][0]["message"]["content"] == ANSWER + "<|eot_id|><|end_of_text|>"
        bad = httpx.post(server.url + "/v1/completions", json=dict(prompt="Q", ignore_eos="yes"), timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


def test_k11_runs_written_before_keep_working(tmp_path):
    """A run imported before the merge (generation_config.json's list from one file only) still stops at its
    tokenizer_config.json eos_token; an HF-style eos_token_id int or list is read; a trained run has none."""
    from chat_util import chat_tokenizer

    run, tokenizer = str(tmp_path), chat_tokenizer()  # the files read_stop_ids reads, as an older import left them
    with open(os.path.join(run, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{{ messages[0]['content'] }}", "eos_token": "<|im_end|>"}, f)
    im_end = tokenizer.hf.token_to_id("<|im_end|>")
    assert read_stop_ids(run, tokenizer) == (im_end,)   # from tokenizer_config.json's eos_token alone
    with open(os.path.join(run, "generation_config.json"), "w") as f:
        json.dump({"eos_token_ids": [3], "eos_token_id": [5, 3]}, f)
    assert read_stop_ids(run, tokenizer) == (3, 5, im_end) == load_chat_format(run, tokenizer).stop_ids
    os.remove(os.path.join(run, "generation_config.json"))
    os.remove(os.path.join(run, "tokenizer_config.json"))  # now as a trained run: no stop ids
    assert read_stop_ids(run, tokenizer) == ()
