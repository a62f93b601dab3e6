#!/usr/bin/env bash
# Creates the Python virtual environment for the reference cross-checks (tests/reference) at
# build/pyenv and installs tests/reference/requirements.txt into it. Idempotent: the sha256 of the
# requirements file is stored in the venv, and nothing is installed when it matches.
# Needs python3 with the venv module (Debian: python3-venv, installed by scripts/setup-debian.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=build/pyenv
req=tests/reference/requirements.txt
stamp=$venv/.requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)

if [[ -x $venv/bin/python && -f $stamp && $(cat "$stamp") == "$want" ]] && "$venv/bin/python" -c "" 2>/dev/null; then
  echo "setup-python: $venv up to date"
  exit 0
fi

python=${PYTHON:-python3}
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "" 2>/dev/null; then
  echo "setup-python: creating $venv with $($python --version)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
rm -f "$stamp"
echo "setup-python: installing $req"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
echo "$want" >"$stamp"
echo "setup-python: $venv ready"
