"""`python -m treadle ...` is the `treadle` command."""

import sys

from treadle.cli import main

sys.exit(main())
