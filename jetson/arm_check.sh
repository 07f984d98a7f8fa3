#!/usr/bin/env bash
# The runtime's tests over tiny bundles on aarch64, emulated (issue 40 item 3b): a Debian arm64 root
# made from Debian's packages, run by qemu-user through binfmt_misc, with the runtime's dependencies
# as PyPI's aarch64 wheels (no torch); the bundles are exported on this (x86) host by the repo's
# venv (torch) and copied into the root. Run as root (debootstrap, chroot, mounts); no systemd needed.
#
#   sudo jetson/arm_check.sh                 # everything: root (once), venv (once), export, tests
#   jetson/arm_check.sh --dry-run            # the plan: phases, commands, tests; changes nothing
#   sudo jetson/arm_check.sh --wide          # the default selection and the rest of the runtime's
#                                            # tiny-bundle tests (serving, chat, the fused archs)
#   jetson/arm_check.sh --list-tests [--wide]  # the selection's pytest node ids
#   sudo jetson/arm_check.sh tests/test_runtime.py -- -x   # other tests; pytest options after --
#
# Phases (each timed, a summary at the end):
#   binfmt  binfmt_misc mounted and qemu-aarch64 registered with the F flag (the kernel opens the
#           emulator once, so it runs inside the chroot without a copy there)
#   root    debootstrap --variant=minbase of Debian $SUITE arm64 with python3, venv, pip (skipped
#           when ROOT holds a finished one)
#   venv    ROOT/opt/edgekv-venv with the runtime's dependencies and the tests' (aarch64 wheels
#           only; skipped when the installed set is the wanted one; --refresh upgrades)
#   export  the host: the same tests run on x86 with EDGEKV_EXPORT_BUNDLES (tests/arm_bundles.py):
#           every bundle their fixtures make is made in BUNDLES, by conftest's own code, and the
#           x86 result is the baseline
#   copy    the runtime, the tests and the device scripts (git's files: edgekv/, tests/, jetson/,
#           pyproject.toml; not the exporter) and BUNDLES
#           into the root
#   arm     the tests in the root, emulated, with EDGEKV_PREBUILT_BUNDLES (no export, no torch)
#
# Emulated CPU: QEMU_CPU=cortex-a76 by default (Armv8.2 with dotprod, no i8mm/SVE: qemu 7.2's
# nearest to Jetson Orin's Cortex-A78AE); --cpu max for every feature qemu has.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/edgekv
ROOT=${EDGEKV_ARM_ROOT:-$CACHE/arm64-root}
BUNDLES=${EDGEKV_ARM_BUNDLES:-$CACHE/arm64-bundles}
SUITE=${EDGEKV_ARM_SUITE:-bookworm}
MIRROR=${EDGEKV_ARM_MIRROR:-http://deb.debian.org/debian}
CPU=${EDGEKV_ARM_CPU:-cortex-a76}
HOST_PY=${EDGEKV_HOST_PYTHON:-$REPO/.venv/bin/python}
VENV=/opt/edgekv-venv  # inside the root
SRC=/opt/edgekv-src
PREBUILT=/opt/edgekv-bundles
QEMU=/usr/bin/qemu-aarch64-static

# the runtime's dependencies (pyproject.toml), `edgekv serve`'s (the serving tests import it), and
# the test extras that need no torch: pytest, pytest-xdist (conftest.py implements its hooks),
# filelock, openai, hypothesis, pexpect, jsonschema, psutil
PACKAGES=(numpy onnx onnxruntime tokenizers jinja2
          starlette uvicorn prometheus_client httpx llguidance
          pytest pytest-xdist filelock openai hypothesis pexpect jsonschema psutil)

# the default selection: runtime tests that need tiny bundles and no torch when they run
TESTS=(
  tests/arm_bundles.py            # MatMulNBits: the tiny Llama with --weights int4 / int8, vs x86
  tests/test_rows.py              # 4- and 8-bit GGUF blocks: rows independent of M, batched = alone
  tests/test_int4_determinism.py::test_the_tiny_bundles_attention_is_rewritten_exact
  tests/test_int4_determinism.py::test_tiny_int8_batched_equals_alone_bit_for_bit
  tests/test_int4_determinism.py::test_exact_attention_computes_the_graphs_attention
  tests/test_int4_determinism.py::test_edgekv_exact_0_runs_the_graph_as_written
  tests/test_fused_serve.py       # GroupQueryAttention slots (int8-static), batched = alone
  tests/test_fused.py             # GroupQueryAttention (fused) against the plain graph
  tests/test_runtime.py           # the int8 cache: chunked prefill, ring, ExactAttention
  tests/test_decode_step.py
)
# --wide: the rest of the tests over tiny bundles that need no torch when they run (tests over the
# real model are marked slow and left out: -m "not slow")
WIDE=(
  tests/test_serve_engine.py tests/test_slot_capacity.py tests/test_serve_compaction_fuzz.py
  tests/test_serve_http.py tests/test_serve_hardening.py tests/test_serve_lifecycle.py
  tests/test_serve_structured.py tests/test_chat.py tests/test_chat_invariants.py
  tests/test_chat_hardening.py tests/test_engine_hardening.py tests/test_hardening.py
  tests/test_backends.py tests/test_stream.py tests/test_sampling.py tests/test_reasoning.py
  tests/test_graph_contract.py tests/test_guards.py
  tests/test_fused_archs.py       # GroupQueryAttention on every architecture's tiny checkpoint
)
DESELECT=(  # tests in those files that run the exporter, or a bundle made outside made_once
  tests/test_hardening.py::test_export_refuses_a_folder_that_is_not_a_bundle_and_force_keeps_its_files
  tests/test_chat_hardening.py::test_a_chat_saved_with_other_weights_is_refused_naming_the_difference
)
PYTEST_OPTS=(-p tests.arm_bundles -p no:cacheprovider -o "addopts=" -ra -q --durations=10 -m "not slow"
             -n auto --dist loadfile)

usage() {
  cat <<EOF
usage: $0 [--root DIR] [--bundles DIR] [--cpu MODEL] [--suite S] [--mirror URL] [--host-python PY]
          [--wide] [--refresh] [--keep-bundles] [--skip-export] [--dry-run] [--list-tests] [--list-deselected]
          [TEST ...] [-- PYTEST-OPTION ...]
  --root DIR       the arm64 root (made if absent)            [$ROOT]
  --bundles DIR    the host's folder of exported bundles      [$BUNDLES]
  --cpu MODEL      QEMU_CPU for the emulated tests            [$CPU]
  --suite S        Debian suite                               [$SUITE]
  --mirror URL     Debian mirror                              [$MIRROR]
  --host-python PY the host's Python with torch (exporter)    [$HOST_PY]
  --wide           add the wider selection (serving, chat, the fused architectures)
  --refresh        upgrade the root's venv packages (latest onnxruntime for its Python)
  --keep-bundles   reuse what BUNDLES holds (made_once's .done markers) instead of exporting afresh
  --skip-export    use BUNDLES as they are (no host run)
  --dry-run        print the plan and exit
  --list-tests     print the selection's node ids and exit
  --list-deselected  print the node ids left out of those files and exit
  TEST ...         pytest node ids instead of the default selection
env: EDGEKV_ARM_ROOT, EDGEKV_ARM_BUNDLES, EDGEKV_ARM_CPU, EDGEKV_ARM_SUITE, EDGEKV_ARM_MIRROR, EDGEKV_HOST_PYTHON
EOF
}

DRY=0 REFRESH=0 KEEP=0 SKIP_EXPORT=0 WIDEN=0 LIST=0 CHOSEN=() EXTRA=()
while (($#)); do
  case $1 in
    --root) ROOT=$2; shift 2 ;;
    --bundles) BUNDLES=$2; shift 2 ;;
    --cpu) CPU=$2; shift 2 ;;
    --suite) SUITE=$2; shift 2 ;;
    --mirror) MIRROR=$2; shift 2 ;;
    --host-python) HOST_PY=$2; shift 2 ;;
    --refresh) REFRESH=1; shift ;;
    --keep-bundles) KEEP=1; shift ;;
    --skip-export) SKIP_EXPORT=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --wide) WIDEN=1; shift ;;
    --list-tests) LIST=1; shift ;;
    --list-deselected) printf '%s\n' "${DESELECT[@]}"; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "arm_check: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) CHOSEN+=("$1"); shift ;;
  esac
