#!/usr/bin/env bash
# Install what is missing, then run the linter and the type checker, build the docs site and
# run the whole test suite.
# Tests start their own etcd and agents on loopback and stop them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
# The docs site (mkdocs.yml): --strict turns a broken link or anchor into a failure.
site=$(mktemp -d)
if ! NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site" >"$site.log" 2>&1; then
  cat "$site.log" >&2
  rm -rf "$site" "$site.log"
  echo "test: the docs do not build (mkdocs build --strict, above)" >&2
  exit 1
fi
rm -rf "$site" "$site.log"
echo "test: docs built (mkdocs build --strict)" >&2
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
# tests/net (hosts in network namespaces of their own; mostly waiting on leases and
# timers) runs beside the rest, at a lower CPU priority, in a temporary folder of its own:
# about 4 minutes less in all on 2 cores.
net_tmp=$(mktemp -d)
nice -n 10 .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp "$net_tmp/t" \
  tests/net >"$net_tmp/log" 2>&1 &
net_pid=$!
status=0
# The rest in two worker processes (pytest-xdist), a test file per worker at a time: the
# tests mostly wait on agents, etcd and timers, so two run in about 0.6 of the time of one
# after the other. Each worker starts its own etcd, S3 server and registry.
.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 --ignore=tests/net \
  || status=$?
net_status=0
wait "$net_pid" || net_status=$?
echo "--- tests/net (run beside the rest) ---"
cat "$net_tmp/log"
rm -rf "$net_tmp"
if [ "$status" -ne 0 ] || [ "$net_status" -ne 0 ]; then exit 1; fi
