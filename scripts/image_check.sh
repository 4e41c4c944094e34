#!/usr/bin/env bash
# Build the sidecar image and check it: numeric non-root user, healthcheck, py-spy with and
# without SYS_PTRACE, /healthz and /metrics from `run`, and the demo inside the container.
# Needs a container engine (ENGINE=docker by default, or podman); exit 0 only if all pass.
#   ENGINE=podman BUILD_FLAGS="--format docker" scripts/image_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
engine="${ENGINE:-docker}"
image="${IMAGE:-omni-watchdog:check}"
name="omni-watchdog-check-$$"
port="${PORT:-19464}"
# shellcheck disable=SC2086 # BUILD_FLAGS is a list of flags
"$engine" build ${BUILD_FLAGS:-} -t "$image" .

fail() { echo "FAIL: $*" >&2; exit 1; }
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT

user=$("$engine" image inspect --format '{{.Config.User}}' "$image")
[[ "$user" =~ ^[1-9][0-9]*$ ]] || fail "image user is '$user', not a numeric non-root uid"
healthcheck=$("$engine" image inspect --format '{{json .Config.Healthcheck}}' "$image")
[[ "$healthcheck" == *"/healthz"* ]] || fail "no HEALTHCHECK on /healthz: $healthcheck"
echo "user $user; healthcheck $healthcheck"

for caps in "" "--cap-add SYS_PTRACE"; do
    # shellcheck disable=SC2086 # caps is a flag or nothing
    chosen=$("$engine" run --rm $caps --entrypoint python "$image" \
        -c 'from omni_watchdog.policy.capture import find_py_spy; print(find_py_spy())')
    # shellcheck disable=SC2086
    "$engine" run --rm $caps --entrypoint "$chosen" "$image" --version \
        || fail "${caps:-default capabilities}: $chosen does not start"
    echo "${caps:-default capabilities}: $chosen starts"
done

"$engine" run -d --name "$name" --network host \
    -e OMNI_WATCHDOG_LISTEN="127.0.0.1:$port" \
    -e OMNI_WATCHDOG_SPANS_OTLP_LISTEN="127.0.0.1:$((port + 1))" \
    -e OMNI_WATCHDOG_TARGET=http://127.0.0.1:9 "$image" run >/dev/null
answered=""
for _ in $(seq 50); do
    if "$engine" exec "$name" python -c \
        "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/healthz', timeout=1)" \
        2>/dev/null; then
        answered=yes
        break
    fi
    sleep 0.2
done
if [[ -z "$answered" ]]; then
    "$engine" logs "$name" >&2 || true
    fail "/healthz of 'run' did not answer within 10s (the container's log is above)"
fi
"$engine" exec "$name" python -c "
import urllib.request
body = urllib.request.urlopen('http://127.0.0.1:$port/metrics', timeout=2).read().decode()
assert 'omni_watchdog_build_info' in body, body[:500]
" || fail "/metrics of 'run' inside the container"
echo "run: /healthz and /metrics answer"
cleanup

# The demo's last line is its JSON summary.
summary=$("$engine" run --rm "$image" demo --json | tail -n 1)
[[ "$summary" == *'"outcome": "recovered_by_kill"'* ]] || fail "the demo inside the image: $summary"
echo "demo inside the image: recovered_by_kill"
echo "image check passed: $image ($("$engine" image inspect --format '{{.Size}}' "$image") bytes)"
