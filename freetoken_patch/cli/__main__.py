"""`python -m freetoken_patch.cli`: the same as the `ftpatch` console script."""
import sys

from . import main

sys.exit(main())
