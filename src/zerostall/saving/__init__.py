"""The save walk: request and stage records, plan and plan cache, snapshot, persist, commit
(local and across ranks), post-commit subscribers (remote upload, retention), incremental.

Called by :class:`zerostall.Checkpointer` only; imports ``memory``, ``io``, ``store``,
``distributed``, ``peers`` and ``format`` (downward), never the faces.
"""

from .plan import PlanItem, SavePlan, build_plan

__all__ = ["PlanItem", "SavePlan", "build_plan"]
