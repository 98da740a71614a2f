"""The main job and the proof: ``zerostall demo`` and ``zerostall bench``."""
