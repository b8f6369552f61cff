"""``python -m pat_engine.serve`` is ``pat-serve``."""

import sys

from pat_engine.serve.cli import main

sys.exit(main())
