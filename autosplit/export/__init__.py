"""A plan written out for another trainer to launch: :mod:`~autosplit.export.torchtitan`."""

from __future__ import annotations

from autosplit.export.torchtitan import TORCHTITAN_SCHEDULES, torchtitan_config

__all__ = ["TORCHTITAN_SCHEDULES", "torchtitan_config"]
