#!/usr/bin/env bash
# Starts a local S3-protocol server (moto's standalone server) for the S3 storage tests,
# creates the test bucket, and prints the environment the tests read:
#
#   s3_env="$(bash scripts/s3-server.sh)" && eval "$s3_env"
#   bash scripts/s3-server.sh stop      # stops a server this script started
#
# Idempotent: installs moto only if missing and reuses a server already answering on the
# port. Progress goes to stderr; only `export` lines go to stdout.
set -euo pipefail

port="${FERRY_S3_PORT:-9877}"
bucket="${FERRY_S3_BUCKET:-ferry-test}"
state="${FERRY_S3_STATE:-/tmp/ferry-s3}"
endpoint="http://127.0.0.1:$port"
mkdir -p "$state"

if [ "${1:-}" = stop ]; then
  if [ -f "$state/pid" ] && kill "$(cat "$state/pid")" 2>/dev/null; then
    echo "s3-server: stopped" >&2
  fi
  rm -f "$state/pid"
  exit 0
fi

python=python3
command -v "$python" >/dev/null || { echo "s3-server: python3 is required" >&2; exit 1; }
if ! "$python" -c 'import moto.server, flask, flask_cors' 2>/dev/null; then
  echo "s3-server: installing moto[server]" >&2
  "$python" -m pip install --quiet --disable-pip-version-check 'moto[server]>=5,<6' >&2
fi

# HTTP through python, so the script needs nothing but python3.
http() { # METHOD URL -> exit 0 on a 2xx answer
  "$python" - "$1" "$2" <<'PY'
import sys, urllib.request
req = urllib.request.Request(sys.argv[2], method=sys.argv[1])
try:
    urllib.request.urlopen(req, timeout=2).read()
except Exception:
    sys.exit(1)
PY
}
answers() { http GET "$endpoint/"; }

if ! answers; then
  echo "s3-server: starting moto on $endpoint (log: $state/moto.log)" >&2
  # setsid: the server outlives this script and is not in the caller's process group.
  setsid "$python" -m moto.server -H 127.0.0.1 -p "$port" >"$state/moto.log" 2>&1 < /dev/null &
  echo $! >"$state/pid"
  for _ in $(seq 1 100); do
    answers && break
    sleep 0.2
  done
  answers || { echo "s3-server: moto did not start:" >&2; tail -20 "$state/moto.log" >&2; exit 1; }
fi

# Create the bucket (moto accepts unsigned requests; an existing bucket is fine).
http PUT "$endpoint/$bucket" || http HEAD "$endpoint/$bucket" \
  || { echo "s3-server: cannot create bucket $bucket" >&2; exit 1; }

cat <<ENV
export FERRY_TEST_S3_ENDPOINT=$endpoint
export FERRY_TEST_S3_BUCKET=$bucket
export FERRY_TEST_S3_REGION=us-east-1
export FERRY_TEST_S3_ACCESS_KEY_ID=ferrytest
export FERRY_TEST_S3_SECRET_ACCESS_KEY=ferrytestsecret
ENV
