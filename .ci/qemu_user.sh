#!/usr/bin/env bash
# qemu-user 10 (Debian trixie's qemu-user package, its static binaries) into DIR, without touching
# the system's apt sources: the AVX2 and aarch64 emulation checks need it (bookworm's qemu 7.2
# mis-executes numpy's AVX2 code: an IndexError in a pool mask no real CPU gives; docs/tests.md).
#   bash .ci/qemu_user.sh [DIR]     (default ~/.cache/edgekv/qemu; prints DIR/usr/bin)
set -euo pipefail
DIR=${1:-$HOME/.cache/edgekv/qemu}
BIN="$DIR/usr/bin"
if [ -x "$BIN/qemu-x86_64" ] && [ -x "$BIN/qemu-aarch64" ]; then echo "$BIN"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial"
echo "deb http://deb.debian.org/debian trixie main" > "$WORK/sources.list"
APT=(-o Dir::Etc::sourcelist="$WORK/sources.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$WORK/lists"
     -o Dir::Cache="$WORK/cache" -o APT::Sandbox::User=root -qq)
apt-get "${APT[@]}" update >&2
(cd "$WORK" && apt-get "${APT[@]}" download qemu-user >&2)
mkdir -p "$DIR"
dpkg-deb -x "$WORK"/qemu-user_*.deb "$DIR"
"$BIN/qemu-x86_64" --version | head -1 >&2
echo "$BIN"
