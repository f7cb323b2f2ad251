#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest.
# The tests start their own redis-server, so only the binary is needed, not a service.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi
python3 -m pip install -q -e ".[test]"
python3 -m pytest "$@"
