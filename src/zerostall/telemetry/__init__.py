"""Host telemetry: /proc samplers (:mod:`.host`), the per-save record and its sinks
(:mod:`.record`, :mod:`.prometheus`), ``zerostall trace``'s tracers. Never changes a sysctl or a cgroup.
"""
