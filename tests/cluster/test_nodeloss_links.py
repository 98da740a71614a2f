"""The node-loss-on-links benchmark's arithmetic (no cluster): what each tier's limit is and what
its fraction divides, so the README's figures mean what docs/cluster.md says."""

from .nodeloss_links import limits, report, summarize

DISK = {"read_Bps": 1.2e9, "write_Bps": 1.6e9, "tool": "probe"}


def _run(fetch_s, files_s, nbytes=250e6, **kw):
    return {"files_s": files_s, "load_s": files_s + 0.5, "fetch_s": fetch_s, "bytes": nbytes, "source": "peers",
            "bit_exact": True, "timeline": None, **kw}


def test_limit_is_the_slowest_of_link_and_disk_and_two_holders_share_the_receivers_link():
    lim = limits(200e6, 125e6, DISK)
    assert lim["peers"] == lim["peers N=3"] == 200e6  # n1 takes both ranges over its one link
    assert lim["S3"] == 125e6 and lim["shared fs"] == 1.2e9
    assert limits(2e9, 3e9, DISK)["peers"] == 1.2e9  # a link faster than the disk: the disk's read


def test_fraction_divides_the_fetch_not_the_agreement_and_the_median_of_rounds():
    rows = [{"peers": _run(1.0, 1.2), "shared fs": _run(0.5, 0.5)},
            {"peers": _run(2.0, 2.2), "shared fs": _run(0.5, 0.5)},
            {"peers": _run(1.25, 1.45), "shared fs": _run(0.5, 0.5)}]
    got = summarize(rows, limits(500e6, 125e6, DISK), bare_Bps=400e6)
    p = got["peers"]
    assert p["fetch_s"] == 1.25 and p["files_s"] == 1.45
    assert abs(p["fraction_of_limit"] - 250e6 / 1.25 / 500e6) < 1e-9
    assert abs(p["fraction_of_bare_stream"] - 250e6 / 1.25 / 400e6) < 1e-9  # the VM's own ceiling: 400 < 500
    assert abs(p["files_in_fraction"] - 250e6 / 1.45 / 500e6) < 1e-9
    assert p["fraction_each_round"] == [0.5, 0.25, 0.4]
    assert got["shared fs"]["fraction_of_bare_stream"] is None  # not behind a link
    res = {"disk": DISK, "mib_per_node": 256, "s3_mbit": 1000, "load_avg": (1.0, 1.0, 1.0), "protected": True,
           "protected_s": 1.0, "elapsed_s": 60, "s3_error": "", "phases": {"saves_s": 9},
           "rates": [{"link_mbit": 4000, "link_Bps": 500e6, "bare_stream_Bps": 400e6, "rounds": rows,
                      "tiers": got, "load_avg": (1.0, 1.0, 1.0), "elapsed_s": 40}]}
    tl = {"n1": {"restart_s": 2.5, "offer_s": 0.05, "fetch": [0.06, 0.7], "reads_from_s": 0.7, "loaded_s": 1.2},
          "n0": {"offer_s": 0.05, "fetch": [0.06, 0.06], "reads_from_s": 0.71, "loaded_s": 1.3}}
    got["peers"]["timeline"] = tl
    text = report(res)
    assert "repair copies to n1: 2.50): agreed 0.05; n1 fetch 0.06-0.70, loaded 1.20; the others read from 0.71, loaded 1.30-1.30" in text
    assert "| peers | 1.45 | 1.95 | 1.25 | 200 | 500 | 0.40 (0.5, 0.25, 0.4) | 0.50 |" in text
    assert "bare TCP stream n0 -> n1 over them: 400 MB/s (0.80 of the link)" in text
