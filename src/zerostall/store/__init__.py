"""Tiers: where committed checkpoints live (local directory now; remote tiers plug in here)."""

from .local import LocalTier

__all__ = ["LocalTier"]
