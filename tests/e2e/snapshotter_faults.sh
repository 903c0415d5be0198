#!/usr/bin/env bash
# tests/e2e/snapshotter_faults.sh — faults under containerd with LAZY layers (needs root
# and /dev/fuse): the registry going away while containers run, and the node daemon
# killed with SIGKILL while containers are starting.
#
#   bash tests/e2e/snapshotter_faults.sh
#
# Setup: a copy of the small image (bench/make-image.sh --small) indexed by `ferry index`
# (64 KiB spans, every layer) and pushed with its index to ferry's registry; `ferry
# daemon` with the snapshotter, prefetch and background fill OFF and `[fetch] timeout` of
# FETCH_TIMEOUT seconds (default 3); a private containerd with [proxy_plugins.ferry];
# `ferry pull` mounts every layer lazily (FUSE). Every ctr call runs under `timeout`.
#
# 1. Registry stopped during a run. A container reads the head of a 1 MiB file (now in
#    the chunk store) and one start warms what a start reads; the registry is stopped;
#    the page cache is dropped, so reads go back to the daemon. Then: the cached range
#    reads correctly; a range never read fails with an I/O error within 3 x the fetch
#    timeout (measured beyond a cached exec's own time); `ctr task ls`, `ctr snapshots
#    ls` and a new container started from cached data do not hang; a new container
#    that needs uncached data fails with EIO, without hanging; the registry restarted on
#    the same port and storage serves the range that failed, byte-identical to the
#    image; `ferry status` counted the fetch errors.
# 2. kill -9 while containers start. Two containers run; three `ctr run` and a `ferry
#    pull` of a second indexed image start in the background; the daemon is killed with
#    SIGKILL at the first start's Prepare and restarted with the same config. Then:
#    containerd reconnects; each interrupted start either finished or failed without
#    hanging, and runs again after cleanup; the second image pulls (again if needed) and
#    runs from its lazy layer; every FUSE mount under the snapshotter's root is one the
#    new daemon reports, each mount point once (nothing stale or stacked), one per
#    committed lazy snapshot (label ferry.dev/remote); every committed snapshot survived,
#    each snapshot answers info and usage, and every parent exists; new containers start
#    and read whole files (sha256 equal to the image's); the containers that ran across
#    the crash are listed, killed and removed through the restarted daemon; `ctr image rm
#    --sync` removes every snapshot and the daemon releases every lazy layer; after
#    SIGTERM no mount refers to the snapshotter's root.
#
# Containers running across the crash keep their FUSE connections (the daemon's fd
# holder keeps them and the restarted daemon resumes them); reading uncached data in a
# container that ran across a crash is tested in daemon_restart_live.sh, not here.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), FETCH_TIMEOUT,
#      E2E_KEEP=1, E2E_VERBOSE=1 (print service logs on failure).
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd, FUSE"
need_cmd containerd ctr runc jq curl timeout cmp dd
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
small_image
if [[ ! -x $FERRY ]] || ! "$FERRY" daemon --help 2>/dev/null | grep -- '--config' >/dev/null ||
    ! "$FERRY" pull --help >/dev/null 2>&1; then
    fail "no ferry binary with \`daemon --config\` and \`pull\`: $FERRY (cargo build --release -p ferry)"
    e2e_summary || exit 1
fi
e2e_log "ferry: $FERRY"
FETCH_TIMEOUT=${FETCH_TIMEOUT:-3}

