"""The speed tricks on torch tensors (the rest, which need no torch, are in :mod:`._fast`), each
beside a plain twin that gives the same result (``tests/api/test_fast.py``). Any thread.
"""

from __future__ import annotations

from typing import Callable

import torch


def plain_shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """The twin of :data:`shape_of`."""
    return tuple(t.shape)


shape_of: Callable[[torch.Tensor], tuple[int, ...]] = getattr(torch._C, "_non_sym_sizes", None) or plain_shape_of
"""A tensor's sizes as a plain tuple of ints, without building a ``torch.Size`` (torch's private
``_non_sym_sizes`` where this torch has it)."""
