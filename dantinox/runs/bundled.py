"""The run directories and the text slices shipped inside the package, and their short names.

``dantinox/bundled/<name>/`` holds a complete run directory (config.json, model.safetensors, tokenizer.json,
model_summary.json). Wherever a run directory is asked for (``--run_dir``, ``Generator(...)``,
``load_run``), a path that does not exist but is a bundled name (``dante``, ``dante-diffusion``) means that
model, so ``--run_dir dante-diffusion`` works from any directory after ``pip install``. An existing path
always wins over a name. ``dantinox models`` lists them.

``dantinox/bundled/slices/<name>.txt`` are the three quality slices (public domain; their README says what
each is): ``it-heldout``, ``rare-latin-occitan``, ``en-shakespeare``. Wherever a slice file is asked for
(``eval --slice``, ``plan --slice``, ``plan trace --rare-file``) the same rule holds: an existing path wins,
otherwise a bundled slice name means that file (:func:`resolve_slice_file`).
"""

from __future__ import annotations

import json
import os
from importlib import resources

DEFAULT_BUNDLED = "dante"
SLICES = "slices"  # the folder of bundled/ that holds the quality slices


def bundled_root() -> str:
    """The folder that holds the bundled run directories."""
    return os.fspath(resources.files("dantinox") / "bundled")


def bundled_names() -> list[str]:
    """Names of the bundled run directories, sorted (those that hold a config.json)."""
    root = bundled_root()
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "config.json")))


def bundled_run_dir(name: str = DEFAULT_BUNDLED) -> str:
    """Path of the bundled run directory ``name`` (default: the Divina Commedia GQA model)."""
    return os.path.join(bundled_root(), name)


def resolve_run_dir(run_dir: str | os.PathLike | None) -> str:
    """The path a run directory argument means: None -> the default bundled model; an existing path -> itself;
    otherwise a bundled name -> that bundled model's path; otherwise the path unchanged (the loader then
    says it does not exist and lists the bundled names)."""
    if run_dir is None:
        return bundled_run_dir()
    path = os.fspath(run_dir)
    if not os.path.exists(path) and path in bundled_names():
        return bundled_run_dir(path)
    return path


def describe_bundled() -> list[dict]:
    """One dict per bundled model: name, paradigm, attention, parameters, size_mib (files on disk),
    max_context, vocab_size, tokenizer, path."""
    rows = []
    for name in bundled_names():
        path = bundled_run_dir(name)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        summary_path = os.path.join(path, "model_summary.json")
        summary = {}
        if os.path.isfile(summary_path):
            with open(summary_path, encoding="utf-8") as f:
                summary = json.load(f)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        rows.append(dict(name=name, paradigm=cfg.get("paradigm", "ar"), attention=cfg.get("attention"),
                         parameters=summary.get("parameters"), size_mib=size / 2**20,
                         max_context=cfg.get("max_context"), vocab_size=cfg.get("vocab_size"),
                         tokenizer=summary.get("tokenizer"), path=path))
    return rows




def bundled_slice_names() -> list[str]:
    """Names of the bundled quality slices, sorted (the ``<name>.txt`` files of ``bundled/slices/``)."""
    folder = os.path.join(bundled_root(), SLICES)
    if not os.path.isdir(folder):
        return []
    return sorted(n[:-len(".txt")] for n in os.listdir(folder) if n.endswith(".txt"))


def resolve_slice_file(value: str | os.PathLike) -> str:
    """The path a slice file argument means: an existing path -> itself; otherwise a bundled slice name
    (:func:`bundled_slice_names`) -> that file's path. Raises FileNotFoundError, naming the value and the
    bundled names, for anything else."""
    path = os.fspath(value)
    if os.path.exists(path):
        return path
    if path in bundled_slice_names():
        return os.path.join(bundled_root(), SLICES, path + ".txt")
    raise FileNotFoundError(f"{path}: no such file, and not a bundled slice (bundled: "
                            f"{', '.join(bundled_slice_names()) or 'none'})")
