#!/bin/sh
# Entrypoint of infra/Dockerfile.
#
# `serve run` alone would start a private Ray instance whose dashboard binds
# 127.0.0.1, unreachable through `docker run -p`. So for a `serve ...`
# command with no cluster given (RAY_ADDRESS unset) start a head node bound
# to all interfaces, with metrics on a fixed port, and point `serve` at it.
# Any other command (a shell, `ray start` from KubeRay) runs unchanged.
set -eu

if [ "${1:-}" = "serve" ] && [ -z "${RAY_ADDRESS:-}" ]; then
    ray start --head \
        --dashboard-host=0.0.0.0 \
        --metrics-export-port=8080 \
        --disable-usage-stats
    export RAY_ADDRESS=auto
fi

exec "$@"
