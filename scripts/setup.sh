#!/usr/bin/env bash
# Create (or update) the virtual environment in .venv with trainloop and its test tools,
# at the versions CI uses (constraints.txt). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -c constraints.txt -e ".[test]"
echo "trainloop is installed in $VENV (activate it with: source $VENV/bin/activate)"
