"""Is an incremental save's base file still the file that was written? (:mod:`.incremental`)

Called from the snapshot thread by :meth:`.incremental.RefTracker.decide`, once per file a
save would borrow from: an ``lstat`` of the step's manifest and of the file, and a read of the
file's 4 KiB header. Payload bytes are not read; a write into the file since it was committed
(a flipped bit by hand or by a tool) is caught by its stamp (inode, size, mtime, ctime), recorded
when the tracker made the file a base (:func:`file_stamp`). The ctime is what catches a rewrite
whose tool put the mtime back (``rsync --inplace -t``): user space cannot set it. Bit rot below the filesystem is found
by restore and ``verify`` (crc32c of every byte).
"""

from __future__ import annotations

import os
import stat

from ..format.layout import HEADER_BYTES, ShardHeader
from ..format.manifest import MANIFEST_NAME
from ..format.refs import RefFile


Stamp = tuple[int, int, int, int]


def file_stamp(root: str, step: int, name: str) -> Stamp | None:
    """(inode, size, mtime, ctime in ns) of ``root/step-<step>/<name>``; None if it cannot be read."""
    try:
        st = os.lstat(os.path.join(root, f"step-{step}", name))
    except OSError:
        return None
    return _stamp(st)


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def base_file_problem(root: str, ref: RefFile, stamp: Stamp | None = None) -> str | None:
    """Why ``ref`` can no longer be referenced (its step's manifest or the file itself is
    gone, the file is not a regular file of the recorded size, it was written to since
    ``stamp``, or its header is another's), or None if it is still the file that was written."""
    step_dir = os.path.join(root, f"step-{ref.step}")
    try:
        if not stat.S_ISREG(os.lstat(os.path.join(step_dir, MANIFEST_NAME)).st_mode):
            return "its manifest is not a regular file"
        path = os.path.join(step_dir, ref.name)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != ref.file_bytes:
            return f"{st.st_size} bytes, {ref.file_bytes} recorded"
        if stamp is not None and _stamp(st) != stamp:
            return "written to, replaced or re-linked since it was committed (its inode, mtime or ctime changed)"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not ShardHeader(ref.file_id, ref.step, ref.rank, ref.file_bytes).matches(head):
        return "its header is not the one written (replaced or damaged)"
    return None
