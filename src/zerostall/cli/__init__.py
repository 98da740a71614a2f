"""The ``zerostall`` command line: :func:`main` parses and dispatches to the subcommands."""

from .app import main

__all__ = ["main"]
