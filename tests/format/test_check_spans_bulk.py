"""``validate.check_spans`` checks large manifests' spans in bulk (numpy) and falls back to
the per-span loop wherever anything is off: both must agree on every input, clean or not
(overlaps, exact duplicates that become aliases, misalignment, spans past the file's end,
unlisted files, sizes beyond int64), over packed offsets and page-per-item ones (which the
packed rules accept too)."""

import random

import pytest

from zerostall.errors import CorruptCheckpoint
from zerostall.format import validate as V
from zerostall.format.layout import ALIGN_BYTES, align_up, pack_offsets


def _run(spans, sizes, bulk_min):
    old = V._BULK_SPANS
    V._BULK_SPANS = bulk_min
    try:
        return "ok", V.check_spans(spans, sizes, "manifest.json")
    except CorruptCheckpoint as exc:
        return "error", str(exc)
    finally:
        V._BULK_SPANS = old


def _case(rng, layout):
    k = rng.randint(1, 150)
    nbytes = [rng.choice([0, 1, 2, 3, 5, 8, 12, 17, 4095, 4096, 4100, 262144, 262145, rng.randint(0, 300000)])
              for _ in range(k)]
    if layout == 2:
        offs, end = pack_offsets(nbytes)
        offs = list(offs)
    else:
        offs, pos = [], ALIGN_BYTES
        for n in nbytes:
            offs.append(pos)
            pos = align_up(pos + n)
        end = pos
    files = {"rank-0.shard": end}
    what = rng.random()
    if what < 0.15 and k > 1:
        i = rng.randrange(1, k)
        offs[i] = offs[i - 1]  # overlap
    elif what < 0.25:
        offs[rng.randrange(k)] += rng.choice([1, 8, 64])  # unaligned (or overlapping)
    elif what < 0.35 and k > 1:
        i = rng.randrange(1, k)
        offs[i], nbytes[i] = offs[i - 1], nbytes[i - 1]  # an exact duplicate: an alias
    elif what < 0.45:
        files["rank-0.shard"] = offs[-1] + nbytes[-1] - 1  # the last one past the end
    elif what < 0.5:
        files = {"other.shard": end}  # not listed
    elif what < 0.55:
        offs[rng.randrange(k)] = 1 << 64  # beyond int64
    spans = [V.Span(i, "rank-0.shard", o, n, ("float32", (n,), 0), f"t.{i}") for i, (o, n) in enumerate(zip(offs, nbytes))]
    rng.shuffle(spans)
    return spans, files


@pytest.mark.parametrize("layout", [1, 2])
def test_bulk_and_loop_agree(layout):
    rng = random.Random(layout)
    clean = 0
    for _ in range(400):
        spans, files = _case(rng, layout)
        loop = _run(spans, files, 1 << 60)
        assert _run(spans, files, 1) == loop
        clean += loop == ("ok", {})
    assert 100 < clean < 400  # both kinds of input were exercised


def test_a_clean_large_manifest_takes_the_bulk_path(monkeypatch):
    nbytes = [4 * (i % 7) for i in range(5000)]
    offs, end = pack_offsets(nbytes)
    spans = [V.Span(i, "f", o, n, ("float32", (n // 4,), 0), f"t.{i}") for i, (o, n) in enumerate(zip(offs, nbytes))]
    monkeypatch.setattr(V, "item_align", None)  # the loop would call it: the bulk path must not need it
    assert V.check_spans(spans, {"f": end}, "m") == {}


def test_parsed_column_spans_agree_with_span_objects():
    """A version 3 manifest's entries reach check_spans as columns (format.table.EntrySpans),
    Span objects built only if the loop runs: same answers as with the objects."""
    from zerostall.format.table import EntrySpans, TensorEntry
    rng = random.Random(7)
    for _ in range(200):
        spans, files = _case(rng, 2)
        spans.sort(key=lambda s: s.index)
        entries = [TensorEntry(s.key, "float32", s.ident[1], s.file, s.offset, s.nbytes, 0) for s in spans]
        cols = EntrySpans(entries, [s.file for s in spans])
        objs = list(cols)
        assert [(o.index, o.file, o.offset, o.nbytes, o.key) for o in objs] == \
               [(s.index, s.file, s.offset, s.nbytes, s.key) for s in spans]
        for bulk_min in (1, 1 << 60):
            assert _run(cols, files, bulk_min) == _run(objs, files, bulk_min)
