"""The framework tests run small training apps (``*_app.py``) in child processes and import
them: this folder goes on ``sys.path``, and :func:`app_env` is a child's environment."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def app_env(**extra):
    """The environment of an app run as a child: this checkout's zerostall and tests on
    PYTHONPATH, one OpenMP thread (the machine is shared), then ``extra``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")]), "OMP_NUM_THREADS": "1",
            **extra}
