#!/usr/bin/env bash
# The device check for a session that is lent a GPU: the GPU tests and the GPU bench, once.
# Writes logs and the bench JSON/plot under ${OUT:-gpu-out}. Not run in CI (no GPU there).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q -e '.[all,test]' 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
# every GPU test; the two-device cases (test_gpu.py::test_two_devices_*) are skipped, and
# say so (-rs), on a machine with one device
python3 -c 'import torch; print("cuda devices:", torch.cuda.device_count())' | tee "$OUT/devices.txt"
python3 -m pytest -q -m gpu -rs tests 2>&1 | tee "$OUT/pytest-gpu.log"
python3 -m pytest -q -rs tests/unit/test_device_streams.py 2>&1 | tee "$OUT/pytest-device-streams.log"
zerostall bench --device cuda --size-gib 2 --repeat 2 --json "$OUT/bench-cuda.json" --plot "$OUT/bench-cuda.png" \
  2>&1 | tee "$OUT/bench-cuda.log"
