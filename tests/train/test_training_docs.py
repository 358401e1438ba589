"""docs/how-to/train.md: the commands work as written once the text is in the current directory, the sha256 it
gives is the one the bundled models were trained on, and its download step produces the poem only."""

import json
import os
import re
import subprocess
import sys

from paths import REPO

from dantinox.cli import entrypoint as cli

ROOT = REPO
DOC = open(os.path.join(ROOT, "docs", "how-to", "train.md"), encoding="utf-8").read()


def _train_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC, re.S)
    commands = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()
                if line.startswith("dantinox train")]
    return [c.split()[1:] for c in commands]


def test_train_commands_read_the_text_from_the_current_directory():
    commands = _train_commands()
    assert len(commands) >= 2
    for argv in commands:
        args = cli.build_parser().parse_args(argv)  # every flag as written exists
        assert args.data == "divina_commedia.txt"
    assert "../shared" not in DOC


def test_documented_sha256_is_the_bundled_models_data():
    for name in ("dante", "dante-diffusion"):
        with open(os.path.join(ROOT, "dantinox", "bundled", name, "model_summary.json")) as f:
            assert json.load(f)["data_sha256"] in DOC, name


def test_download_step_keeps_the_poem_only(tmp_path):
    script = re.search(r"python - <<'PY'\n(.*?)\nPY\n", DOC, re.S).group(1)
    poem = "CANTO PRIMO\n\n  Nel mezzo del cammin di nostra vita\nmi ritrovai per una selva oscura\n"
    raw = ("\ufeffThe Project Gutenberg eBook of La Divina Commedia di Dante\r\n\r\n*** START OF THE PROJECT "
           "GUTENBERG EBOOK 1000 ***\r\nLA DIVINA COMMEDIA\r\nINDICE\r\n\r\n" + poem.replace("\n", "\r\n") +
           "\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK 1000 ***\r\nlicence text\r\n")
    (tmp_path / "pg1000.txt").write_text(raw, encoding="utf-8", newline="")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=60)
    assert (tmp_path / "divina_commedia.txt").read_text(encoding="utf-8") == poem.strip() + "\n"
