"""Run llama.cpp's own server test suite (its OpenAI-compatible part) against ``dantinox serve``.

llama.cpp keeps pytest tests of its server in ``tools/server/tests`` (``unit/`` and a ``utils.py`` whose
``ServerProcess`` starts ``llama-server``). This script copies that folder as it is into a work folder, adds
the launcher ``dantinox_launcher.py`` beside it (a pytest plugin that makes ``ServerProcess.start`` point at a
running ``dantinox serve`` instead of starting llama-server; the test bodies are not touched) and runs the
tests of OPENAI_TESTS with pytest, then prints one line per test: passed / failed and the assertion that
failed. docs/how-to/llamacpp-suite.md lists the expected failures and why.

  python tools/llamacpp_suite/run_suite.py --tests LLAMA_CPP/tools/server/tests --run-dir runs/smollm2 \
      [--work /tmp/lcpp-suite] [--junit out.xml] [-- extra pytest args]

The llama.cpp source tree is, e.g., the one vendored in the llama-cpp-python source package
(``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``, then unpack;
``vendor/llama.cpp/tools/server/tests``). Its tests need pytest, requests, filelock and the openai client (all
in dantinox's test extra); ``wget`` (used only to download llama.cpp's own models) is replaced by a stub.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent

# the tests that speak the OpenAI API (or the API-key checks) and need no llama.cpp-only endpoint, embeddings,
# images or one of llama.cpp's own models
OPENAI_TESTS = [
    "unit/test_basic.py::test_server_start_simple",
    "unit/test_basic.py::test_server_models",
    "unit/test_completion.py::test_completion_with_openai_library",
    "unit/test_completion.py::test_completion_stream_with_openai_library",
    "unit/test_chat_completion.py",
    "unit/test_compat_oai_responses.py",
    "unit/test_tool_call.py::test_completion_without_tool_call_fast",
    "unit/test_security.py::test_access_public_endpoint",
    "unit/test_security.py::test_incorrect_api_key",
    "unit/test_security.py::test_correct_api_key",
    "unit/test_security.py::test_correct_api_key_anthropic_header",
    "unit/test_security.py::test_openai_library_correct_api_key",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", required=True, help="llama.cpp's tools/server/tests folder")
    p.add_argument("--run-dir", required=True, help="the dantinox run directory to serve (e.g. runs/smollm2)")
    p.add_argument("--work", default="/tmp/dantinox-lcpp-suite", help="where the copy of the tests goes")
    p.add_argument("--junit", default=None, help="also write pytest's JUnit XML here")
    p.add_argument("--serve-flag", action="append", default=[], help="one more flag for dantinox serve")
    p.add_argument("--select", action="append", default=None, help="run these test ids instead of OPENAI_TESTS")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k logprobs")
    args = p.parse_args(argv)
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(args.tests, work, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    shutil.copy(HERE / "dantinox_launcher.py", work / "dantinox_launcher.py")
    junit = Path(args.junit).resolve() if args.junit else work / "junit.xml"
    env = {**os.environ, "DANTINOX_SUITE_RUN_DIR": str(Path(args.run_dir).resolve()),
           "DANTINOX_SUITE_SERVE_FLAGS": "\x1f".join(args.serve_flag), "PYTHONPATH": str(work)}
    command = [sys.executable, "-m", "pytest", "-p", "dantinox_launcher", "-o", "addopts=", "-q", "-rN",
               "--tb=line", f"--junitxml={junit}", "-p", "no:cacheprovider", *(args.select or OPENAI_TESTS),
               *args.pytest_args]
    subprocess.run(command, cwd=work, env=env, check=False)
    return summarize(junit)


def summarize(junit: Path) -> int:
    """Print one line per test case of the JUnit file: outcome, name, first line of the failure."""
    root = ET.parse(junit).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            counts["failed"] += 1
            first = (failure.get("message") or "").strip().splitlines()
            print(f"FAILED  {name}: {first[0][:200] if first else ''}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            print(f"SKIPPED {name}")
        else:
            counts["passed"] += 1
            print(f"PASSED  {name}")
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
