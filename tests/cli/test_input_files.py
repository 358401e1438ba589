"""Every file the command line names (a config, a trace, a gate, a schema, a profile ...) is read the same way:
a file that is missing, a directory, not UTF-8 text or not valid YAML / JSON gets one line on stderr naming the
flag and the file, exit status 2: never a bare "'utf-8' codec can't decode byte 0xff", an "[Errno 21]" or a
parser's multi-line report, and never after minutes of profiling or training."""

import json
import socket

import pytest
from cli_util import run_main

NOT_UTF8 = b"\xff\xfe model: 1\n"
NOT_YAML = "slices: [unclosed\n"
NOT_JSON = "{not json\n"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _trace(tmp_path) -> str:
    path = tmp_path / "good-trace.jsonl"
    path.write_text(json.dumps({"arrival": 0.0, "prompt_tokens": 4, "max_tokens": 2}) + "\n")
    return str(path)


def _text(tmp_path) -> str:
    path = tmp_path / "good-text.txt"
    path.write_text("Nel mezzo del cammin di nostra vita\n" * 20)
    return str(path)


def _gate(tmp_path) -> str:
    path = tmp_path / "good-gate.yaml"
    path.write_text("slices:\n  mine: {loss_change_pct: 1.0}\n")
    return str(path)


def _plan(tmp_path, *extra):
    return ["plan", "--trace", _trace(tmp_path), "--slo", "ttft_p99=500", "--device-memory", "1GB",
            "--out", str(tmp_path / "plan"), *extra]


# (case id, flag named in the message, the file's syntax ("yaml", "json", "text"), argv builder (tmp, FILE))
CASES = [
    ("train-config", "--config", "yaml",
     lambda t, f: ["train", "--data", _text(t), "--out", str(t / "run"), "--config", f]),
    ("train-data", "--data", "text",
     lambda t, f: ["train", "--data", f, "--out", str(t / "run"), "--preset", "tiny", "--steps", "1"]),
    ("budget-config", "--config", "yaml", lambda t, f: ["budget", "--config", f]),
    ("serve-config", "--config", "yaml", lambda t, f: ["serve", "--config", f, "--port", str(_free_port())]),
    ("generate-json-schema", "--json-schema", "json",
     lambda t, f: ["generate", "--prompt", "Nel", "--max_new_tokens", "2", "--json-schema", f]),
    ("generate-grammar", "--grammar", "text",
     lambda t, f: ["generate", "--prompt", "Nel", "--max_new_tokens", "2", "--grammar", f]),
    ("eval-gate", "--gate", "yaml", lambda t, f: ["eval", "--slice", "it-heldout", "--gate", f]),
    ("eval-slice", "--slice", "text", lambda t, f: ["eval", "--slice", f"mine={f}"]),
    ("plan-trace", "--trace", "json",
     lambda t, f: ["plan", "--trace", f, "--slo", "ttft_p99=500", "--device-memory", "1GB"]),
    ("plan-candidates", "--candidates", "yaml", lambda t, f: _plan(t, "--candidates", f)),
    ("plan-profile", "--profile", "json", lambda t, f: _plan(t, "--profile", f)),
    ("plan-baseline", "--baseline", "json", lambda t, f: _plan(t, "--baseline", f)),
    ("plan-gate", "--gate", "yaml", lambda t, f: _plan(t, "--gate", f, "--slice", "it-heldout")),
    ("plan-slice", "--slice", "text", lambda t, f: _plan(t, "--gate", _gate(t), "--slice", f"mine={f}")),
    ("plan-trace-from", "--from", "json",
     lambda t, f: ["plan", "trace", "--out", str(t / "t.jsonl"), "--from", "mooncake", f]),
    ("plan-trace-rare-file", "--rare-file", "text",
     lambda t, f: ["plan", "trace", "--out", str(t / "t.jsonl"), "--rare-file", f]),
    ("plan-simulate-config", "--config", "yaml",
     lambda t, f: ["plan", "simulate", "--trace", _trace(t), "--config", f]),
    ("plan-simulate-trace", "--trace", "json", lambda t, f: ["plan", "simulate", "--trace", f]),
    ("plan-replay-config", "--config", "yaml",
     lambda t, f: ["plan", "replay", "--trace", _trace(t), "--config", f]),
    ("plan-gate-candidate", "--candidate", "json",
     lambda t, f: ["plan", "gate", "--candidate", f, "--last-good", f]),
]
FAULTS = ("missing", "directory", "not-utf8", "not-valid")


def _make(tmp_path, fault: str, syntax: str) -> str:
    path = tmp_path / ("input.json" if syntax == "json" else "input.yaml" if syntax == "yaml" else "input.txt")
    if fault == "directory":
        path.mkdir()
    elif fault == "not-utf8":
        path.write_bytes(NOT_UTF8)
    elif fault == "not-valid":
        path.write_text(NOT_JSON if syntax == "json" else NOT_YAML)
    return str(path)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("case, flag, syntax, argv", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_file_is_one_line_naming_its_flag_and_file(tmp_path, capsys, case, flag, syntax, argv, fault):
    if fault == "not-valid" and syntax == "text":
        pytest.skip("plain text has no syntax to break (not UTF-8 is the fault a text file can have)")
    path = _make(tmp_path, fault, syntax)
    status, out, err = run_main(argv(tmp_path, path), capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("dantinox "), line
    assert flag in line and path in line, line
    for raw in ("[Errno", "codec can't decode", "Traceback", "JSONDecodeError", "UnicodeDecodeError"):
        assert raw not in line, line
    reason = {"missing": "no such file", "directory": "a directory", "not-utf8": "not UTF-8",
              "not-valid": "not valid"}[fault]
    assert reason.lower() in line.lower(), line
