#!/usr/bin/env bash
# Run one benchmark command on an earlier commit and on this working tree, alternating,
# so that both sides see the same machine noise:
#
#   scripts/bench_before_after.sh REV PAIRS -- scripts/bench_dispatch.py --agents 4 --json
#
# REV is checked out in a temporary git worktree with a virtualenv of its own that takes
# every dependency from .venv (a .pth line) and installs only REV's hypermesh, editable;
# the command then runs from each tree's root with that tree's Python, PAIRS times each,
# the earlier side first in odd pairs and second in even ones. Each run's stdout goes to
# OUT/<before|after>-<pair>.out (OUT: $BENCH_OUT, default a new temporary folder, printed
# at the end), its stderr to .err beside it. Both trees are left as they were.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] && [ "$3" = "--" ] || {
  echo "usage: $0 REV PAIRS -- SCRIPT [ARGS...]" >&2; exit 2; }
rev=$1 pairs=$2; shift 3
here=$PWD
out=${BENCH_OUT:-$(mktemp -d)}
mkdir -p "$out"
before=$(mktemp -d)
cleanup() { git -C "$here" worktree remove --force "$before/tree" >/dev/null 2>&1 || true
            rm -rf "$before"; }
trap cleanup EXIT
git worktree add --detach -q "$before/tree" "$rev"
python3 -m venv "$before/venv"
site() { "$1" -c 'import site; print(site.getsitepackages()[0])'; }
site "$here/.venv/bin/python" > "$(site "$before/venv/bin/python")/zz_deps.pth"
"$before/venv/bin/python" -m pip install -q --no-deps -e "$before/tree" >"$out/pip.log" 2>&1

run() { # SIDE TREE PYTHON PAIR COMMAND...
  local side=$1 tree=$2 python=$3 pair=$4; shift 4
  echo "bench: $side, pair $pair, $(date -u +%H:%M:%S) UTC" >&2
  (cd "$tree" && "$python" "$@") >"$out/$side-$pair.out" 2>"$out/$side-$pair.err" \
    || echo "bench: $side-$pair failed (see its .err)" >&2
}
for pair in $(seq 1 "$pairs"); do
  if [ $((pair % 2)) -eq 1 ]; then
    run before "$before/tree" "$before/venv/bin/python" "$pair" "$@"
    run after "$here" "$here/.venv/bin/python" "$pair" "$@"
  else
    run after "$here" "$here/.venv/bin/python" "$pair" "$@"
    run before "$before/tree" "$before/venv/bin/python" "$pair" "$@"
  fi
done
echo "bench: results in $out" >&2
