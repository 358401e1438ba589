"""Read a GGUF file (llama.cpp's single-file format) as a Hugging Face checkpoint: config, tensors, tokenizer.

``read_gguf(path)`` returns the :class:`~dantinox.checkpoints.hf_dir.HFCheckpoint` a Hugging Face model
directory of the same model would give:
  config             the config.json dict of the matching transformers class (``gguf_architectures``: llama,
                     qwen2, qwen3, phi3, gemma3 through ``gguf_gemma3``)
  tensors            HF tensor names ("model.layers.0.self_attn.q_proj.weight") -> float32 [out, in] arrays
  tokenizer_json     tokenizer.json text (``gguf_tokenizer``: byte-level BPE or SentencePiece)
  chat_template      tokenizer.chat_template, or None
  generation         bos_token_id, and eos_token_id: the ids of tokenizer.ggml.eos_token_id, eot_token_id
                     (end of turn) and eom_token_id (end of message), in that order, without repeats
  special_tokens     bos_token / eos_token: the texts of those ids
so ``write_run_dir`` turns it into a run directory as it would a downloaded model (``dantinox import``).

Order of the checks. ``general.architecture`` and ``tokenizer.ggml.model`` are checked the moment the reader
parses them (the first metadata entries in files llama.cpp writes), so an unsupported architecture or
tokenizer kind is refused before the rest of the metadata and any tensor description is read. Then the
architecture's config is built from the metadata, with the layer count and every tensor's shape checked
against it (``gguf_shapes``, naming the key at fault), before any tensor data is read.

Tensors are dequantized with the ``gguf`` package's own ``gguf.quants.dequantize`` (F32, F16, BF16 and every
block format that package reads). A GGUF tensor of logical shape [in, out] (ggml order, fastest dimension
first) is the row-major array [out, in], which is already the HF / torch ``nn.Linear`` layout.

With ``keep_blocks=True`` (what ``dantinox import FILE.gguf`` does unless --dtype is given) the matrices in a
block format dantinox's kernel runs (``dantinox.quant.block_formats.BLOCK_FORMATS``: Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL, Q2_K..Q6_K, IQ4_XS) stay as stored: a :class:`~dantinox.quant.block_formats.BlockMatrix` of the
raw uint8 rows (q/k rows reordered as whole rows, which does not touch a block). F32 / F16 / BF16 tensors are
widened to float32 as before. A matrix in another format (Q8_1, MXFP4, the 1-3-bit IQ formats, ...) is refused
naming the tensor and format, and a block whose float16 scale is NaN or inf is refused naming the tensor.

RoPE layout (llama only). llama.cpp applies rotary embeddings to adjacent pairs (x[2i], x[2i+1]) for llama
files; HF Llama rotates halves (x[i], x[i + D/2]). Its converter (convert_hf_to_gguf.py, ``LlamaModel.permute``)
therefore reorders the rows of q_proj and k_proj inside each head: HF row (h, j, r) with j in {0, 1} (which
half), r < D/2 becomes GGUF row (h, r, j). :func:`unpermute_rope_rows` undoes it (as transformers does when it
loads a GGUF file), so the tensors are exactly HF's. qwen2, qwen3 and phi3 files rotate halves already.

Errors: :class:`GGUFError` (a CheckpointError) with one line: not a GGUF file, corrupt or truncated, an
unsupported architecture or tokenizer kind, metadata that disagrees with the tensors (the key named), a tensor
type the ``gguf`` package cannot dequantize (the tensor and type named), an unknown tensor name.
Shape letters: E model width, F MLP width, H query heads, K KV heads, D head size, V vocabulary.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from ..quant.block_formats import BLOCK_FORMATS, BlockMatrix, check_blocks, row_bytes
from .errors import CheckpointError, GGUFError
from .gguf_architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, GGUFArchitecture, check_architecture
from .gguf_metadata import Metadata
from .gguf_tokenizer import GGUFTokenizerError, check_tokenizer_kind, tokenizer_json
from .hf_dir import HFCheckpoint

__all__ = ["GGUFError", "SUPPORTED_ARCHITECTURES", "read_gguf", "open_reader", "read_metadata"]
# metadata keys checked while the reader parses them (before the tensor descriptions): key -> check(value)
EARLY_CHECKS = {"general.architecture": check_architecture, "tokenizer.ggml.model": check_tokenizer_kind}


def read_metadata(reader) -> dict:
    """Every metadata key of a ``gguf.GGUFReader`` as plain Python (str, int, float, bool or lists of them)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def open_reader(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` for ``path``. Raises GGUFError for a missing, non-GGUF, corrupt or truncated file
    (a tensor whose data runs past the end of the file is named, with the bytes it needs and the bytes left),
    and GGUFError / GGUFTokenizerError for an unsupported architecture or tokenizer kind (EARLY_CHECKS, raised
    as soon as the key is parsed)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return _checked_reader_class()(path, "r")
    except CheckpointError as err:   # an EARLY_CHECKS refusal
        raise type(err)(f"{path}: {err}") from None
    except _TruncatedTensor as err:
        raise GGUFError(f"{path}: {err}") from None
    except Exception as err:  # the reader raises ValueError, struct.error, IndexError... on damaged files
        raise GGUFError(f"{path}: {_header_problem(path)} ({type(err).__name__}: {err})") from None


def _header_problem(path: str) -> str:
    """What a GGUF file that the reader could not open declares against what it holds: its 24-byte header
    (magic, version, tensor count, metadata count, little-endian) and its size in bytes."""
    size = os.path.getsize(path)
    if size < 24:
        return f"truncated GGUF file: {size} bytes, shorter than the 24-byte GGUF header"
    with open(path, "rb") as f:
        version, tensors, entries = struct.unpack("<IQQ", f.read(24)[4:])
    return (f"truncated or corrupt GGUF file: its header (version {version}) declares {entries} metadata "
            f"entries and {tensors} tensors, but their descriptions do not fit or do not parse in its {size} bytes")


class _TruncatedTensor(ValueError):
    pass


def _checked_reader_class():
    """gguf.GGUFReader that runs EARLY_CHECKS on each key as it is parsed, and first checks every tensor's byte
    range against the file's size, so a truncated file is reported by tensor name and sizes instead of by the
    numpy reshape that would fail inside the reader. The ranges follow the reader's own layout (data offset +
    offset of the tensor; ggml's bytes per block from gguf.GGML_QUANT_SIZES)."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _push_field(self, field, skip_sum=False):
            size = super()._push_field(field, skip_sum)
            if field.name in EARLY_CHECKS:
                EARLY_CHECKS[field.name](field.contents())
            return size

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                problem = _past_the_end(field, start_offs, len(self.data))
                if problem:
                    raise _TruncatedTensor(problem)
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def _past_the_end(field, start_offs: int, size: int) -> str | None:
    """What is wrong with one tensor-info field whose data runs past ``size`` bytes, or None (also when the
    field's layout is not the one this check knows: the reader then reports whatever it finds)."""
    import gguf

    try:
        _, name, _, dims, raw_type, offset = field.parts
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        need = int(np.prod(dims)) * type_size // block
        start = int(start_offs + offset[0])
        label = bytes(name).decode("utf-8", "replace")
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    if start + need <= size:
        return None
    shape = [int(d) for d in reversed(dims.tolist())]
    return (f"tensor {label} ({qtype.name}, shape {shape}) needs {need} bytes from offset {start}, but the file "
            f"has {max(size - start, 0)} bytes there ({size} bytes in all): the file is truncated")


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (adjacent RoPE pairs) to HF's (rotate-half).

    weight: [heads * D, E] as stored in the GGUF file; heads: H for q_proj, K for k_proj.
    Returns [heads * D, E] with row (h, j, r) = GGUF row (h, r, j) for j < 2, r < D / 2.
    """
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def dequantize(tensor, path: str) -> np.ndarray:
    """A GGUF tensor as float32 [rows, cols] (numpy order: the reverse of ggml's shape).

    Raises GGUFError naming the tensor and its type when the ``gguf`` package cannot dequantize that type,
    or when the values are not finite (a damaged file).
    """
    import gguf

    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    try:
        array = np.asarray(gguf.quants.dequantize(tensor.data, qtype), np.float32)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {tensor.name} has quantization type {qtype.name}, which the gguf "
                        f"package cannot dequantize (supported here: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                        f"Q8_0, Q2_K..Q6_K)") from None
    except Exception as err:
        raise GGUFError(f"{path}: tensor {tensor.name} ({qtype.name}) cannot be read: {err}") from None
    array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if not np.all(np.isfinite(array)):
        raise GGUFError(f"{path}: tensor {tensor.name} holds non-finite values (NaN or inf); the file is damaged")
    return array


FLOAT_TYPES = ("F32", "F16", "BF16")


def raw_blocks(tensor, path: str) -> BlockMatrix | None:
    """The tensor as stored (a BlockMatrix of its uint8 rows [out, row bytes]) when it is a matrix in one of
    the kernel's block formats; None for F32 / F16 / BF16 and vectors (dequantize those). Raises GGUFError
    naming the tensor for another block format, or for blocks with a NaN / inf scale."""
    import gguf

    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    if qtype.name in FLOAT_TYPES or len(tensor.shape) != 2:
        return None
    if qtype.name not in BLOCK_FORMATS:
        raise GGUFError(f"{path}: tensor {tensor.name} is in block format {qtype.name}, which dantinox's block "
                        f"kernel does not run (it runs {', '.join(BLOCK_FORMATS)}); import with --dtype float32 "
                        f"to dequantize it")
    n_in, n_out = (int(d) for d in tensor.shape)
    data = np.asarray(tensor.data).reshape(n_out, row_bytes(qtype.name, n_in))
    bad = check_blocks(data, qtype.name)
    if bad:
        raise GGUFError(f"{path}: tensor {tensor.name} ({qtype.name}) has {bad} block(s) whose scale is NaN or "
                        f"inf; the file is damaged")
    return BlockMatrix(qtype.name, data, n_out, n_in)


def architecture(meta: dict, path: str) -> GGUFArchitecture:
    """The GGUFArchitecture of ``general.architecture``; GGUFError when the key is missing or unsupported."""
    if "general.architecture" not in meta:
        raise GGUFError(f"{path}: metadata key 'general.architecture' is missing")
    try:
        check_architecture(meta["general.architecture"])
    except GGUFError as err:
        raise GGUFError(f"{path}: {err}") from None
    return ARCHITECTURES[meta["general.architecture"]]


def read_gguf(path: str | os.PathLike, keep_blocks: bool = False) -> HFCheckpoint:
    """Read ``path`` (a .gguf file of a supported architecture) as an HFCheckpoint.

    Returns float32 tensors in HF layout and names (q/k rows un-permuted for llama, see the module docstring);
    with keep_blocks, the matrices in the kernel's block formats as BlockMatrix (see the module docstring).
    Raises GGUFError / GGUFTokenizerError (both ValueError) with one line naming the problem.
    """
    path = os.fspath(path)
    reader = open_reader(path)
    try:
        meta = read_metadata(reader)
    except Exception as err:
        raise GGUFError(f"{path}: corrupt GGUF metadata ({type(err).__name__}: {err})") from None
    arch = architecture(meta, path)
    by_name = {t.name: t for t in reader.tensors}
    config = arch.config(Metadata(meta, arch.name, path), by_name)
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name in arch.consumed:
            continue
        hf_name = arch.hf_name(tensor.name)
        if hf_name is None:
            raise GGUFError(f"{path}: unknown tensor {tensor.name!r} for a {arch.name} model")
        array = (raw_blocks(tensor, path) if keep_blocks else None)
        if array is None:
            array = dequantize(tensor, path)
            if arch.norm_offset and tensor.name.endswith("norm.weight"):
                array = array + np.float32(arch.norm_offset)
        tensors[hf_name] = _rows_reordered(array, hf_name, config) if arch.rope_rows_permuted else array
    try:
        tok_json = tokenizer_json(meta)
    except GGUFTokenizerError as err:
        raise GGUFTokenizerError(f"{path}: {err}") from None
    generation, special = stop_tokens(meta)
    return HFCheckpoint(config, tensors, tok_json, meta.get("tokenizer.chat_template"), generation, special)


def _rows_reordered(array, hf_name: str, config: dict):
    """q_proj / k_proj rows back in HF order (unpermute_rope_rows), a BlockMatrix's stored rows included."""
    heads = {"q_proj.weight": config["num_attention_heads"], "k_proj.weight": config["num_key_value_heads"]}
    for suffix, n in heads.items():
        if hf_name.endswith(suffix):
            if isinstance(array, BlockMatrix):
                return BlockMatrix(array.fmt, unpermute_rope_rows(array.data, n), array.n_out, array.n_in)
            return unpermute_rope_rows(array, n)
    return array


EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def stop_tokens(meta: dict) -> tuple[dict, dict]:
    """({"bos_token_id", "eos_token_id": [ids of EOS_KEYS]}, {"bos_token", "eos_token": texts}) of a GGUF
    file's metadata (keys that are absent are left out; the ids are checked by ``write_run_dir``)."""
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    eos = list(dict.fromkeys(meta[k] for k in EOS_KEYS if meta.get(k) is not None))
    generation = {"eos_token_id": eos} if eos else {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        generation["bos_token_id"] = bos
    special = {}
    for name, value in (("bos_token", bos), ("eos_token", eos[0] if eos else None)):
        if isinstance(value, int) and 0 <= value < len(tokens):
            special[name] = tokens[value]
    return generation, special
