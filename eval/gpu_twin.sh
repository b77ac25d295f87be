#!/usr/bin/env bash
# The lent GPU machine's image, twinned on this CPU, so that a missing package or an incompatible version is
# found here and not in the 15 minutes of a GPU:
#   - a virtual environment of CPython 3.12 (the image's is 3.12.3; here pyenv's 3.12 is taken) holding only
#     what the image holds that the GPU check imports, at the image's versions: every `image`, `image?` and
#     `shadowed` row of .gpu_carry/manifest.txt (eval/gpu_carry.py), installed from the package index without
#     their dependencies. PyTorch is the image's own 2.11.0 (PyPI's CUDA 13 build with its CUDA libraries: it
#     runs on a CPU; no CPU build of 2.11 for 3.12 is reachable from here), so nothing is a stand-in for it;
#   - the carried wheels, and only those, installed as the device installs them (--no-index --no-deps into a
#     folder ahead on PYTHONPATH);
#   - then eval/gpu_carry.py check, the GPU suite's collection (pytest --collect-only) and eval/gpu_check.sh
#     --dry-run: the import smoke test, the GPU suite with --device cpu, and the 7B benchmark's short form on a
#     2-layer model. It fails on any missing package, wrong version, collection error or failed test.
#
#   bash eval/gpu_twin.sh            (.gpu_carry/ from gpu_check.sh --prepare, made first if absent; ~4.6 GB in
#                                     .gpu_twin/, kept and reused while the manifest is unchanged)
# What it cannot show: anything CUDA does (it has no GPU), and image packages whose version is not documented
# (`image?`: the twin holds the resolved version; the device's own is checked and listed by step 0 there).
set -euo pipefail
cd "$(dirname "$0")/.."
TWIN=${TWIN:-.gpu_twin}
CARRY=.gpu_carry
[ -f "$CARRY/manifest.txt" ] || bash eval/gpu_check.sh --prepare

PY312=${PY312:-}
for candidate in "$(command -v python3.12 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if [ -z "$PY312" ] && [ -x "$candidate" ] && "$candidate" -c "" 2>/dev/null; then
        PY312=$candidate
    fi
done
[ -n "$PY312" ] || { echo "gpu_twin: no CPython 3.12 here (set PY312=/path/to/python3.12)" >&2; exit 2; }
PY="$TWIN/venv/bin/python"

STAMP="$TWIN/venv/.manifest-$(sha256sum "$CARRY/manifest.txt" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    rm -rf "$TWIN/venv"
    "$PY312" -m venv "$TWIN/venv"
    grep -E "# (image|image\?)$" "$CARRY/manifest.txt" | cut -d' ' -f1 > "$TWIN/image.txt"
    # The image's own copy of a carried package goes in after the rest, as the image has it under the carried one.
    grep -E "# shadowed$" "$CARRY/manifest.txt" | cut -d' ' -f1 > "$TWIN/shadowed.txt" || true
    "$PY" -m pip install -q --no-deps -r "$TWIN/image.txt"
    [ -s "$TWIN/shadowed.txt" ] && "$PY" -m pip install -q --no-deps -r "$TWIN/shadowed.txt"
    touch "$STAMP"
fi
"$PY" -c "import sys, torch; print('twin: Python', sys.version.split()[0], '| torch', torch.__version__)"

rm -rf "$TWIN/site"  # exactly the device's install of the carried wheels
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TWIN/site" "$CARRY"/wheels/*.whl

echo "== the GPU suite's collection"
mapfile -t SUITE < <(bash eval/gpu_check.sh --list)
PYTHONPATH="$TWIN/site:$PWD" HF_HUB_OFFLINE=1 "$PY" -m pytest --collect-only -q -p no:cacheprovider --device cpu \
    "${SUITE[@]}" | tail -3

echo "== eval/gpu_check.sh --dry-run in the twin"
OUT=${OUT:-$TWIN/out}
rm -rf "$OUT"
GPU_TWIN=1 SITE="$TWIN/site" PYTHON="$PY" OUT="$OUT" SUITE_BUDGET=${TWIN_SUITE_BUDGET:-2400} BENCH_BUDGET=900 \
    bash eval/gpu_check.sh --dry-run

echo "== verdict"
failed=0
grep -q "are all in place" "$OUT/packages.log" || { echo "twin: packages: see $OUT/packages.log"; failed=1; }
grep -qE "^torch .* transformers" "$OUT/versions.txt" || { echo "twin: the import smoke test failed"; failed=1; }
if ! grep -qE "[0-9]+ passed" "$OUT/tests.log" || grep -qE "[0-9]+ (failed|error)|Interrupted" "$OUT/tests.log"; then
    echo "twin: the suite: see $OUT/tests.log"
    failed=1
fi
grep -q '"latency"' "$OUT/gpu_bench.json" 2>/dev/null || { echo "twin: the benchmark: see $OUT/bench.log"; failed=1; }
[ "$failed" = 0 ] && echo "twin: everything the GPU check needs is here, at the image's versions"
exit "$failed"
