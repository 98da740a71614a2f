"""Staging: plan the snapshot, own the arena, copy tensors into it (snapshot thread)."""

from .arena import Arena
from .plan import PlanItem, SavePlan, build_plan
from .ring import BlockRing

__all__ = ["Arena", "BlockRing", "PlanItem", "SavePlan", "build_plan"]
