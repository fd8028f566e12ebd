"""``python -m moeinfer ARGS`` runs the ``moeinfer`` command line (``moeinfer --help``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
