"""Manifest size and parse time: the version 3 column table vs the version 1 objects form
(one object per tensor, what 0.5 wrote), of the same checkpoint, parsed in one process.

    python bench/scripts/manifest_table.py N_TENSORS SIZE_GIB [REPEATS]

Saves a ``bench --scenario many-tensors`` state once, rewrites its manifest in the objects
form, and reports bytes per tensor (tree included), manifest and step-directory bytes as a
multiple of the data, and the best of REPEATS ``json.loads`` and ``Manifest.from_bytes``.
"""
import json, os, sys, shutil, tempfile, time, gc
import crc32c, torch
import zerostall
from zerostall.format.manifest import Manifest
from zerostall.format.table import columns_to_objects
from zerostall.format import validate as V
from zerostall_bench.many import many_state, _dir_bytes

n = int(sys.argv[1]); size = int(float(sys.argv[2]) * (1 << 30))
d = tempfile.mkdtemp(prefix="mf-bench-", dir="/tmp")
try:
    st = many_state(n, size)
    data = sum(t.numel() * 4 for t in st["optim"].values())
    zerostall.save(d, st, step=1)
    step = os.path.join(d, "step-1")
    man = os.path.join(step, "manifest.json")
    raw3 = open(man, "rb").read()
    env = json.loads(raw3)
    body = env["body"]
    columns_to_objects(body); body["format_version"] = 1
    text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    raw1 = b'{"zerostall_manifest":"crc32c","body_crc32c":"%08x","body":' % crc32c.crc32c(text) + text + b"}\n"
    shard = _dir_bytes(step) - len(raw3)
    out = {"tensors": n, "data_bytes": data}
    for name, raw in (("v1_objects", raw1), ("v3_columns", raw3)):
        ts, tl = [], []
        for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
            gc.collect()
            t0 = time.perf_counter(); V.loads(raw, "m"); tl.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); m = Manifest.from_bytes(raw); ts.append(time.perf_counter() - t0)
            del m
        out[name] = {"manifest_bytes": len(raw), "bytes_per_tensor": round((len(raw) - len(raw3) * 0) / n, 1),
                     "manifest_bytes_ratio": round(len(raw) / data, 4), "disk_bytes_ratio": round((shard + len(raw)) / data, 4),
                     "json_loads_s": round(min(tl), 3), "from_bytes_s": round(min(ts), 3)}
    m1 = Manifest.from_bytes(raw1); m3 = Manifest.from_bytes(raw3)
    assert tuple(m1.tensors) == tuple(m3.tensors) and m1.tree == m3.tree
    out["from_bytes_ratio_v3_vs_v1"] = round(out["v3_columns"]["from_bytes_s"] / out["v1_objects"]["from_bytes_s"], 3)
    out["load_avg"] = os.getloadavg()
    print(json.dumps(out, indent=1))
finally:
    shutil.rmtree(d, ignore_errors=True)
