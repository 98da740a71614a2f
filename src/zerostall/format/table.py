"""The manifest's tensor table (format version 3, columns: docs/manifest-format.md): its
encoding, its parser, and the save path's encoder. Called by :class:`~.manifest.Manifest` (any
thread) and by the single-rank committer through :func:`tensors_json` (persist thread).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import validate as V
from .validate import ITEMSIZE_BY_NAME as _ITEMSIZE_BY_NAME, unknown_dtype
from .._fast import CRC32C, DTYPE, KEY, NBYTES, OFFSET, SHAPE, frozen_maker

FORMAT_VERSION_TABLE = 3
COLUMNS = ("key", "dtype", "shape", "file", "offset", "nbytes", "crc32c")


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    crc32c: int
    step: int | None = None
    """Set for a reference: the bytes live in ``step-<step>/<file>`` (see :mod:`.refs`)."""

    def to_json(self) -> dict[str, Any]:
        """The entry as one JSON object (``inspect --json``)."""
        out = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "file": self.file,
               "offset": self.offset, "nbytes": self.nbytes, "crc32c": self.crc32c}
        if self.step is not None:
            out["step"] = self.step
        return out


new_entry = frozen_maker(TensorEntry)
"""``new_entry(key=, dtype=, shape=, file=, offset=, nbytes=, crc32c=, step=)``: an already checked entry."""


FileSlot = tuple[str, str, "int | None"]
"""(name as the entry records it, the span's file for :func:`~.validate.check_spans`, step)."""


def file_slots(files: Sequence[str], refs: Sequence[Any]) -> list[FileSlot]:
    """The targets of a version 3 ``file`` index: own files, then ``ref_files`` in order."""
    return [(f, f, None) for f in files] + [(r.name, f"step-{r.step}/{r.name}", r.step) for r in refs]


def encode_columns(tensors: Sequence[TensorEntry], files: Sequence[str], refs: Sequence[Any] = ()) -> dict[str, Any]:
    """``tensors`` as the version 3 table (``files``: the body's file names, in order)."""
    index = {(s, n): i for i, (n, _, s) in enumerate(file_slots(files, refs))}
    dtypes: dict[str, int] = {}
    for t in tensors:
        dtypes.setdefault(t.dtype, len(dtypes))
    try:
        fcol = [index[(t.step, t.file)] for t in tensors]
    except KeyError as exc:
        raise ValueError(f"a tensor entry's file {exc} is not in the manifest's files") from None
    return {"dtypes": list(dtypes), "key": [t.key for t in tensors], "dtype": [dtypes[t.dtype] for t in tensors],
            "shape": [list(t.shape) for t in tensors], "file": fcol, "offset": [t.offset for t in tensors],
            "nbytes": [t.nbytes for t in tensors], "crc32c": [t.crc32c for t in tensors]}


def tensors_json(tensors: Sequence[TensorEntry], memo: dict[Any, Any] | None = None) -> str:
    """``tensors`` (entries of one file, without references) as the version 3 table, exactly as
    :meth:`~.manifest.Manifest.to_bytes` encodes it. With ``memo`` (the save plan's) every
    column but ``crc32c`` is encoded once per layout. Persist thread."""
    if not isinstance(tensors, Entries):
        files = {t.file: None for t in tensors}
        if len(files) > 1:
            raise ValueError("tensors_json: entries in several files are encoded by Manifest.to_bytes")
        if any(t.step is not None for t in tensors):
            raise ValueError("tensors_json: references are encoded by Manifest.to_bytes")
        tensors = Entries(tensors, next(iter(files), ""), list(map(CRC32C, tensors)))
    key = ("tensors_json", len(tensors), tensors.file)
    head = memo.get(key) if memo is not None else None
    if head is None:
        head = tensors.json_head()
        if memo is not None:
            memo[key] = head
    return "".join((head, "[", ",".join(map(str, tensors.crcs)), "]}"))


class Entries(Sequence[TensorEntry]):
    """The tensor entries of one written shard as the save plan's items, the shard's name and
    the crc32c values: a :class:`TensorEntry` is made only on access. The single-rank
    committer's (persist thread). Immutable; compares like the tuple of its entries."""

    __slots__ = ("items", "file", "crcs")

    def __init__(self, items: Sequence[Any], file: str, crcs: Sequence[int]):
        if len(items) != len(crcs):
            raise ValueError(f"{len(items)} items but {len(crcs)} crc32c values")
        self.items, self.file, self.crcs = items, file, crcs

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        it = self.items[i]
        return TensorEntry(it.key, it.dtype, tuple(it.shape), self.file, it.offset, it.nbytes, self.crcs[i])

    def __iter__(self) -> Iterator[TensorEntry]:
        return map(self.__getitem__, range(len(self.items)))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, (tuple, Entries)) and tuple(self) == tuple(other)

    def json_head(self) -> str:
        """The version 3 table up to ``"crc32c":`` (:func:`tensors_json`)."""
        items = self.items

        def dumps(v: Any) -> str:
            return json.dumps(v, separators=(",", ":"), allow_nan=False)
        dcol = list(map(DTYPE, items))  # every column by C-level maps
        dtypes = {d: str(i) for i, d in enumerate(dict.fromkeys(dcol))}
        return "".join((
            '{"dtypes":', dumps(list(dtypes)), ',"key":', dumps(list(map(KEY, items))),
            ',"dtype":[', ",".join(map(dtypes.__getitem__, dcol)), '],"shape":',
            dumps(list(map(SHAPE, items))),
            ',"file":[', ",".join(["0"] * len(items)),
            '],"offset":[', ",".join(map(str, map(OFFSET, items))),
            '],"nbytes":[', ",".join(map(str, map(NBYTES, items))), '],"crc32c":'))


