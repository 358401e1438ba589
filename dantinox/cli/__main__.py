"""``python -m dantinox.cli``: the same as the ``dantinox`` command."""

import sys

from .entrypoint import main

sys.exit(main())
