"""Importing published checkpoints into ordinary dantinox run directories.

  hf_config.py       a transformers ``config.json`` dict -> ImportSpec (ModelConfig + weight layout facts),
                     refusing anything dantinox cannot run exactly
  hf_gemma.py        the Gemma 3 / Gemma 2 fields of a config.json (norms, GeGLU, windows, two RoPE bases)
  hf_weights.py      HF-named tensors -> the dantinox parameter tree, every shape checked against the config
  hf_dir.py          reading a Hugging Face model directory (config, safetensors shards, tokenizer, template)
  chat_template_choice.py  which chat template an import gets (--chat-template, the checkpoint's, Gemma's turns)
  run_dir_writer.py  ``write_run_dir``: the one entry point every source (HF directory, GGUF) ends in
  gguf_source.py     ``read_gguf(path) -> hf_dir.HFCheckpoint``: a GGUF file as the same inputs (HF tensor
                     names and layouts, a tokenizer.json text, template, generation)
  gguf_architectures.py  general.architecture -> the HF twin's config and tensor names (llama, qwen2, qwen3,
                     phi3); gguf_gemma3.py Gemma 3's mapping
  gguf_metadata.py   typed access to a file's metadata, errors naming the key
  gguf_shapes.py     the metadata checked against the tensors' shapes before any tensor is read
  gguf_rope.py       Llama 3's rope parameters recovered from rope_freqs.weight
  gguf_tokenizer.py  GGUF tokenizer metadata -> a tokenizer.json (gguf_sentencepiece.py: SentencePiece)
  errors.py          CheckpointError, GGUFError

Every failure raises :class:`CheckpointError` with one line naming the file or field, the value and what is
allowed; ``dantinox import`` prints it and exits 2.
"""

from .errors import CheckpointError
from .hf_config import ImportSpec, import_spec
from .hf_weights import convert_weights
from .run_dir_writer import write_run_dir

__all__ = ["CheckpointError", "ImportSpec", "convert_weights", "import_spec", "write_run_dir"]
