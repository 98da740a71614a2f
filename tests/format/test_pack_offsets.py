"""``layout.pack_offsets`` (the one offset assignment of every save) inlines ``place`` and
``item_align`` for speed (100k tensors in a first save's plan): it must give exactly the
offsets and file length of placing the items one by one with the layout's rule."""

import random

import pytest

from zerostall.format import layout


def _one_by_one(sizes, start):
    offsets, pos = [], start
    for n in sizes:
        off, pos = layout.place(pos, n)
        offsets.append(off)
    return offsets, max(layout.align_up(pos), start)


EDGES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 4095, 4096, 4097,
         (256 << 10) - 1, 256 << 10, (256 << 10) + 1]


@pytest.mark.parametrize("seed", range(20))
def test_pack_offsets_equals_placing_one_by_one(seed):
    rng = random.Random(seed)
    sizes = [rng.choice(EDGES + [rng.randint(0, 1 << 21), rng.randint(0, 5000)]) for _ in range(rng.randint(0, 400))]
    for start in (layout.HEADER_BYTES, 8192):
        assert layout.pack_offsets(sizes, start) == _one_by_one(sizes, start)


def test_pack_offsets_every_alignment_class():
    sizes = EDGES * 3
    offsets, end = layout.pack_offsets(sizes)
    assert (offsets, end) == _one_by_one(sizes, layout.HEADER_BYTES)
    assert all(o % layout.item_align(n) == 0 for o, n in zip(offsets, sizes))
    assert end % 4096 == 0 and end >= offsets[-1] + sizes[-1]
