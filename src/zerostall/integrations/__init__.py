"""Adapters for training frameworks, on top of the public API; each imported on demand.

- :mod:`zerostall.integrations.lightning`: ``ZerostallCheckpointIO`` (a Lightning ``CheckpointIO``).
- :mod:`zerostall.integrations.transformers`: ``ZerostallTrainerMixin`` and ``ZerostallTrainer``.
- :mod:`zerostall.integrations.accelerate`: ``ZerostallAcceleratorMixin`` and ``ZerostallAccelerator``.
- torchtitan: a recipe in ``docs/integrations.md`` (``zerostall.dcp.Writer``/``Reader``).
- :mod:`zerostall.integrations.export`: ``zerostall export --format lightning|transformers|accelerate``
  (the files each framework's own checkpointing reads; imports no framework).

Nothing here is imported by ``import zerostall``; importing a submodule imports its framework.
"""
