"""``python -m kvarn_cutlass.cli``: the same as the ``kvarn-cutlass`` command."""

import sys

from . import main

sys.exit(main())
