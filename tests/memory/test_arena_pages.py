"""An arena advised huge pages probes both page sizes on its first fault call and keeps 4 KiB
pages for the rest when huge pages fault slower (a VM whose host took its free huge pages
back: 0.1-0.4 GB/s against 1-2 GB/s), huge pages otherwise. Checked on the real mapping's
flags in /proc/self/smaps (``nh``: MADV_NOHUGEPAGE, ``hg``: MADV_HUGEPAGE)."""

import pytest

from zerostall.memory import arena as arena_mod
from zerostall.memory.arena import PROBE_BYTES, Arena


def _flags(a: Arena) -> list[tuple[int, int, set[str]]]:
    """(start offset, end offset, VmFlags) of the mappings that cover the arena."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = (lo, hi) if lo < a.address + a.nbytes and hi > a.address else None
            elif cur is not None and line.startswith("VmFlags:"):
                out.append((max(cur[0], a.address) - a.address, min(cur[1], a.address + a.nbytes) - a.address,
                            set(line.split()[1:])))
    return sorted(out)


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _thp_available(), reason="transparent huge pages disabled on this host")


@pytest.mark.parametrize("slow_huge", [True, False])
def test_probe_keeps_the_faster_page_size(monkeypatch, slow_huge):
    # PROBE_RATIO 0: huge pages always count as slower; 1e9: never
    monkeypatch.setattr(arena_mod, "PROBE_RATIO", 0.0 if slow_huge else 1e9)
    n = 8 * PROBE_BYTES
    a = Arena(n, mlock=False, hugepages=True, prefault=False)
    try:
        assert a.pages == "probing"
        a.fault_to(n)
        a.wait_ready(n)
        assert a.pages == ("4k" if slow_huge else "huge")
        maps = _flags(a)
        assert maps[0][0] == 0 and maps[-1][1] == a.nbytes
        rest = [fl for lo, hi, fl in maps if hi > 2 * PROBE_BYTES]  # what covers the rest
        assert rest and all(("nh" in fl) == slow_huge and ("hg" in fl) != slow_huge for fl in rest)
        assert "nh" in next(fl for lo, hi, fl in maps if lo <= PROBE_BYTES < hi)  # the 4 KiB probe
        a.u8[::4096] = 7  # every page usable
        assert int(a.u8[::4096].sum()) == 7 * (n // 4096)
    finally:
        a.close()


def test_a_small_first_fault_leaves_the_probe_to_the_first_large_one(monkeypatch):
    # a first ask under two probes (a first save's small ring) used to settle on huge pages
    # unprobed, for good: huge pages that fault slower were then never given up
    monkeypatch.setattr(arena_mod, "PROBE_RATIO", 0.0)  # huge pages always count as slower
    n = 8 * PROBE_BYTES
    a = Arena(n, mlock=False, hugepages=True, prefault=False)
    try:
        a.fault_to(PROBE_BYTES // 2)
        a.wait_ready(PROBE_BYTES // 2)
        assert a.pages == "probing"
        a.fault_to(n)
        a.wait_ready(n)
        assert a.pages == "4k"
        assert any("nh" in fl for lo, hi, fl in _flags(a) if hi == a.nbytes)  # the rest on 4 KiB pages
    finally:
        a.close()


def test_no_probe_without_huge_pages_or_for_a_small_arena():
    a = Arena(4 << 20, mlock=False, hugepages=False)
    assert a.pages == "4k" and not any("hg" in fl or "nh" in fl for _, _, fl in _flags(a))
    a.close()
    b = Arena(PROBE_BYTES, mlock=False, hugepages=True)  # less than two probes: huge pages as advised
    assert b.pages == "huge" and all("hg" in fl for _, _, fl in _flags(b))
    b.close()
