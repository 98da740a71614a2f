"""Edit a manifest body's tensor entries as one dict per tensor, whatever form it is written in.

Hostile-input tests mutate entries (``b["tensors"][0].update(offset=...)``); the writer stores
them as the version 3 column table (:mod:`zerostall.format.table`). :func:`edit` applies such a
mutation and writes the body back in ``form``: ``"columns"`` (version 3, what saves write) or
``"objects"`` (versions 1/2, what earlier releases wrote and readers keep reading).
"""

from zerostall.format.table import FORMAT_VERSION_TABLE, columns_to_objects, objects_to_columns

FORMS = ("columns", "objects")


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
