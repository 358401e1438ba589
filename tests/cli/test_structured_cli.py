"""``dantinox generate --json-schema FILE | --regex R | --grammar FILE`` on the bundled model (issue 21): the
printed text is valid for the constraint (checked with ``jsonschema`` and ``re``, not with the grammar engine),
and bad input (an invalid regex, schema or grammar, a file that cannot be read or is not JSON, --stream, two
flags at once) exits 2 with one line naming the flag; ``serve --tool-call-parser`` takes only a known parser."""

import json
import re

import jsonschema
import pytest
from cli_util import run_main

PROMPT = "Nel mezzo"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["verso", "canto"],
          "properties": {"verso": {"type": "string", "maxLength": 12},
                         "canto": {"type": "integer", "minimum": 1, "maximum": 34}}}
LARK = 'start: "Canto " NUM " di " PART\nNUM: /[1-9][0-9]?/\nPART: "Inferno" | "Purgatorio" | "Paradiso"\n'


def generated(capsys, *flags) -> str:
    status, out, err = run_main(["generate", "--prompt", PROMPT, "--max_new_tokens", "60", "--temperature", "1",
                                 "--seed", "3", *flags], capsys)
    assert status == 0, err
    assert out.startswith(PROMPT), out
    assert "stop id none" not in err   # the bundled model has no stop ids: a complete match ends it, said so
    assert "ended where the constraint is complete" in err or "new tokens" in err, err
    return out[len(PROMPT):].rstrip("\n")


def test_regex_schema_and_grammar_outputs_are_valid(tmp_path, capsys):
    text = generated(capsys, "--regex", "(Inferno|Purgatorio|Paradiso) [IVX]{1,4}")
    assert re.fullmatch(r"(Inferno|Purgatorio|Paradiso) [IVX]{1,4}", text), text
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    jsonschema.validate(json.loads(generated(capsys, "--json-schema", str(schema))), SCHEMA)
    grammar = tmp_path / "canto.lark"
    grammar.write_text(LARK)
    text = generated(capsys, "--grammar", str(grammar))
    assert re.fullmatch(r"Canto [1-9][0-9]? di (Inferno|Purgatorio|Paradiso)", text), text


def one_error_line(capsys, *flags) -> str:
    status, _, err = run_main(["generate", "--prompt", PROMPT, "--max_new_tokens", "8", *flags], capsys)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_bad_constraints_exit_2_naming_the_flag(tmp_path, capsys):
    assert "--regex (unclosed:" in one_error_line(capsys, "--regex", "(unclosed")
    missing = tmp_path / "missing.json"
    assert f"--json-schema {missing}: no such file" in one_error_line(capsys, "--json-schema",
                                                                                   str(missing))
    not_json = tmp_path / "not.json"
    not_json.write_text("{type: object")
    assert f"--json-schema {not_json}: not valid JSON" in one_error_line(capsys, "--json-schema", str(not_json))
    bad_type = tmp_path / "bad.json"
    bad_type.write_text('{"type": "objectx"}')
    assert f"--json-schema {bad_type}:" in one_error_line(capsys, "--json-schema", str(bad_type))
    grammar = tmp_path / "bad.lark"
    grammar.write_text('start: "a" undefined_rule\n')
    assert f"--grammar {grammar}:" in one_error_line(capsys, "--grammar", str(grammar))
    assert "--stream is not supported with --regex" in one_error_line(capsys, "--regex", "a+", "--stream")


@pytest.mark.parametrize("argv, message", [
    (["generate", "--regex", "a", "--grammar", "g.lark"], "argument --grammar: not allowed with argument --regex"),
    (["serve", "--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice: 'mistral'"),
])
def test_flag_combinations_refused_by_the_parser(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        run_main(argv, capsys)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
