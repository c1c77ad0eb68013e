"""The Fabric-like engine: launching local processes, device and process-group setup, `Engine`."""

from .engine import Engine

__all__ = ["Engine"]
