#!/usr/bin/env bash
# Create (or update) the virtual environment in .venv with trainloop and its test tools,
# at the versions CI uses (constraints.txt). Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# -qq: pip's errors only. Its warnings include one line for every package a configured index
# or find-links folder does not hold, which says nothing about this install.
PIP=("$VENV/bin/python" -m pip install -qq)
# pip compiles the bytecode of each file it installs, one at a time: 45 of a new venv's 80 s here. In a new
# venv it compiles nothing and compileall does it at the end, on every core; where the venv was there, pip
# compiles the few it adds.
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  PIP+=(--no-compile)
  compile_venv=1
fi
"${PIP[@]}" --upgrade pip
"${PIP[@]}" -c constraints.txt -e ".[test]"
# Two of the test tools are installed so that the suite's hundreds of processes do not import them
# (pyproject.toml's test extra says more; `pip install -e '.[eval,mlflow]'` installs both as a user gets them):
# - lm-evaluation-harness (tests/test_harness.py) without scikit-learn, which brings scipy, and with scipy
#   installed every import of transformers' model classes imports scipy.optimize (0.5 s).
"${PIP[@]}" -c constraints.txt --no-deps lm-eval
# - MLflow's client (tests/test_trackers.py) in $VENV/mlflow, off the venv's import path, its requirements in
#   the venv: DeepSpeed imports mlflow whenever it can (its autotuner, at `import deepspeed`, which accelerate
#   does in every run's export), 1.8 s a process. tests/helpers.py puts it on the pytest workers' path.
MLFLOW_PIN=$(grep '^mlflow-skinny==' constraints.txt)
if [ ! -d "$VENV/mlflow/mlflow_skinny-${MLFLOW_PIN#*==}.dist-info" ]; then  # absent, or another version
  rm -rf "$VENV/mlflow"
  "${PIP[@]}" --no-deps --target "$VENV/mlflow" "$MLFLOW_PIN"
fi
"$VENV/bin/python" - "$VENV/mlflow" <<'PY' | "${PIP[@]}" -c constraints.txt -r /dev/stdin
import importlib.metadata
import sys

[dist] = [d for d in importlib.metadata.distributions(path=[sys.argv[1]]) if d.metadata["Name"] == "mlflow-skinny"]
print("\n".join(r for r in dist.requires if "extra ==" not in r))
PY

# As pip would have, less the packages' own test folders (numpy's, pandas', sympy's...: 6 of its 30 s here), which
# nothing imports; a file that does not compile (a test of a newer Python's syntax) is left as it is.
if [ "${compile_venv:-0}" = 1 ]; then
  "$VENV/bin/python" -m compileall -qq -j 0 -x 'site-packages/.*/tests?/' "$VENV" || true
fi
# An editable install leaves trainloop's own source uncompiled; where PYTHONDONTWRITEBYTECODE is set (CI hosts
# often set it) every process would compile it again, 0.13 s of each run and of each of the suite's few hundred
# processes. Compiled here; an edit later makes its module's file stale, which Python sees and reads the source.
"$VENV/bin/python" -m compileall -q -j 0 trainloop tests scripts

# System packages, installed where this runs as root with apt (elsewhere a note says what to install):
# - libaio-dev: DeepSpeed's NVMe offload (+preset=zero3_nvme) builds its async I/O op against it;
# - ccache: DeepSpeed's ops compile through it (compiler_cache in trainloop/parallel/deepspeed_config.py), so
#   a new venv on this machine, a clean clone's, reuses what an earlier one compiled: seconds, not minutes;
# - libjemalloc2: `python -m trainloop` runs with jemalloc's malloc where it is installed (trainloop/__main__.py):
#   a lower host peak than glibc's heap, the same from one run to the next, at the same speed.
missing=()
{ [ -e /usr/include/libaio.h ] || dpkg -s libaio-dev >/dev/null 2>&1; } || missing+=(libaio-dev)
command -v ccache >/dev/null || missing+=(ccache)
"$VENV/bin/python" -c 'from trainloop.memory.proc import jemalloc_library as j; raise SystemExit(j() is None)' \
  || missing+=(libjemalloc2)  # where a run looks for it
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null \
      || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
  else
    for package in "${missing[@]}"; do
      case $package in
        libaio-dev) echo "note: NVMe offload needs libaio: apt-get install libaio-dev (Debian/Ubuntu, as root)," \
                         "dnf install libaio-devel (Fedora/RHEL) or conda install -c conda-forge libaio" >&2 ;;
        ccache) echo "note: with ccache installed, DeepSpeed's ops compile once per machine, not once per venv" >&2 ;;
        libjemalloc2) echo "note: with jemalloc installed (apt-get install libjemalloc2, or dnf install jemalloc)" \
                           "a run's host memory peaks lower, and the same from one run to the next" >&2 ;;
      esac
    done
  fi
fi
# DeepSpeed compiles its CPU Adam, CPU collectives and async I/O on first use (minutes on a small
# machine; cached in ~/.cache/torch_extensions). The default run needs none of them, so this is
# opt-in: DEEPSPEED_OPS=1 bash scripts/setup.sh (or later: python -m trainloop.deepspeed).
if [ "${DEEPSPEED_OPS:-0}" = 1 ]; then
  "$VENV/bin/python" -m trainloop.deepspeed || echo "note: DeepSpeed's ops could not be prebuilt; they build on first use" >&2
fi
echo "trainloop is installed in $VENV (activate it with: source $VENV/bin/activate)"
