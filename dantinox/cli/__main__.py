"""``python -m dantinox.cli``: the same as the ``dantinox`` command."""

import sys

from .main import main

sys.exit(main())