# -- parsing (untrusted input) ---------------------------------------------------------------
Bad = Callable[..., Exception]


def parse_columns(raw: Any, slots: list[FileSlot], where: str, bad: Bad) -> tuple[list[TensorEntry], "EntrySpans"]:
    """Format version 3: the column table (``slots``: :func:`file_slots`)."""
    if not isinstance(raw, dict):
        raise bad("'tensors' must be an object of columns (format_version 3)")
    cols = [raw.get(c) for c in COLUMNS]
    names = raw.get("dtypes")
    if not all(type(c) is list for c in cols) or type(names) is not list:
        raise bad(f"'tensors' must hold the lists 'dtypes', {', '.join(map(repr, COLUMNS))}")
    n = len(cols[0])
    if any(len(c) != n for c in cols):
        raise bad(f"'tensors' columns differ in length ({', '.join(f'{k}: {len(c)}' for k, c in zip(COLUMNS, cols))})")
    for name in names:
        if type(name) is not str or name not in _ITEMSIZE_BY_NAME:
            raise unknown_dtype(name, f"{where}: 'tensors' dtypes")
    nd, ns = len(names), len(slots)
    keys, dts, _, fs, offs, nbs, crcs = cols
    if not (_all_ints(dts, 0, nd - 1) and _all_ints(fs, 0, ns - 1) and _all_ints(offs, 0, V.MAX_DIM)
            and _all_ints(nbs, 0, V.MAX_DIM) and _all_ints(crcs, 0, 0xFFFFFFFF)
            and set(map(type, keys)) <= {str} and max(map(len, keys), default=0) <= V.MAX_KEY_CHARS):
        for i, (key, d, f, off, nbytes, crc) in enumerate(zip(keys, dts, fs, offs, nbs, crcs)):  # finds what is wrong
            if not isinstance(key, str) or len(key) > V.MAX_KEY_CHARS:
                raise bad(f"tensor entry {i} has no valid key")
            if type(d) is not int or not 0 <= d < nd:
                raise bad(f"tensor {key!r:.80}: dtype index {d!r:.40} is not in [0, {nd})", key)
            if type(f) is not int or not 0 <= f < ns:
                raise bad(f"tensor {key!r:.80}: file {f!r:.40} is not listed in 'files' or 'ref_files'", key)
            for name, v, hi in (("nbytes", nbytes, V.MAX_DIM), ("offset", off, V.MAX_DIM), ("crc32c", crc, 0xFFFFFFFF)):
                V.integer({name: v}, name, where, 0, hi, f"tensor {key!r}: ")
    sizes = [_ITEMSIZE_BY_NAME[n] for n in names]  # the columns' types and ranges hold: only shapes are left
    check = V.check_shape
    out: list[TensorEntry] = []
    for key, d, shape, f, off, nbytes, crc in zip(*cols):
        fname, _, ref_step = slots[f]
        out.append(new_entry(key=key, dtype=names[d], shape=check(shape, sizes[d], nbytes, where, key),
                             file=fname, offset=off, nbytes=nbytes, crc32c=crc, step=ref_step))
    return out, EntrySpans(out, [slots[f][1] for f in fs])


def _all_ints(col: list[Any], lo: int, hi: int) -> bool:
    """Every value an int (not bool) in [lo, hi]: C-level passes over the column."""
    return not col or (set(map(type, col)) == {int} and lo <= min(col) and max(col) <= hi)


class EntrySpans:
    """The spans of parsed entries for :func:`~.validate.check_spans`: as columns (bulk check),
    or :class:`~.validate.Span` objects built only when iterated (its per-span loop)."""

    def __init__(self, entries: list[TensorEntry], files: list[str]):
        self.entries, self.files = entries, files

    def __len__(self) -> int:
        return len(self.entries)

    def columns(self) -> tuple[list[str], Iterator[int], Iterator[int], Iterator[int]]:
        """(span files, offsets, sizes, indices)."""
        es = self.entries
        return self.files, map(OFFSET, es), map(NBYTES, es), iter(range(len(es)))

    def __iter__(self) -> Iterator[V.Span]:
        for i, (e, f) in enumerate(zip(self.entries, self.files)):
            yield V.Span(i, f, e.offset, e.nbytes, (e.dtype, e.shape, e.crc32c), e.key)
