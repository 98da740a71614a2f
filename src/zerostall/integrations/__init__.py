"""Adapters for training frameworks, on top of the public API; each imported on demand.

- :mod:`zerostall.integrations.lightning`: ``ZerostallCheckpointIO`` (a Lightning ``CheckpointIO``).
- :mod:`zerostall.integrations.transformers`: ``ZerostallTrainerMixin`` and ``ZerostallTrainer``.
- :mod:`zerostall.integrations.accelerate`: ``ZerostallAcceleratorMixin`` and ``ZerostallAccelerator``.
- torchtitan: a recipe in ``docs/integrations.md`` (``zerostall.dcp.Writer``/``Reader``).

Nothing here is imported by ``import zerostall``; importing a submodule imports its framework.
"""
