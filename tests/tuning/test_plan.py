import pytest

from zerostall.errors import ConfigError
from zerostall.tuning.plan import PlanInput, parse_count, plan


def test_seed_70b_example():
    r = plan(PlanInput(params=70e9, fs_gbps=5, interval_min=30))
    assert r.checkpoint_bytes == pytest.approx(980e9)
    assert r.sync_stall_s == pytest.approx(196)
    assert r.lost_fraction == pytest.approx(0.109, abs=5e-4)
    assert r.bottleneck.startswith("storage")


def test_seed_nfs_example():
    r = plan(PlanInput(checkpoint_bytes=parse_count("2.4T"), budget_s=300, nic_gbit=parse_count("2x100")))
    assert r.required_gbps == pytest.approx(8.0)
    assert r.nic_gbytes_per_s == pytest.approx(25.0)
    r2 = plan(PlanInput(checkpoint_bytes=2.4e12, budget_s=300, nic_gbit=200, fs_gbps=1.1, nodes=1))
    assert "storage" in r2.bottleneck and "misses" in r2.bottleneck


def test_per_rank_node_and_ram():
    r = plan(PlanInput(params=175e9, ranks=512, nodes=64, node_ram_gib=2048))
    assert r.bytes_per_rank == pytest.approx(175e9 * 14 / 512)
    assert r.bytes_per_node == pytest.approx(175e9 * 14 / 64)
    assert r.staging_fits_ram is True
    assert plan(PlanInput(params=175e9, nodes=1, node_ram_gib=512)).staging_fits_ram is False


@pytest.mark.parametrize("text,val", [("70e9", 70e9), ("175B", 175e9), ("7.5M", 7.5e6), ("2x100", 200), (3, 3)])
def test_parse_count(text, val):
    assert parse_count(text) == pytest.approx(val)


def test_errors():
    with pytest.raises(ConfigError, match="params"):
        plan(PlanInput())
    with pytest.raises(ConfigError, match="not a number"):
        parse_count("seventy")


def test_manifest_entry_bound_holds_for_every_kind_of_key():
    """The save-side estimate of a manifest (``entry_bound`` per tensor) is an upper bound of
    the real entry's JSON in the version 3 column table (what it adds: its values and a comma
    per column): ASCII, escaped and non-ASCII keys, scalars to 8-D, a reference (a file index
    past 2**25 files), every index at its widest."""
    import json

    from zerostall.format.manifest import TensorEntry
    from zerostall.format.table import encode_columns
    from zerostall.saving.plan import entry_bound

    def size(cols):
        return len(json.dumps(cols, separators=(",", ":")))

    first = TensorEntry("a", "float8_e4m3fnuz", (), "f", 0, 0, 0)
    base = size(encode_columns([first], ["f"]))
    keys = ["w", "model.layers.0.attention.wq.weight", 'q"uote\\back', "tab\there", "émbed.ü", "层.权重" * 5]
    for key in keys:
        for shape in [(), (7,), (2 ** 40, 3), tuple([99999] * 8)]:
            e = TensorEntry(key, "float8_e4m3fnuz", shape, "f", 10 ** 19, 10 ** 19, 2 ** 32 - 1)
            cols = encode_columns([first, e], ["f"])
            cols["dtype"][1], cols["file"][1] = 99, (1 << 25) + 10 ** 6  # < 100 dtypes; 2**25 files + refs
            real = size(cols) - base
            assert real <= entry_bound(key, len(shape)), (key, shape)
