#!/usr/bin/env bash
# tests/gpu in one command on a bare GPU machine: builds native/ against the real driver,
# runs the suite with the machine's python3 (PyTorch, CuPy, pytest and nvidia-ml-py come with it),
# writes the results file and prints the table.
#
#   tests/gpu/run.sh [pytest args...]      e.g. tests/gpu/run.sh -k memory
#
# Environment: PYTHON (default python3), HAMIPY_GPU_RESULTS (default tests/gpu/results/gpu.json).
# The device plugin's and monitor's own test (test_real_nvml.py) needs their Python dependencies:
# `make gpu-wheels` (on a machine with PyPI) puts them in .hamipy/gpu-wheels, which this script
# installs offline into .hamipy/gpu-site; without them that file is skipped, with the reason.
# Off-GPU it still builds and starts: every test is skipped with the reason, and it exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
RESULTS=${HAMIPY_GPU_RESULTS:-$ROOT/tests/gpu/results/gpu.json}
export HAMIPY_GPU_RESULTS=$RESULTS
START=$(date +%s)

echo ">> building native/ (gcc; the driver is the machine's, loaded at run time)"
make -C native >/dev/null

SITE=$ROOT/.hamipy/gpu-site
WHEELS=$ROOT/.hamipy/gpu-wheels
if [[ -d $WHEELS && ! -f $SITE/.installed ]]; then
    echo ">> installing the services' dependencies from $WHEELS (offline)"
    rm -rf "$SITE"
    if "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$SITE" -r "$WHEELS/requirements.txt"; then
        touch "$SITE/.installed"
    else
        echo "!! could not install them: test_real_nvml.py will be skipped" >&2
    fi
fi
SRC=$(printf '%s:' "$ROOT"/libs/*/src "$ROOT"/services/*/src)
export PYTHONPATH="$SRC$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo ">> $("$PY" --version), pytest tests/gpu"
rm -f "$RESULTS"
set +e
"$PY" -m pytest -c tests/gpu/pytest.ini tests/gpu -p no:cacheprovider -rs "$@"
status=$?
set -e

echo
if [[ -f $RESULTS ]]; then
    "$PY" tests/gpu/report.py "$RESULTS"
    echo "(results: $RESULTS)"
else
    echo "no results written: nothing ran (no GPU here?)"
fi
echo ">> tests/gpu took $(( $(date +%s) - START )) s, pytest exit $status"
exit $status
