#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest.
# The tests start their own servers, so only the programs are needed, not services.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages of the servers the tests start: redis-server (also its Sentinel and
# Cluster modes; redis-cli creates the cluster), PostgreSQL (initdb and postgres, run on
# a temp dir), PgBouncer, etcd (server and etcdctl). openssl makes the private CA of the
# TLS tests; faketime gives a worker a clock of its own; chromium is the browser the web
# view's tests drive (through Playwright, which downloads nothing). MongoDB has no Debian package:
# its tests use tests/support/mongo_standin.py unless MONGODB_URL is set.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
[ -x /usr/bin/chromium ] || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The docs extra too: tests/docs builds the site and checks every example in it.
python3 -m pip install -q -e ".[test,docs]"
# One file per process (--dist loadfile): a module's servers and workers stay in one.
python3 -m pytest -n "${TEST_PROCESSES:-4}" --dist loadfile "$@"
