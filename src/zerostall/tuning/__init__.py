"""Tuning: ``doctor`` (host and directory checks, sysctl advice) and ``plan`` (sizing).

Reads the host; changes nothing unless ``apply_sysctls`` is called (``doctor --apply``).
"""

from .plan import PlanInput, PlanResult, parse_count, plan
from .sysctl import RECOMMENDED, read_sysctls

__all__ = ["PlanInput", "PlanResult", "RECOMMENDED", "parse_count", "plan", "read_sysctls"]
