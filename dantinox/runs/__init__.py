"""What lies on disk: the run directory, its tokenizer and chat template, the bundled runs, atomic writes.

  run_dir.py         save_run / load_run: config.json, model.safetensors, tokenizer.json, summary.json
  tokenizer.py       text <-> ids through a Hugging Face tokenizer.json
  chat.py            a run's chat settings; chat_template.py renders a conversation with its template
  stop_ids.py        the token ids that end generation (end of turn / end of text), merged from the run's files
  bundled.py         the run directories and quality slices shipped in the package, by name
  files.py           writes that leave the old content or the new, never half of either
  input_files.py     files a user names (configs, traces, gates): read as UTF-8 / YAML / JSON, one error line
  weights_checksum.py  the SHA-256 of model.safetensors: recorded at save, checked at load
  chars_per_token.py the most characters one token stands for: a lower bound on a text's tokens from its length
  interrupts.py      Ctrl-C: loops that stop at a whole state and say what they kept
"""

from .bundled import bundled_names, bundled_run_dir, bundled_slice_names, resolve_run_dir, resolve_slice_file
from .chat import ChatFormat, NoChatTemplateError, load_chat_format
from .chat_template import ChatTemplate, ChatTemplateError
from .files import atomic_write_bytes, atomic_write_json
from .run_dir import RunDirError, load_run, read_summary, save_run
from .stop_ids import merge_stop_ids, read_stop_ids
from .tokenizer import StreamDecoder, TextTokenizer, train_tokenizer

__all__ = ["ChatFormat", "ChatTemplate", "ChatTemplateError", "NoChatTemplateError", "RunDirError",
           "StreamDecoder", "TextTokenizer", "atomic_write_bytes", "atomic_write_json", "bundled_names",
           "bundled_run_dir", "bundled_slice_names", "load_chat_format", "load_run", "merge_stop_ids",
           "read_stop_ids", "read_summary", "resolve_run_dir", "resolve_slice_file", "save_run", "train_tokenizer"]
