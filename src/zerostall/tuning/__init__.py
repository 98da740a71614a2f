"""Tuning: ``doctor`` (host and directory checks, sysctl advice) and ``plan`` (sizing). Reads
the host; changes nothing unless ``apply_sysctls`` is called (``doctor --apply``).
"""
