"""`python -m dropless.bench NAME [args]`: the same as `dropless bench NAME [args]` (gmm, ep, step, memory)."""

import sys

from dropless.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
