"""``python -m constrained_serve.cli``: the same as the ``constrained-serve`` command."""

import sys

from .command import main

sys.exit(main())
