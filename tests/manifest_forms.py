"""Edit a manifest body's tensor entries as one dict per tensor, whatever form it is written in.

Hostile-input tests mutate entries (``b["tensors"][0].update(offset=...)``); the writer stores
them as the version 3 column table (:mod:`zerostall.format.table`). :func:`edit` applies such a
mutation and writes the body back in ``form``: ``"columns"`` (version 3, the one format) or
``"objects"`` (versions 1/2, what earlier releases wrote: readers refuse it, naming the version).
"""

from typing import Any

from zerostall.format.table import COLUMNS, FORMAT_VERSION_TABLE

FORMS = ("columns",)
"""The forms a reader parses (hostile tests run over each)."""


def as_objects(body):
    """``body`` with one dict per tensor (in place); remembers the form it was in."""
    if isinstance(body.get("tensors"), dict):
        columns_to_objects(body)
        return "columns"
    return "objects"


def as_form(body, form):
    """Back to ``form`` (in place): columns keep the version; objects get version 1 or 2 if
    the body says 3 (the legacy writer's choice)."""
    if form == "columns":
        objects_to_columns(body)
    elif body.get("format_version") == FORMAT_VERSION_TABLE:
        body["format_version"] = 2 if body.get("ref_files") else 1


def edit(body, mutate, form="columns"):
    """Apply ``mutate`` to ``body`` with dict entries, then store it as ``form``. An objects
    body gets its legacy version before ``mutate`` (which may set its own)."""
    as_objects(body)
    if form == "objects":
        as_form(body, form)
    mutate(body)
    if form == "columns":
        as_form(body, form)
    return body


def _slots(body: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(name, step) per ``file`` index; whatever a hostile body holds passes through."""
    def rows(v: Any) -> list[Any]:
        return [r if isinstance(r, dict) else {} for r in v] if isinstance(v, list) else []
    return ([(f.get("name"), None) for f in rows(body.get("files"))]
            + [(r.get("name"), r.get("step")) for r in rows(body.get("ref_files"))])


def columns_to_objects(body: dict[str, Any]) -> None:
    """Rewrite ``body["tensors"]`` (version 3 columns) as one object per tensor, in place;
    ``format_version`` is left alone. Values pass through unchecked (hostile tests edit them)."""
    t = body["tensors"]
    slots = _slots(body)
    out = []
    for key, d, shape, f, off, nbytes, crc in zip(*(t[c] for c in COLUMNS)):
        name, step = slots[f]
        e = {"key": key, "dtype": t["dtypes"][d], "shape": shape, "file": name, "offset": off, "nbytes": nbytes,
             "crc32c": crc}
        if step is not None:
            e["step"] = step
        out.append(e)
    body["tensors"] = out


def objects_to_columns(body: dict[str, Any]) -> None:
    """The inverse of :func:`columns_to_objects`. An entry that is not an object lands in every
    column; a file the body does not list keeps its name in ``file`` (a reader refuses both)."""
    index = {s: i for i, s in enumerate(_slots(body))}
    dtypes: dict[Any, int] = {}
    cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for e in body["tensors"]:
        if not isinstance(e, dict):
            for c in COLUMNS:
                cols[c].append(e)
            continue
        dt = e.get("dtype")
        dt_i = dtypes.setdefault(dt, len(dtypes)) if isinstance(dt, str) else -1
        f = e.get("file")
        try:
            f_i = index.get((f, e.get("step")), f if e.get("step") is None else f"step-{e.get('step')}/{f}")
        except TypeError:  # unhashable
            f_i = f
        for c, v in zip(COLUMNS, (e.get("key"), dt_i, e.get("shape"), f_i, e.get("offset"), e.get("nbytes"),
                                  e.get("crc32c"))):
            cols[c].append(v)
    body["tensors"] = {"dtypes": list(dtypes), **cols}
