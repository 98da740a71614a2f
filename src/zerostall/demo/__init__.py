"""``zerostall demo``: a small transformer trained with async checkpoints, killed mid-persist and
resumed bit-exact (:mod:`.run`); its model and deterministic corpus (:mod:`.model`). Uses only the
public API; nothing below imports it."""
