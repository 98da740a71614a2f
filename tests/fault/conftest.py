import os
import shutil
import subprocess

import pytest


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB ext4 filesystem on a loop device (skips where mounting is not permitted)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to loop-mount a small filesystem")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    res = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"loop mount not permitted here: {res.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
