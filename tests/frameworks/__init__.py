"""The framework tests run small training apps (``*_app.py``) in child processes and import
them: this folder goes on ``sys.path``, :func:`app_env` is a child's environment, :func:`run_app`
runs one and :func:`export` runs ``zerostall export``."""

import os
import subprocess
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


def run_app(script, outdir, *args, timeout, **env):
    """Run this folder's ``script`` on ``outdir`` with ``args`` as a child (:func:`app_env` with
    ``env``) and wait up to ``timeout`` seconds; the finished process, its output captured."""
    return subprocess.run([sys.executable, os.path.join(HERE, script), str(outdir), *args], env=app_env(**env),
                          timeout=timeout, capture_output=True, text=True)


def export(fmt, src, dst):
    """``zerostall export --format fmt src dst`` through the installed command; asserts it exits 0."""
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "zerostall"), "export", "--format", fmt,
                        str(src), str(dst)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
