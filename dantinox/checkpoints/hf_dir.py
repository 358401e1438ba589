"""Reading a Hugging Face model directory: config, safetensors weights (one file or shards), tokenizer, chat
template and generation defaults.

Expected files (as ``save_pretrained`` writes them):
  config.json                      required
  model.safetensors                or shards listed in model.safetensors.index.json ("weight_map"), or, without
                                   an index, every *.safetensors file in the directory
  tokenizer.json                   required (the ``tokenizers`` file; a SentencePiece tokenizer.model alone is
                                   not read)
  tokenizer_config.json            optional; its ``chat_template`` (a string, or a list of {name, template}
                                   from which "default" is taken) unless chat_template.jinja exists, and its
                                   special token texts (bos_token, eos_token, unk_token, pad_token)
  chat_template.jinja              optional (transformers 5 writes the template here)
  generation_config.json           optional; bos_token_id from it or else config.json; eos_token_id: the ids of
                                   both (generation_config.json's first), since either may name the turn's end

Tensors are memory-mapped and read with numpy from the safetensors header (F32, F16, BF16 via ml_dtypes, F64),
so bfloat16 checkpoints need no torch. Every problem raises CheckpointError naming the file.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ..runs.input_files import read_json
from ..runs.chat import SPECIAL_TOKENS
from ..runs.stop_ids import id_list, token_text
from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


@dataclass
class HFCheckpoint:
    """The inputs of ``write_run_dir`` read from a directory (see the module docstring for each file)."""

    config: dict
    tensors: dict[str, np.ndarray]
    tokenizer_json: str
    chat_template: str | None
    generation: dict
    special_tokens: dict = field(default_factory=dict)  # {"eos_token": "<|eot_id|>", ...}: texts, where known


def read_hf_dir(path: str | os.PathLike) -> HFCheckpoint:
    """Read the Hugging Face model directory ``path``.

    Raises CheckpointError (one line naming the file): not a directory, no config.json, no weights, a shard
    listed in the index but missing, a corrupt or truncated safetensors file, a tensor of an unsupported dtype,
    no tokenizer.json, unreadable JSON.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"SOURCE {path} is not a directory (a Hugging Face model directory or a .gguf file)")
    config = _json(path, "config.json", required=True)
    tensors: dict[str, np.ndarray] = {}
    for shard in _weight_files(path):
        for name, array in read_safetensors(shard).items():
            if name in tensors:
                raise CheckpointError(f"{shard}: tensor {name} also appears in another shard")
            tensors[name] = array
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"SOURCE {path} has no tokenizer.json (the `tokenizers` file is required)")
    with open(tok_path, encoding="utf-8") as f:
        tokenizer_json = f.read()
    tok_config = _json(path, "tokenizer_config.json") or {}
    generation = dict(_json(path, "generation_config.json") or {})
    if generation.get("bos_token_id") is None and config.get("bos_token_id") is not None:
        generation["bos_token_id"] = config["bos_token_id"]
    eos = id_list(generation.get("eos_token_id")) + id_list(config.get("eos_token_id"))
    if eos:
        generation["eos_token_id"] = list(dict.fromkeys(eos))
    special = {name: token_text(tok_config.get(name)) for name in SPECIAL_TOKENS}
    return HFCheckpoint(config, tensors, tokenizer_json, _chat_template(path, tok_config), generation,
                        {k: v for k, v in special.items() if v is not None})


def _json(path: str, name: str, required: bool = False) -> Any:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        if required:
            raise CheckpointError(f"SOURCE {path} has no {name}")
        return None
    return read_json(file, error=CheckpointError)   # naming the file: a directory, not UTF-8, not JSON


def _weight_files(path: str) -> list[str]:
    index = _json(path, INDEX_FILE)
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{os.path.join(path, INDEX_FILE)}: no 'weight_map' object")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not os.path.isfile(os.path.join(path, shard)):
                raise CheckpointError(f"shard {shard} listed in {INDEX_FILE} is missing from {path}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        other = [n for n in ("pytorch_model.bin", "model.bin") if os.path.exists(os.path.join(path, n))]
        hint = f" ({other[0]} is a pickle; convert it to safetensors)" if other else ""
        raise CheckpointError(f"SOURCE {path} has no *.safetensors weights{hint}")
    return files


def read_safetensors(file: str) -> dict[str, np.ndarray]:
    """name -> read-only memory-mapped array of one safetensors file. Raises CheckpointError if corrupt."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({err})") from err
    header.pop("__metadata__", None)
    data = np.memmap(file, np.uint8, "r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name} has dtype {info.get('dtype')}; allowed: "
                                  f"{sorted(SAFETENSORS_DTYPES)}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end > data.size or end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{file}: tensor {name} lies outside the file or disagrees with its shape "
                                  f"{list(shape)} (truncated file?)")
        out[name] = data[start:end].view(dtype).reshape(shape)
    return out


def _chat_template(path: str, tok_config: dict) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
