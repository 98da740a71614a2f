"""Host telemetry: /proc samplers (:mod:`.host`), the per-save record and its sinks
(:mod:`.record`, :mod:`.prometheus`), ``zerostall monitor``/``trace``. Never changes a sysctl or a cgroup.
"""
