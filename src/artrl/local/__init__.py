"""Training and serving on this machine: LocalBackend and the run directory layout."""

from .backend import LocalBackend

__all__ = ["LocalBackend"]
