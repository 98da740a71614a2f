#!/usr/bin/env bash
# Two revisions of the library, alternated in one run: the save scenario (stall, durable), the
# restore scenario (GB/s, fraction of the read line rate) and 100k tensors (first and steady
# save), each run by `zerostall bench` of its own revision, rounds in alternating order.
#
#   bash bench/scripts/revision_ab.sh OLD_REV [ROUNDS] [OUT_DIR]
#
# OLD_REV is checked out into a temporary git worktree (removed after); "new" is this tree.
# SIZE (GiB, default 1) and TENSORS (default 100000) scale it down for a quick check.
# Results: OUT_DIR/<scenario>-<old|new>-<round>.json and a summary table on stdout
# (bench/scripts/revision_ab_summary.py). Needs the dev venv (.venv) and ~3 GiB free under /tmp.
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:?usage: revision_ab.sh OLD_REV [ROUNDS] [OUT_DIR]}
ROUNDS=${2:-2}
OUT=${3:-$(mktemp -d /tmp/zerostall-ab-XXXXXX)}
PY=${PY:-$PWD/.venv/bin/python}
mkdir -p "$OUT"
OLD_TREE=$(mktemp -d /tmp/zerostall-old-XXXXXX)
cleanup() { git worktree remove --force "$OLD_TREE" >/dev/null 2>&1 || rm -rf "$OLD_TREE"; }
trap cleanup EXIT
git worktree add -q --detach "$OLD_TREE" "$OLD"

bench() {  # revision-tree json-path args...
  local tree=$1 json=$2; shift 2
  local path="$tree/src"
  [ -d "$tree/bench/zerostall_bench" ] && path="$path:$tree/bench"
  (cd /tmp && PYTHONPATH="$path" "$PY" -c 'import sys; from zerostall.cli import main; sys.exit(main())' \
      bench "$@" --json "$json") >"${json%.json}.log" 2>&1 || { echo "failed: $json (see ${json%.json}.log)"; tail -5 "${json%.json}.log"; }
}

for r in $(seq 1 "$ROUNDS"); do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for v in $order; do
    tree=$PWD; [ "$v" = old ] && tree=$OLD_TREE
    echo "round $r: $v (load $(cut -d' ' -f1 /proc/loadavg))"
    bench "$tree" "$OUT/save-$v-$r.json" --size-gib "${SIZE:-1}" --repeat 2 --methods zerostall-uring,torch.save,dcp --no-cold
    bench "$tree" "$OUT/restore-$v-$r.json" --scenario restore --size-gib "${SIZE:-1}" --repeat 2
    bench "$tree" "$OUT/many-$v-$r.json" --scenario many-tensors --tensors "${TENSORS:-100000}" --repeat 2
  done
done
"$PY" bench/scripts/revision_ab_summary.py "$OUT"
