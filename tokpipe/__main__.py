"""`python -m tokpipe`: the `tokpipe` command, as `python -m tokpipe.cli` runs it."""

import sys

from tokpipe.cli import main

sys.exit(main())
