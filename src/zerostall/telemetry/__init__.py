"""Host telemetry: /proc samplers, the per-save record and its sinks.

Read-only: this layer never changes a sysctl or a cgroup.
"""

from .host import HostSample, Sampler, read_psi, read_vmstat
from .record import SaveRecord

__all__ = ["HostSample", "Sampler", "SaveRecord", "read_psi", "read_vmstat"]
