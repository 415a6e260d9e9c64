"""``python -m autosplit`` is the same as the ``autosplit`` command."""

from autosplit.cli import entry

entry()