done
((WIDEN)) && TESTS+=("${WIDE[@]}")
((${#CHOSEN[@]})) && TESTS=("${CHOSEN[@]}")
((LIST)) && { printf '%s\n' "${TESTS[@]}"; exit 0; }
for d in "${DESELECT[@]}"; do PYTEST_OPTS+=(--deselect "$d"); done
ROOT=$(realpath -m "$ROOT")
BUNDLES=$(realpath -m "$BUNDLES")

# --- timing ---------------------------------------------------------------------------------
declare -a PHASES=() TIMES=()
T0=0
phase() { T0=$(date +%s.%N); echo; echo "=== arm_check: $1 ==="; PHASES+=("$1"); }
done_phase() {  # [note]
  local t; t=$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  TIMES+=("$t s${1:+ ($1)}"); echo "--- ${PHASES[-1]}: $t s${1:+ ($1)}"
}
# shellcheck disable=SC2317  # (the EXIT trap's)
summary() {
  echo; echo "=== arm_check: times ==="
  local i; for i in "${!TIMES[@]}"; do printf '  %-8s %s\n' "${PHASES[$i]}" "${TIMES[$i]}"; done
}

# --- the root's commands: a private mount namespace (nothing to unmount) ----------------------
# /proc, /dev, and a Jetson Orin's CPU in /proc/cpuinfo and /sys/devices/system/cpu: under qemu-user
# both are otherwise the x86 host's, and with them `import onnxruntime` dies of SIGSEGV (pytorch
# cpuinfo parsing them as an Arm CPU's); without /sys it prints cpuinfo errors on every load. The
# features onnxruntime uses come from AT_HWCAP, that is from QEMU_CPU.
fake_cpu() {
  local d=$ROOT/opt/edgekv-fake n i
  n=$(nproc)
  mkdir -p "$d/sys/devices/system/cpu"
  for i in possible present online; do echo "0-$((n - 1))" > "$d/sys/devices/system/cpu/$i"; done
  : > "$d/cpuinfo"
  for ((i = 0; i < n; i++)); do  # Cortex-A78AE (Jetson Orin), as its kernel lists it
    printf 'processor\t: %d\nBogoMIPS\t: 62.50\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd42\nCPU revision\t: 1\n\n' \
      "$i" "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp uscat ilrcpc flagm paca pacg" >> "$d/cpuinfo"
  done
}
in_root() {  # command ... (run by /bin/sh in the root, a clean environment, QEMU_CPU set)
  # shellcheck disable=SC2016  # (expanded by the inner shell)
  unshare --mount --propagation private /bin/sh -c '
    root=$1; shift
    mount -t proc proc "$root/proc" && mount --bind "$root/opt/edgekv-fake/cpuinfo" "$root/proc/cpuinfo" &&
    mount --bind "$root/opt/edgekv-fake/sys" "$root/sys" && mount --rbind /dev "$root/dev" &&
    exec chroot "$root" "$@"' \
    in_root "$ROOT" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    QEMU_CPU="$CPU" SSL_CERT_FILE=/etc/edgekv-host-ca.crt PIP_CERT=/etc/edgekv-host-ca.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 "${ROOT_ENV[@]}" /bin/sh -c "$*"
}
ROOT_ENV=()

host_ca() {  # the host's CA bundle (pip's and requests' settings first): a proxy's CA included
  local f
  for f in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    [[ -n $f && -f $f ]] && { echo "$f"; return; }
  done
}

ARM_CMD="cd $SRC && $VENV/bin/python -m pytest$(printf ' %q' "${PYTEST_OPTS[@]}" "${TESTS[@]}" "${EXTRA[@]}")"
HOST_CMD=(env "EDGEKV_EXPORT_BUNDLES=$BUNDLES" "PYTHONPATH=$REPO" "$HOST_PY" -m pytest "${PYTEST_OPTS[@]}" "${TESTS[@]}" "${EXTRA[@]}")

if ((DRY)); then
  cat <<EOF
arm_check plan (dry run: nothing done)
  repo      $REPO
  binfmt    mount binfmt_misc on /proc/sys/fs/binfmt_misc if needed; register qemu-aarch64 (flags F) from
            /usr/lib/binfmt.d/qemu-aarch64.conf if absent; emulator $QEMU
  root      $ROOT  (debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates $SUITE ROOT $MIRROR, if absent)
  venv      $VENV in the root: pip install --only-binary=:all: ${PACKAGES[*]}
  export    cd $REPO &&$(printf ' %q' "${HOST_CMD[@]}")
  copy      git ls-files (edgekv/ tests/ jetson/ pyproject.toml) -> ROOT$SRC (pip install -e: the edgekv command);
            $BUNDLES -> ROOT$PREBUILT
  arm       QEMU_CPU=$CPU EDGEKV_PREBUILT_BUNDLES=$PREBUILT, /proc/cpuinfo and /sys/devices/system/cpu a Jetson
            Orin's (Cortex-A78AE): $ARM_CMD
  tests     ${#TESTS[@]} node ids:
EOF
  printf '              %s\n' "${TESTS[@]}"
  exit 0
fi

[[ $(id -u) == 0 ]] || { echo "arm_check: run as root (debootstrap, chroot and mounts need it)" >&2; exit 2; }
for tool in debootstrap unshare chroot "$QEMU"; do
  command -v "$tool" >/dev/null || { echo "arm_check: $tool is missing (apt-get install qemu-user-static debootstrap)" >&2; exit 2; }
done
trap summary EXIT

# --- binfmt ---------------------------------------------------------------------------------
phase binfmt
BFM=/proc/sys/fs/binfmt_misc
if [[ ! -e $BFM/register ]]; then
  mount -t binfmt_misc binfmt_misc "$BFM" || { echo "arm_check: cannot mount binfmt_misc: qemu-user cannot run the root's programs (every exec needs it)" >&2; exit 1; }
fi
if [[ ! -e $BFM/qemu-aarch64 ]]; then
  if [[ -f /usr/lib/binfmt.d/qemu-aarch64.conf ]]; then
    cat /usr/lib/binfmt.d/qemu-aarch64.conf > "$BFM/register"
  else  # the magic and mask qemu's own binfmt scripts register for aarch64 ELF
    printf '%s' ':qemu-aarch64:M::\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$QEMU"':OCF' > "$BFM/register"
  fi
fi
grep -q '^enabled' "$BFM/qemu-aarch64" || echo 1 > "$BFM/qemu-aarch64"
INTERP=$(sed -n 's/^interpreter //p' "$BFM/qemu-aarch64")
FLAGS=$(sed -n 's/^flags: //p' "$BFM/qemu-aarch64")
echo "qemu-aarch64: $(sed -n 1p "$BFM/qemu-aarch64"), interpreter $INTERP, flags $FLAGS; $($QEMU --version | head -1)"
done_phase

# --- root -----------------------------------------------------------------------------------
phase root
if [[ -f $ROOT/.edgekv-root-done ]]; then
  [[ $FLAGS == *F* ]] || install -D "$QEMU" "$ROOT$INTERP"
  done_phase "kept $ROOT"
elif [[ -x $ROOT/usr/bin/python3 && -d $ROOT/usr/lib/python3/dist-packages/pip && ! -d $ROOT/debootstrap ]]; then
  touch "$ROOT/.edgekv-root-done"  # a finished debootstrap of the same recipe, made by hand
  done_phase "adopted $ROOT"
elif [[ -e $ROOT && -n $(ls -A "$ROOT") ]]; then
  echo "arm_check: $ROOT exists and is not a finished root: remove it or name another (--root)" >&2
  exit 1
else
  rm -rf "$ROOT.partial"
  mkdir -p "$(dirname "$ROOT")"
  [[ $FLAGS == *F* ]] || install -D "$QEMU" "$ROOT.partial$INTERP"  # no F flag: the kernel looks in the root
  echo "debootstrap of $SUITE arm64 into $ROOT (log $ROOT.debootstrap.log) ..."
  if ! debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
       "$SUITE" "$ROOT.partial" "$MIRROR" > "$ROOT.debootstrap.log" 2>&1; then
    tail -20 "$ROOT.debootstrap.log"; echo "arm_check: debootstrap failed (log $ROOT.debootstrap.log)" >&2; exit 1
  fi
  rmdir "$ROOT" 2>/dev/null || true
  mv "$ROOT.partial" "$ROOT"
  touch "$ROOT/.edgekv-root-done"
  done_phase made
fi
fake_cpu
in_root 'python3 -c "import platform, sys; print(platform.machine(), sys.version.split()[0])"'

# --- venv -----------------------------------------------------------------------------------
phase venv
cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
ca=$(host_ca); [[ -n $ca ]] && cp "$ca" "$ROOT/etc/edgekv-host-ca.crt"
WANT="${PACKAGES[*]}"
if ((REFRESH)) || [[ ! -x $ROOT$VENV/bin/python || "$(cat "$ROOT$VENV/.edgekv-packages" 2>/dev/null)" != "$WANT" ]]; then
  in_root "[ -x $VENV/bin/python ] || python3 -m venv $VENV; $VENV/bin/pip install --upgrade --only-binary=:all: $WANT"
  echo "$WANT" > "$ROOT$VENV/.edgekv-packages"
  done_phase installed
else
  done_phase kept
fi
in_root "$VENV/bin/python -c 'import numpy, onnx, onnxruntime, tokenizers, pytest; print(\"numpy\", numpy.__version__, \"onnx\", onnx.__version__, \"onnxruntime\", onnxruntime.__version__, \"tokenizers\", tokenizers.__version__, \"pytest\", pytest.__version__)'" 2>/dev/null

# --- export (the host) ----------------------------------------------------------------------
phase export
HOST_RC=skipped
if ((SKIP_EXPORT)); then
  done_phase skipped
else
  if ((!KEEP)) && [[ -d $BUNDLES ]]; then  # afresh: conftest's own bundles are never reused across runs either
    if [[ -e $BUNDLES/.edgekv-arm-bundles || -z $(ls -A "$BUNDLES") ]]; then
      rm -rf "$BUNDLES"
    else
      echo "arm_check: $BUNDLES is not a folder this script made: remove it or name another (--bundles)" >&2; exit 1
    fi
  fi
  mkdir -p "$BUNDLES" && touch "$BUNDLES/.edgekv-arm-bundles"
  set +e
  (cd "$REPO" && "${HOST_CMD[@]}") > "$BUNDLES/host.log" 2>&1
  HOST_RC=$?
  if ((HOST_RC)) && grep -q "corrupt bundle" "$BUNDLES/host.log" && [[ ${EDGEKV_TRACE_CACHE:-on} != off ]]; then
    echo "arm_check: an export made a graph onnxruntime refuses; once more without the torch.onnx trace cache"
    mv "$BUNDLES/host.log" "$BUNDLES/host-trace-cache.log"
    (cd "$REPO" && EDGEKV_TRACE_CACHE=off "${HOST_CMD[@]}") > "$BUNDLES/host.log" 2>&1
    HOST_RC=$?
  fi
  set -e
  grep -v "torchvision is not installed" "$BUNDLES/host.log" | tail -15
  done_phase "x86 tests rc=$HOST_RC, log $BUNDLES/host.log"
fi

# --- copy -----------------------------------------------------------------------------------
phase copy
rm -rf "$ROOT$SRC" "$ROOT$PREBUILT"
mkdir -p "$ROOT$SRC" "$ROOT$PREBUILT"
(cd "$REPO" && git ls-files -z -co --exclude-standard -- edgekv tests jetson pyproject.toml \
   | tar --null -T - --ignore-failed-read -cf -) | tar -C "$ROOT$SRC" -xf -
cp -a "$BUNDLES/." "$ROOT$PREBUILT/"
rm -f "$ROOT$PREBUILT"/*.lock
# the edgekv command (jetson/install-service.sh and the CLI tests look for it), editable: the same
# path each run, so once per venv
in_root "[ -x $VENV/bin/edgekv ] || $VENV/bin/pip install -q --no-deps -e $SRC"
done_phase "$(du -sh "$ROOT$SRC" | cut -f1) source, $(du -sh "$ROOT$PREBUILT" | cut -f1) bundles"

# --- arm ------------------------------------------------------------------------------------
phase arm
ROOT_ENV=("EDGEKV_PREBUILT_BUNDLES=$PREBUILT" "PYTHONPATH=$SRC" "PATH=$VENV/bin:/usr/local/bin:/usr/bin:/bin")
set +e
in_root "$ARM_CMD" 2>&1 | tee "$BUNDLES/arm.log"
ARM_RC=${PIPESTATUS[0]}
set -e
done_phase "aarch64 tests rc=$ARM_RC (QEMU_CPU=$CPU), log $BUNDLES/arm.log"
counts() { grep -Eo '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$1" 2>/dev/null | paste -sd, -; }
echo "arm_check: x86 rc=$HOST_RC ($( ((SKIP_EXPORT)) || counts "$BUNDLES/host.log")), aarch64 rc=$ARM_RC ($(counts "$BUNDLES/arm.log"))"
exit "$ARM_RC"
