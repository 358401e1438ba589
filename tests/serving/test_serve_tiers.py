"""`dantinox serve` with KV tiers: bad tier flags are refused before the model loads (one line naming the flag),
a tier below one block after it; the start-up line gives each tier's bytes and blocks, `dantinox budget` prices
them; a server killed with SIGKILL while it answers and writes blocks, restarted over the same --kv-disk-dir,
answers every prompt it had answered with the same greedy text, serves their prefixes from disk, refuses and
recomputes a damaged block file and drops a temporary file a killed write left."""

import os
import signal
import socket
import subprocess
import time

import httpx
import pytest
from cli_util import start_cli
from run_util import make_run

from dantinox.cli import entrypoint as cli
from dantinox.cli.serve import build_engine, tier_summary
from dantinox.kv.allocator import hash_block
from dantinox.kv.sizes import tier_block_bytes
from dantinox.runs.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("tiers") / "tiny", attention="gqa", kv_heads=2)


@pytest.mark.parametrize("flags, match", [
    (["--kv-host-memory", "0"], "--kv-host-memory 0 is not allowed"),
    (["--kv-disk-bytes", "1GB"], "--kv-disk-bytes needs --kv-disk-dir"),
    (["--kv-host-memory", "1GB", "--no-prefix-caching"], "--kv-host-memory is not allowed with --no-prefix-caching"),
    (["--kv-disk-dir", "FILE/sub"], r"--kv-disk-dir \S+FILE/sub is not a writable directory"),
    (["--session-dir", "FILE/sub"], r"--session-dir \S+FILE/sub is not a writable directory"),
])
def test_bad_tier_flags_are_refused_before_loading(flags, match, tmp_path, capsys):
    blocker = tmp_path / "FILE"
    blocker.write_text("a file, not a directory")
    flags = [f.replace("FILE", str(blocker)) for f in flags]
    missing = str(tmp_path / "no-such-run")
    with pytest.raises(ValueError, match=match):
        build_engine(cli.build_parser().parse_args(["serve", "--run_dir", missing] + flags))
    assert cli.main(["serve", "--run_dir", missing] + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flags[0] in err


def test_a_tier_below_one_block_names_the_flag_and_the_start_up_line_gives_each_tier(run_dir, tmp_path):
    args = ["serve", "--run_dir", run_dir, "--block-size", "4"]
    with pytest.raises(ValueError, match=r"--kv-host-memory 100: holds no block: one block takes \d+ bytes"):
        build_engine(cli.build_parser().parse_args(args + ["--kv-host-memory", "100"]))
    with pytest.raises(ValueError, match=r"--kv-disk-bytes 100: holds no block"):
        build_engine(cli.build_parser().parse_args(args + ["--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "100"]))
    engine, _, _ = build_engine(cli.build_parser().parse_args(
        args + ["--kv-host-memory", "1MiB", "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "2MiB"]))
    block = tier_block_bytes(engine.cfg, 4)
    line = tier_summary(engine)
    assert line.startswith(f"KV tiers: host memory 1.00 MiB = {2**20 // block} blocks = {2**20 // block * 4} "
                           f"tokens; disk 2.00 MiB = {2 * 2**20 // block} blocks in {tmp_path}/")
    assert f"({block} bytes per block of 4 tokens)" in line and "0 blocks = 0.00 MiB there from earlier runs" in line


def test_budget_prices_the_tiers(capsys):
    assert cli.main(["budget", "--preset", "tiny", "--dtype", "fp32", "--kv-host-memory", "1MiB",
                     "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    import dantinox as dx
    cfg = dx.ModelConfig.from_preset("tiny")
    block = tier_block_bytes(cfg, 4)
    row = next(line for line in out.splitlines() if line.strip().startswith("*mha") and f" {block} " in line)
    assert f"{2**20 // block:,}" in row and f"{2**20 // block * 4:,}" in row
    assert cli.main(["budget", "--preset", "tiny", "--kv-disk-bytes", "lots"]) == 2


# A server killed and restarted ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(run_dir, disk, log_path):
    port = _free_port()
    log = open(log_path, "a")
    proc = start_cli("serve", "--run_dir", run_dir, "--port", port, "--no-warmup", "--block-size", "4",
                     "--kv-disk-dir", disk, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, open(log_path).read()
        time.sleep(0.5)
    raise AssertionError("the server did not start: " + open(log_path).read())


def _complete(url, prompt, n=8) -> dict:
    r = httpx.post(url + "/v1/completions", json=dict(prompt=prompt, max_tokens=n, temperature=0.0), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow   # two server processes (about a minute)
def test_a_server_killed_mid_write_and_restarted_answers_the_same_and_refuses_a_damaged_block(run_dir, tmp_path):
    disk, log_path = str(tmp_path / "kv"), str(tmp_path / "serve.log")
    prompts = ["Nel mezzo del cammin di nostra vita", "mi ritrovai per una selva oscura", "la diritta via era"]
    proc, url = _start(run_dir, disk, log_path)
    try:
        before = [_complete(url, p)["choices"][0]["text"] for p in prompts[:2]]
        with httpx.stream("POST", url + "/v1/completions", timeout=300,   # killed while it answers this one
                          json=dict(prompt=prompts[2] * 2, max_tokens=20, temperature=0.0, stream=True)) as r:
            for _ in r.iter_lines():
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(60)
    folder = next(os.path.join(disk, d) for d in os.listdir(disk))
    tokenizer = TextTokenizer.load(os.path.join(run_dir, "tokenizer.json"))
    ids, parent, names = tokenizer.encode(prompts[0]), None, []
    for i in range(len(ids) // 4):
        parent = hash_block(parent, ids[4 * i:4 * (i + 1)])
        names.append(os.path.join(folder, parent.hex() + ".kvb"))
    assert all(os.path.exists(n) for n in names)
    damaged = names[2]
    with open(damaged, "r+b") as f:   # a block cut short, as a crash of the machine could leave it
        f.truncate(os.path.getsize(damaged) // 2)
    leftover = os.path.join(folder, "ab" * 16 + f".kvb.{proc.pid}.0badf00d.tmp")   # a write the kill cut off
    with open(leftover, "wb") as f:
        f.write(b"DTXKV01\nhalf")
    proc, url = _start(run_dir, disk, log_path)
    try:
        again = [_complete(url, p) for p in prompts[:2]]
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert [a["choices"][0]["text"] for a in again] == before
    assert again[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 8   # two blocks, then the damaged one
    n = len(tokenizer.encode(prompts[1]))
    assert again[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == min(n // 4 * 4, n - 1)
    assert 'dantinox_kv_tier_refused_total{tier="disk"} 1.0' in metrics
    assert not os.path.exists(leftover)
    log = open(log_path).read()
    assert log.count("refused") == 1 and damaged in log and "Traceback" not in log
