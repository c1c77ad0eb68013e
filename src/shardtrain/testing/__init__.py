"""Test support shipped with the package: a persistent multi-process Gloo pool."""

from .pool import ProcessGroupPool, RankFailure

__all__ = ["ProcessGroupPool", "RankFailure"]
