"""``python -m zerostall.cli``: the same as the ``zerostall`` command."""

import sys

from .app import main

sys.exit(main())
