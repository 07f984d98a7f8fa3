#!/usr/bin/env bash
# CI: edgekv's runtime and `serve` dependencies (pyproject.toml's, read here, not repeated) resolve
# as binary wheels for the Jetson's stock Pythons (issue 40 item 3a), with nothing to compile:
#   JetPack 6: Ubuntu 22.04 (glibc 2.35), CPython 3.10, aarch64
#   JetPack 7: Ubuntu 24.04 (glibc 2.39), CPython 3.12, aarch64
# `pip download --only-binary=:all:` for each, every manylinux tag the board's glibc runs (pip does
# not widen manylinux_2_X to older glibcs itself); prints what resolved, onnxruntime first. Only the
# package registry is used; nothing is installed. PYTHON: the interpreter running pip (default the
# venv's); its pip evaluates environment markers for itself, not the target (a marker-only
# dependency of the target Python may not be listed: pure-Python ones are wheels anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

mapfile -t DEPS < <("$PY" - <<'EOF'
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for d in project["dependencies"] + project["optional-dependencies"]["serve"]:
    print(d)
EOF
)
echo "== Jetson wheels: ${DEPS[*]}"

status=0
t0=$SECONDS
for target in "3.10 cp310 35 JetPack-6" "3.12 cp312 39 JetPack-7"; do
    read -r version abi glibc name <<<"$target"
    platforms=()
    for ((y = glibc; y >= 17; y--)); do platforms+=(--platform "manylinux_2_${y}_aarch64"); done
    platforms+=(--platform manylinux2014_aarch64)
    t=$SECONDS
    if "$PY" -m pip download --disable-pip-version-check --progress-bar off --only-binary=:all: \
            "${platforms[@]}" --python-version "$version" --implementation cp --abi "$abi" \
            -d "$TMP/$abi" "${DEPS[@]}" >"$TMP/$abi.log" 2>&1; then
        "$PY" - "$TMP/$abi" "$name" "$version" "$((SECONDS - t))" <<'EOF' || status=1
import os, sys

folder, name, version, seconds = sys.argv[1:]
wheels, other = [], []
for f in sorted(os.listdir(folder)):
    if not f.endswith(".whl"):
        other.append(f)
        continue
    dist, ver, *_, py, abi, plat = f[:-4].split("-")
    wheels.append((dist.lower().replace("_", "-"), ver, f"{py}-{abi}-{plat}"))
ort = [w for w in wheels if w[0] == "onnxruntime"]
print(f"{name} (CPython {version} aarch64): {len(wheels)} wheels in {seconds} s; "
      f"onnxruntime {ort[0][1] if ort else 'MISSING'}")
for dist, ver, tag in sorted(wheels, key=lambda w: (w[0] != "onnxruntime", w[0])):
    print(f"  {dist}=={ver}  {tag}")
bad = [w for w in wheels if not (w[2].endswith("-any") or "aarch64" in w[2])]
if other or bad or not ort:
    print(f"  not a usable aarch64 wheel: {other + [w[0] for w in bad] or 'onnxruntime missing'}")
    sys.exit(1)
EOF
    else
        status=1
        echo "$name (CPython $version aarch64): does NOT resolve as binary wheels"
        grep -v "^WARNING: Location" "$TMP/$abi.log" | tail -n 15 | sed 's/^/  /'
    fi
done
echo "== Jetson wheels: $([ $status -eq 0 ] && echo ok || echo FAILED) in $((SECONDS - t0)) s"
exit $status
