"""Experiment trackers behind one interface (base.py), started together and fed together (trackers.py)."""

from .base import Logger, RunInfo, scalars
from .trackers import LOGGER_NAMES, Trackers, start_trackers

__all__ = ["LOGGER_NAMES", "Logger", "RunInfo", "Trackers", "scalars", "start_trackers"]
