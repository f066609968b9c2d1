"""``python -m bench.compare BASE [...]``: the command line of :mod:`bench.compare.compare`."""

import sys

from bench.compare.compare import main

sys.exit(main())
