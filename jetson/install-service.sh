#!/usr/bin/env bash
# Installs `edgekv serve` as a systemd service (jetson/edgekv-serve.service), in one line:
#
#   sudo bash jetson/install-service.sh BUNDLE [serve flags...]
#   sudo bash jetson/install-service.sh models/bundles/smollm2-135m-instruct-int8-fp16 --backend trt \
#       --host 0.0.0.0 --api-key-file /etc/edgekv/keys
#
# Writes /etc/systemd/system/edgekv-serve.service and /etc/edgekv/serve.env (the bundle and the
# flags), then enables and (re)starts the service. Options, before BUNDLE:
#   --user NAME    the account the server runs as (default: the one that ran sudo; never root unless named)
#   --edgekv PATH  the edgekv command (default: this clone's .venv/bin/edgekv, else `edgekv` on PATH)
#   --root DIR     write under DIR instead of / and touch no systemd (packaging, tests)
#   --no-start     write and enable, do not (re)start
# It never replaces a file it did not write (its first line says who wrote it) and never writes
# through a symlink; it checks both files before writing either.
set -euo pipefail

MARK="# Written by edgekv's jetson/install-service.sh: it replaces only files that begin with this line."
HERE=$(cd "$(dirname "$0")" && pwd -P)
fail() { echo "install-service: error: $*" >&2; exit 1; }

ROOT="" USER_NAME="${SUDO_USER:-}" EDGEKV="" START=1
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=${2:?--root needs a folder}; shift 2 ;;
        --user) USER_NAME=${2:?--user needs a name}; shift 2 ;;
        --edgekv) EDGEKV=${2:?--edgekv needs a path}; shift 2 ;;
        --no-start) START=0; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) fail "unknown option $1 before BUNDLE (serve's own flags go after BUNDLE)" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || fail "usage: sudo bash jetson/install-service.sh [--user NAME] [--root DIR] BUNDLE [serve flags...]"
BUNDLE_ARG=$1; shift

# -- what goes in: checked before anything is written
[ -f "$BUNDLE_ARG/edgekv.json" ] || fail "$BUNDLE_ARG is not a bundle (no edgekv.json): give the folder edgekv export wrote"
BUNDLE=$(cd "$BUNDLE_ARG" && pwd -P)
case "$BUNDLE" in *[\"\\\$\`]*) fail "the bundle's path holds a quote, backslash, \$ or backtick: move it" ;; esac

[ -n "$USER_NAME" ] || fail "say which account runs the server: --user NAME (sudo sets it to yours by default)"
id -u "$USER_NAME" >/dev/null 2>&1 || fail "no account named $USER_NAME"
[ "$USER_NAME" != root ] || echo "install-service: warning: the server will run as root (--user root)" >&2

if [ -z "$EDGEKV" ]; then
    if [ -x "$HERE/../.venv/bin/edgekv" ]; then EDGEKV=$(cd "$HERE/../.venv/bin" && pwd -P)/edgekv
    else EDGEKV=$(command -v edgekv || true); fi
fi
[ -n "$EDGEKV" ] && [ -x "$EDGEKV" ] || fail "no edgekv command found: install edgekv, or give --edgekv PATH"
case "$EDGEKV" in /*) ;; *) EDGEKV=$(cd "$(dirname "$EDGEKV")" && pwd -P)/$(basename "$EDGEKV") ;; esac
DOCS=$(cd "$HERE/.." && pwd -P)/docs/serve.md
for p in "$EDGEKV" "$DOCS"; do  # both go into the unit through sed and systemd's parser
    case "$p" in *[[:space:]\"\\\$\`%\|\&]*) fail "the path $p holds a space or a special character: move it" ;; esac
done

# serve's flags travel as one environment variable that systemd splits at spaces: one word each
DRAIN=30
prev=""
for f in "$@"; do
    case "$f" in *[[:space:]\"\'\\\$\`]*) fail "flag '$f' holds whitespace, a quote, backslash, \$ or backtick (one word each)" ;; esac
    [ "$prev" = --drain-seconds ] && DRAIN=$f
    case "$f" in --drain-seconds=*) DRAIN=${f#--drain-seconds=} ;; esac
    prev=$f
done
[[ "$DRAIN" =~ ^[0-9]+([.][0-9]+)?$ ]] || fail "--drain-seconds $DRAIN is not a number of seconds"
# systemd's SIGKILL comes only after the drain's grace and the shutdown after it
STOP_SECONDS=$(( ${DRAIN%%.*} + 15 ))

UNIT="$ROOT/etc/systemd/system/edgekv-serve.service"
ENV_FILE="$ROOT/etc/edgekv/serve.env"

ours_or_absent() {  # a file we may write: absent, or a regular file that begins with our mark
    if [ -L "$1" ]; then fail "$1 is a symlink: not writing through it (remove it first)"; fi
    if [ -e "$1" ]; then
        [ -f "$1" ] || fail "$1 exists and is not a regular file"
        [ "$(head -n 1 "$1")" = "$MARK" ] || fail "$1 exists and was not written by install-service.sh: not replacing it (move it away first)"
    fi
    local d; d=$(dirname "$1")
    if [ -L "$d" ]; then fail "$d is a symlink: not writing through it"; fi
}
ours_or_absent "$UNIT"
ours_or_absent "$ENV_FILE"

write() {  # write FILE MODE < text: a temporary file beside it, then renamed over it
    mkdir -p "$(dirname "$1")"
    local tmp; tmp=$(mktemp "$(dirname "$1")/.edgekv-install.XXXXXX")
    cat > "$tmp"
    chmod "$2" "$tmp"
    mv -f -T "$tmp" "$1"
}

sed -e "s|@EDGEKV@|$EDGEKV|g" -e "s|@USER@|$USER_NAME|g" -e "s|@STOP_SECONDS@|$STOP_SECONDS|g" \
    -e "s|@DOCS@|$DOCS|g" "$HERE/edgekv-serve.service" | write "$UNIT" 0644
{
    echo "$MARK"
    echo "# edgekv serve's settings (systemd EnvironmentFile). After a change: sudo systemctl restart edgekv-serve"
    echo "# (and if --drain-seconds changed, run the installer again: the unit's TimeoutStopSec follows it)."
    echo "EDGEKV_BUNDLE=\"$BUNDLE\""
    echo "EDGEKV_SERVE_FLAGS=\"$*\""
} | write "$ENV_FILE" 0600
echo "install-service: wrote $UNIT and $ENV_FILE (user $USER_NAME, stop timeout ${STOP_SECONDS} s)"

if [ -n "$ROOT" ]; then exit 0; fi
if ! command -v systemctl >/dev/null; then
    echo "install-service: no systemctl here: the files are written, nothing is started" >&2
    exit 0
fi
systemctl daemon-reload
systemctl enable edgekv-serve.service
if [ "$START" = 1 ]; then
    echo "install-service: starting (loading and warming up the model: systemctl returns once it is ready)"
    systemctl restart edgekv-serve.service
    systemctl --no-pager --lines=3 status edgekv-serve.service || true
fi
echo "install-service: logs: journalctl -u edgekv-serve -f; health: curl -s http://127.0.0.1:PORT/health"