# ---------------------------------------------------------------- helpers
# cx ARGS...: ctr with a timeout (CT seconds, default 60); output in OUT, exit in RC
cx() {
    set +e
    OUT=$(timeout "${CT:-60}" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@" 2>&1)
    RC=$?
    set -e
}
# say TEXT [N] / indent [N] (stdin): the last N lines, indented, for failure reports
say() { sed 's/^/    | /' <<<"$1" | tail -"${2:-8}"; }
indent() { sed 's/^/    | /' | tail -"${1:-8}"; }
now_ms() { date +%s%3N; }
# why RC: a note for exit codes that are signals (SIGBUS: a page of an executable or
# mapped file could not be read back through FUSE)
why() {
    case $1 in
    135) echo " (SIGBUS: a mapped page, e.g. of busybox itself, could not be read)" ;;
    124) echo " (killed by timeout)" ;;
    esac
}
# fuse_mounts: mount points of FUSE mounts under the snapshotter's root, one a line
fuse_mounts() {
    awk -v r="$SNAP_ROOT/" 'index($5, r) == 1 {
        for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/) print $5; break }
    }' /proc/self/mountinfo | LC_ALL=C sort
}
# daemon_mounts: mount points the daemon reports serving, one a line
daemon_mounts() {
    timeout 20 "$FERRY" status --json --socket "$CTL_SOCK" | jq -r '.mounts[].mountpoint' | LC_ALL=C sort
}
status_sum() { timeout 20 "$FERRY" status --json --socket "$CTL_SOCK" | jq "[.mounts[].stats.$1] | add // 0"; }
# snap_table: "KEY PARENT KIND" of every snapshot ferry holds
snap_table() { timeout 30 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" snapshots --snapshotter ferry ls | tail -n +2 | awk '{print $1, ($3 == "" ? "-" : $2), $NF}' | LC_ALL=C sort; }
committed() { awk '$3 == "Committed" {print $1}' <<<"$1"; }
task_running() { timeout 20 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" task ls | grep "^$1 .*RUNNING" >/dev/null; }
remove_container() {
    CT=30 cx task kill -s SIGKILL "$1"
    CT=30 cx task rm -f "$1"
    CT=30 cx container rm "$1"
}

# ---------------------------------------------------------------- setup
IMG=$E2E_TMP/img
indexed_small "$IMG"
TREE=$E2E_TMP/tree
oci_extract "$SMALL" small "$TREE"
NUMBERS=/data/sub/dir/numbers.txt
# ranges of the 1 MiB file: the head (read, so cached) and 4 KiB blocks at 512 KiB and
# 800 KiB, several 64 KiB spans away from anything a start or the head read touches
# (read only while the registry is gone)
CACHED_RANGE=(bs=4096 skip=0 count=4)
COLD_RANGE=(bs=4096 skip=128 count=1)
COLD_RANGE2=(bs=4096 skip=200 count=1)
dd if="$TREE$NUMBERS" "${CACHED_RANGE[@]}" status=none >"$E2E_TMP/want-cached"
dd if="$TREE$NUMBERS" "${COLD_RANGE[@]}" status=none >"$E2E_TMP/want-cold"
LAYERS=$(oci_manifest "$SMALL" small | jq '.layers | length')
# a second image with a layer of its own (busybox + one file), pulled while the daemon
# is killed: its lazy layer's Prepare may be in flight
OTHER_ROOT=$E2E_TMP/other-root
mkdir -p "$OTHER_ROOT/bin" "$OTHER_ROOT/other"
cp -a "$TREE/bin/busybox" "$OTHER_ROOT/bin/busybox"
ln -s busybox "$OTHER_ROOT/bin/sh"
echo "other image $$" >"$OTHER_ROOT/other/id.txt"
python3 "$FERRY_ROOT/bench/oci-layout.py" write --out "$E2E_TMP/other" --tag other \
    --cmd '["/bin/busybox","cat","/other/id.txt"]' --env PATH=/bin "$OTHER_ROOT" >"$E2E_TMP/other.log" 2>&1 ||
    { cat "$E2E_TMP/other.log"; e2e_die "writing the second image failed"; }
"$FERRY" index --min-layer-size 0 --span 65536 "oci:$E2E_TMP/other:other" >>"$E2E_TMP/index.log" 2>&1 ||
    { cat "$E2E_TMP/index.log"; e2e_die "ferry index (second image) failed"; }

: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
REG=$REG_ADDR
REG_STORE_NAME=reg
REF=$REG/faults/small:v1
OTHER_REF=$REG/faults/other:v1
{ "$FERRY" copy "oci:$IMG:small" "$REF" && "$FERRY" copy "oci:$E2E_TMP/other:other" "$OTHER_REF"; } >"$E2E_TMP/copy.log" 2>&1 ||
    { cat "$E2E_TMP/copy.log"; e2e_die "ferry copy to the registry failed"; }

# CTL_SOCK, DAEMON_CONFIG, SNAP_SOCK (lib.sh); uncached reads fail after FETCH_TIMEOUT
lazy_snapshotter_daemon "$(printf '[fetch]\ntimeout = "%ss"\n' "$FETCH_TIMEOUT")"
start_containerd_with_snapshotter ferry "$SNAP_SOCK"

# fpull REF: ferry pull into our containerd; output in PULL_OUT, exit in PULL_RC
fpull() {
    set +e
    PULL_OUT=$(timeout 120 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
        --snapshotter ferry --snapshotter-root "$SNAP_ROOT" "$1" 2>&1)
    PULL_RC=$?
    set -e
}
fpull "$REF"
if [[ $PULL_RC == 0 && $PULL_OUT == *"$LAYERS layers ($LAYERS lazy"* ]]; then
    pass "ferry pull: every layer lazy ($(tail -1 <<<"$PULL_OUT"))"
else
    fail "ferry pull of the indexed image: exit $PULL_RC"; say "$PULL_OUT"
    e2e_summary || exit 1
fi

# ---------------------------------------------------------------- 1. registry stopped
echo "# 1. registry stopped while a lazily started container runs"
CT=120 cx run -d --snapshotter ferry "$REF" "reader-$$" busybox sleep 3600
wait_for 30 "reader running" task_running "reader-$$" ||
    { fail "detached container reader-$$ did not start (exit $RC)"; say "$OUT"; }
CT=60 cx task exec --exec-id warm "reader-$$" busybox dd if="$NUMBERS" "${CACHED_RANGE[@]}" status=none
if [[ $RC == 0 ]] && cmp -s <(printf '%s' "$OUT") <(head -c "${#OUT}" "$E2E_TMP/want-cached") &&
    [[ ${#OUT} -gt 1000 ]]; then
    pass "registry up: the head of $NUMBERS reads through the lazy layer"
else
    fail "first read of $NUMBERS: exit $RC"; say "$OUT" 3
fi
# what a container's start reads (runc: /etc/passwd, /etc/group; the default command
# /app/start.sh, busybox) is read once while the registry is up
CT=120 cx run --rm --snapshotter ferry "$REF" "warm-start-$$"
[[ $RC == 0 && $OUT == "ready small" ]] || { fail "a container start with the registry up: exit $RC"; say "$OUT"; }
FETCHED_BEFORE=$(status_sum bytes_fetched)

stop_reg() {
    kill "$REG_PID" 2>/dev/null || true
    wait "$REG_PID" 2>/dev/null || true
}
stop_reg
if curl -fsS --noproxy '*' --max-time 2 "http://$REG/v2/" >/dev/null 2>&1; then
    fail "the registry still answers after being stopped"
fi
# what the kernel cached would hide the daemon: make reads go back to it
sync
echo 1 >/proc/sys/vm/drop_caches || e2e_log "warning: could not drop the page cache"

t0=$(now_ms)
CT=60 cx task exec --exec-id cached "reader-$$" busybox dd if="$NUMBERS" "${CACHED_RANGE[@]}" status=none
cached_ms=$(($(now_ms) - t0))
printf '%s' "$OUT" >"$E2E_TMP/got-cached"
if [[ $RC == 0 ]] && cmp -s "$E2E_TMP/got-cached" <(head -c "$(stat -c %s "$E2E_TMP/got-cached")" "$E2E_TMP/want-cached") &&
    [[ $(stat -c %s "$E2E_TMP/got-cached") -gt 1000 ]]; then
    pass "registry gone: a cached range reads correctly (${cached_ms} ms for the exec)"
else
    fail "registry gone: cached read: exit $RC$(why "$RC") after ${cached_ms} ms"; say "$OUT" 3
fi

t0=$(now_ms)
CT=$((FETCH_TIMEOUT * 10 + 30)) cx task exec --exec-id cold "reader-$$" busybox dd if="$NUMBERS" "${COLD_RANGE[@]}" status=none
cold_ms=$(($(now_ms) - t0))
bound_ms=$((FETCH_TIMEOUT * 3000))
if [[ $RC == 0 ]]; then
    fail "registry gone: an uncached range read succeeded (it was cached: the test's premise broke)"
elif [[ $RC == 124 ]]; then
    fail "registry gone: the uncached read hung (killed by timeout after ${cold_ms} ms)"
elif [[ $OUT != *"I/O error"* && $OUT != *"Input/output error"* ]]; then
    fail "registry gone: uncached read failed, but not with EIO (exit $RC$(why "$RC"))"; say "$OUT" 3
elif ((cold_ms - cached_ms > bound_ms)); then
    fail "registry gone: EIO only after ${cold_ms} ms (bound: 3 x ${FETCH_TIMEOUT}s fetch timeout + the exec's own ${cached_ms} ms)"
else
    pass "registry gone: an uncached range fails with EIO after ${cold_ms} ms (fetch timeout ${FETCH_TIMEOUT}s, bound 3x + ${cached_ms} ms exec): '$(grep -m1 -i 'error' <<<"$OUT" | cut -c1-80)'"
fi

t0=$(now_ms)
CT=20 cx task ls
if [[ $RC == 0 && $OUT == *"reader-$$"*RUNNING* ]]; then
    pass "registry gone: ctr task ls answers ($(($(now_ms) - t0)) ms) and the container still runs"
else
    fail "registry gone: ctr task ls: exit $RC"; say "$OUT"
fi
CT=20 cx snapshots --snapshotter ferry ls
if [[ $RC == 0 ]]; then
    pass "registry gone: ctr snapshots ls answers"
else
    fail "registry gone: ctr snapshots ls: exit $RC"; say "$OUT"
fi
t0=$(now_ms)
CT=120 cx run --rm --snapshotter ferry "$REF" "cached-start-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "registry gone: a new container starts from cached data ($(($(now_ms) - t0)) ms): '$OUT'"
else
    fail "registry gone: new container from cached data: exit $RC$(why "$RC") after $(($(now_ms) - t0)) ms"; say "$OUT"
fi

t0=$(now_ms)
CT=$((FETCH_TIMEOUT * 10 + 60)) cx run --rm --snapshotter ferry "$REF" "cold-start-$$" busybox dd if="$NUMBERS" "${COLD_RANGE2[@]}" status=none
t_ms=$(($(now_ms) - t0))
if [[ $RC != 0 && $RC != 124 && $OUT == *"I/O error"* ]] || [[ $RC != 0 && $RC != 124 && $OUT == *"Input/output error"* ]]; then
    pass "registry gone: a new container that reads uncached data fails with EIO after ${t_ms} ms, without hanging"
elif [[ $RC == 0 ]]; then
    fail "registry gone: a container read an uncached range (it was cached: the test's premise broke)"
else
    fail "registry gone: new container reading uncached data: exit $RC$(why "$RC") after ${t_ms} ms"; say "$OUT"
fi
CT=30 cx container rm "cold-start-$$"

start_ferry_registry "$REG_STORE_NAME" "$E2E_TMP/reg.toml" "$REG" || e2e_die "the registry did not restart on $REG"
# a failed span is refused at once for a moment (so retries do not each wait out the
# timeout): retry for a while
got_cold=0
for _ in $(seq 20); do
    CT=60 cx task exec --exec-id "cold-again-$RANDOM" "reader-$$" busybox dd if="$NUMBERS" "${COLD_RANGE[@]}" status=none
    printf '%s' "$OUT" >"$E2E_TMP/got-cold"
    if [[ $RC == 0 ]] && cmp -s "$E2E_TMP/got-cold" <(head -c "$(stat -c %s "$E2E_TMP/got-cold")" "$E2E_TMP/want-cold") &&
        [[ $(stat -c %s "$E2E_TMP/got-cold") -gt 1000 ]]; then
        got_cold=1
        break
    fi
    sleep 1
done
if ((got_cold)); then
    pass "registry back on the same port and storage: the range that failed now reads correctly ($(($(status_sum bytes_fetched) - FETCHED_BEFORE)) more bytes fetched)"
else
    fail "registry back: the uncached range still fails: exit $RC"; say "$OUT" 3
fi
if (($(status_sum fetch_errors) > 0)); then
    pass "ferry status counts the fetch errors ($(status_sum fetch_errors))"
else
    fail "ferry status shows no fetch errors after the registry outage"
fi

# ---------------------------------------------------------------- 2. kill -9 while starting
echo "# 2. daemon killed with SIGKILL while containers start"
CT=120 cx run -d --snapshotter ferry "$REF" "long-$$" busybox sleep 3600
wait_for 30 "long running" task_running "long-$$" || { fail "container long-$$ did not start"; say "$OUT"; }
BEFORE=$(snap_table)
LAZY_BEFORE=$(fuse_mounts | wc -l)
e2e_log "before the kill: $(committed "$BEFORE" | wc -l) committed snapshots, $LAZY_BEFORE FUSE mounts"

BG_CMD='cat /app/hello.txt && echo bg-ok'
BG_PIDS=()
LOG_MARK=$(wc -l <"$SNAP_LOG")
# bg_reached_snapshotter: a background start's Prepare is in the daemon's log
bg_reached_snapshotter() { tail -n +$((LOG_MARK + 1)) "$SNAP_LOG" | grep "prepare.*bg-[0-9]-$$" >/dev/null; }
for i in 1 2 3; do
    (
        set +e
        timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --snapshotter ferry "$REF" "bg-$i-$$" \
            sh -c "$BG_CMD" >"$E2E_TMP/bg-$i.out" 2>&1
        echo $? >"$E2E_TMP/bg-$i.rc"
    ) &
    BG_PIDS+=($!)
done
(
    fpull "$OTHER_REF"
    echo "$PULL_OUT" >"$E2E_TMP/other-pull.out"
    echo "$PULL_RC" >"$E2E_TMP/other-pull.rc"
) &
BG_PIDS+=($!)
# into the middle of the starts: at the first one's Prepare
wait_for 30 "a start reaches the snapshotter" bg_reached_snapshotter ||
    e2e_log "no background Prepare seen in the log within 30 s; killing anyway"
kill -9 "$SNAP_PID"
wait "$SNAP_PID" 2>/dev/null || true
SNAP_PID=""
e2e_log "daemon killed"
start_ferry_daemon "$DAEMON_CONFIG"
wait "${BG_PIDS[@]}" || true
# containerd redials the proxy with backoff after the connection broke
if wait_for 60 "containerd reconnects" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" snapshots --snapshotter ferry ls; then
    pass "the daemon restarted with the same config and containerd reconnected"
else
    fail "containerd did not reconnect to the restarted daemon within 60s"
fi

for i in 1 2 3; do
    rc=$(cat "$E2E_TMP/bg-$i.rc" 2>/dev/null || echo none)
    out=$(cat "$E2E_TMP/bg-$i.out" 2>/dev/null || true)
    if [[ $rc == 0 && $out == "$(cat "$TREE/app/hello.txt")"$'\nbg-ok' ]]; then
        pass "interrupted start bg-$i finished (its reads ran before the kill or after the restart): '$(tr '\n' ' ' <<<"$out")'"
    elif [[ $rc == 124 || $rc == none ]]; then
        fail "interrupted start bg-$i hung (killed after 120 s)"; say "$out"
    else
        pass "interrupted start bg-$i failed without hanging (exit $rc): $({ grep -m1 -i 'error\|not connected\|abort' <<<"$out" || head -1 <<<"$out"; } | cut -c1-110)"
    fi
done

rc=$(cat "$E2E_TMP/other-pull.rc" 2>/dev/null || echo none)
if [[ $rc == 0 ]]; then
    pass "ferry pull of a second image during the kill finished: $(tail -1 "$E2E_TMP/other-pull.out")"
elif [[ $rc == 124 || $rc == none ]]; then
    fail "ferry pull of a second image during the kill hung"
else
    pass "ferry pull of a second image during the kill failed without hanging (exit $rc): $(grep -m1 -i error "$E2E_TMP/other-pull.out" | cut -c1-110)"
    fpull "$OTHER_REF"
    if [[ $PULL_RC == 0 ]]; then
        pass "the second image pulled again after the restart: $(tail -1 <<<"$PULL_OUT")"
    else
        fail "pulling the second image again after the restart: exit $PULL_RC"; say "$PULL_OUT"
    fi
fi
CT=120 cx run --rm --snapshotter ferry "$OTHER_REF" "other-$$"
if [[ $RC == 0 && $OUT == "other image $$" ]]; then
    pass "the second image runs from its lazy layer after the restart: '$OUT'"
else
    fail "second image after the restart: exit $RC"; say "$OUT"
fi

# mounts: the restarted daemon owns every FUSE mount under its root, each exactly once
FUSE_NOW=$(fuse_mounts)
OWNED=$(daemon_mounts || true)
DUPS=$(uniq -d <<<"$FUSE_NOW")
if [[ -n $FUSE_NOW && $FUSE_NOW == "$OWNED" && -z $DUPS ]]; then
    pass "after the restart: $(wc -l <<<"$FUSE_NOW") FUSE mounts under the root, each once, all served by the new daemon"
else
    fail "FUSE mounts under the root differ from what the daemon serves (duplicates: '$DUPS')"
    diff <(echo "$FUSE_NOW") <(echo "$OWNED") | sed 's/^/    | /' | head -10 || true
fi
if [[ $(wc -l <<<"$FUSE_NOW") == $((LAZY_BEFORE + 1)) ]]; then
    pass "one FUSE mount per lazy layer: $LAZY_BEFORE before the kill, and the second image's"
else
    fail "FUSE mounts: $LAZY_BEFORE before the kill (+1 for the second image), $(wc -l <<<"$FUSE_NOW") after the restart"
fi

# metadata
AFTER=$(snap_table)
REMOTE_KEYS=0
for key in $(committed "$AFTER"); do
    CT=20 cx snapshots --snapshotter ferry info "$key"
    [[ $RC == 0 ]] && [[ $(jq -r '.Labels["ferry.dev/remote"] // empty' <<<"$OUT" 2>/dev/null) != "" ]] &&
        REMOTE_KEYS=$((REMOTE_KEYS + 1))
done
if [[ $REMOTE_KEYS == $(wc -l <<<"$FUSE_NOW") ]]; then
    pass "one FUSE mount per committed lazy snapshot in the metadata ($REMOTE_KEYS labelled ferry.dev/remote)"
else
    fail "$REMOTE_KEYS committed snapshots are lazy layers, but $(wc -l <<<"$FUSE_NOW") FUSE mounts are under the root"
fi
missing=$(comm -23 <(committed "$BEFORE") <(committed "$AFTER" | LC_ALL=C sort))
if [[ -z $missing ]]; then
    pass "every committed snapshot survived the kill ($(committed "$AFTER" | wc -l))"
else
    fail "committed snapshots lost: $missing"
fi
bad=""
while read -r key parent _; do
    [[ -n $key ]] || continue
    CT=20 cx snapshots --snapshotter ferry info "$key"
    [[ $RC == 0 ]] || bad+=" info($key)"
    CT=20 cx snapshots --snapshotter ferry usage "$key"
    [[ $RC == 0 ]] || bad+=" usage($key)"
    if [[ $parent != - ]] && ! awk '{print $1}' <<<"$AFTER" | grep -xF "$parent" >/dev/null; then
        bad+=" parent-of($key)"
    fi
done <<<"$AFTER"
if [[ -z $bad ]]; then
    pass "ctr snapshots ls consistent: $(wc -l <<<"$AFTER") snapshots, each answers info and usage, every parent exists"
else
    fail "inconsistent snapshots after the restart:$bad"
fi

# the interrupted starts can be run again
for i in 1 2 3; do
    remove_container "bg-$i-$$"
    CT=120 cx run --rm --snapshotter ferry "$REF" "bg-$i-$$" sh -c "$BG_CMD"
    if [[ $RC == 0 && $OUT == "$(cat "$TREE/app/hello.txt")"$'\nbg-ok' ]]; then
        pass "bg-$i run again after the restart: '$(tr '\n' ' ' <<<"$OUT")'"
    else
        fail "bg-$i again after the restart: exit $RC"; say "$OUT"
    fi
done

# new containers start and read through the restored lazy layers (the uncached middle
# range included: fetched by the new daemon)
CT=120 cx run --rm --snapshotter ferry "$REF" "new-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "a new container starts after the restart: '$OUT'"
else
    fail "new container after the restart: exit $RC"; say "$OUT"
fi
CT=120 cx run --rm --snapshotter ferry "$REF" "new-sum-$$" sha256sum "$NUMBERS" /bin/busybox /etc/motd
WANT=$(cd "$TREE" && sha256sum ".$NUMBERS" ./bin/busybox ./etc/motd | sed 's#  \./#  /#')
if [[ $RC == 0 && $OUT == "$WANT" ]]; then
    pass "a new container reads whole files through the restored layers (sha256 equal to the image's)"
else
    fail "checksums through the restored layers: exit $RC"; diff <(echo "$WANT") <(echo "$OUT") | indent || true
fi

# the containers that ran across the crash: still listed, and removable
CT=20 cx task ls
if [[ $RC == 0 && $OUT == *"long-$$"*RUNNING* && $OUT == *"reader-$$"*RUNNING* ]]; then
    pass "containers started before the kill are still running (ctr task ls)"
else
    fail "ctr task ls after the restart: exit $RC"; say "$OUT"
fi
ok=1
for c in "long-$$" "reader-$$"; do
    remove_container "$c"
    [[ $RC == 0 ]] || { ok=0; e2e_log "container rm $c: $OUT"; }
done
if ((ok)); then
    pass "the containers from before the kill are killed and removed through the restarted daemon"
else
    fail "removing the containers from before the kill"
fi
STRAY=$(timeout 30 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" containers ls -q 2>/dev/null || true)
[[ -z $STRAY ]] || e2e_log "containers left: $(tr '\n' ' ' <<<"$STRAY")"

# ---------------------------------------------------------------- teardown
# --sync: containerd's GC removes the image's snapshots now, which releases the lazy
# layers (a daemon stopping leaves the lazy layers of live snapshots mounted, for the
# next start to restore)
CT=60 cx image rm --sync "$REF" "$OTHER_REF"
no_fuse_left() { [[ -z $(fuse_mounts) ]]; }
if wait_for 30 "lazy layers released" no_fuse_left && [[ -z $(snap_table) ]]; then
    pass "image removed: containerd removed every snapshot and the daemon released every lazy layer"
else
    fail "after ctr image rm --sync: $(fuse_mounts | wc -l) FUSE mounts, snapshots: $(snap_table | tr '\n' ';')"
fi
kill -TERM "$SNAP_PID"
if wait "$SNAP_PID"; then
    pass "SIGTERM: the restarted daemon exits cleanly"
else
    fail "SIGTERM: the restarted daemon's exit status was not 0"
fi
SNAP_PID=""
if grep -qF "$SNAP_ROOT/" /proc/self/mountinfo; then
    fail "mounts still refer to the snapshotter's root"; grep -F "$SNAP_ROOT/" /proc/self/mountinfo | cut -d' ' -f5,9- | indent 5
else
    pass "no mount refers to the snapshotter's root at the end (none leaked across the kill)"
fi
if [[ $E2E_FAILED != 0 && ${E2E_VERBOSE:-} == 1 ]]; then
    tail -60 "$SNAP_LOG" >&2
fi
e2e_summary
