"""The ``dantinox`` command: argparse and printing live here and nowhere else, one file per subcommand.

  entrypoint.py  the parser, ``main``, user errors -> exit 2, ``models``
  flags.py     flags several subcommands share (--kv-dtype, --quantize, --mesh, the distributed group)
  structured.py  generate's --json-schema / --regex / --grammar flags
  generate.py, chat.py, verify.py, eval.py, budget.py, serve.py, plan.py (+ plan_run.py),
  import_checkpoint.py, train.py: one subcommand each, over its library package
"""

from .entrypoint import main

__all__ = ["main"]
