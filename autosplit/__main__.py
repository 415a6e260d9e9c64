"""``python -m autosplit`` is the same as the ``autosplit`` command."""

import sys

from autosplit.cli import main

sys.exit(main())
