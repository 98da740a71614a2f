#!/usr/bin/env bash
# The device check for a session that is lent a GPU: the GPU tests, the CUDA restore bench and
# the GPU save bench, once.
# Writes logs and the bench JSON/plot under ${OUT:-gpu-out}. Not run in CI (no GPU there).
# The device machine has no package registry: wheels for what its image lacks (crc32c,
# liburing, the bench peers) travel in .whl/ (see the README's "GPU check"); without .whl/
# the packages are installed from the index. The root pyproject's PEP 639 license needs
# setuptools >= 77 for the --no-build-isolation install below: where the image's is older, put a
# setuptools wheel (e.g. setuptools-84.2.1-py3-none-any.whl) in .whl/ too.
set -uo pipefail
OUT=${OUT:-gpu-out}
BENCH_S=${BENCH_S:-300}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e ./bench 2>&1 | tail -2
else
  python3 -m pip install -q -e '.[all,test]' -e ./bench 2>&1 | tail -2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uname -r; nproc; free -g;
  python3 -c 'import torch, zerostall; print("torch", torch.__version__, "cuda devices:", torch.cuda.device_count())';
  df -hT . /tmp; } 2>&1 | tee "$OUT/machine.txt"
# facts about the CUDA staging path (registration, D2H GB/s, fork after pinning): ~10 s, never fails
timeout 90 python3 bench/scripts/gpu_diag.py 2>&1 | tee "$OUT/diag.txt"
# every GPU test; the two-device cases (test_gpu.py::test_two_devices_*) are skipped, and
# say so (-rs), on a machine with one device
timeout 240 python3 -m pytest -q -m gpu -rs -p no:cacheprovider --continue-on-collection-errors tests tests/saving/test_device_streams.py 2>&1 \
  | tee "$OUT/pytest-gpu.log"
# restore into CUDA tensors (issue 25): GB/s and fraction of the read line rate, in place and new
# dict (map_location="cuda"), vs dcp.load and torch.load; ~1-2 min at 2 GiB
timeout "${RESTORE_S:-240}" zerostall bench --scenario restore --device cuda --size-gib "${BENCH_GIB:-2}" \
  --repeat "${BENCH_REPEAT:-2}" --dir /tmp/zs-bench-restore --json "$OUT/bench-restore-cuda.json" 2>&1 \
  | tee "$OUT/bench-restore-cuda.log"
rm -rf /tmp/zs-bench-restore
timeout "$BENCH_S" zerostall bench --device cuda --size-gib "${BENCH_GIB:-2}" --repeat "${BENCH_REPEAT:-2}" \
  --methods "${BENCH_METHODS:-torch.save,dcp,dcp-async,zerostall-uring,zerostall.save,nvrx-async,torchsnapshot-async,lightning-async}" \
  --dir /tmp/zs-bench --json "$OUT/bench-cuda.json" --plot "$OUT/bench-cuda.png" 2>&1 | tee "$OUT/bench-cuda.log"
