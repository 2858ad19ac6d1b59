#!/usr/bin/env bash
# The MLflow baseline's own environment (bench/.venv-mlflow, ignored by git): MLflow is a
# benchmark baseline, never a dependency of orbit-dagster. Usage: bench/mlflow-venv.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${MLFLOW_VENV:-$HERE/.venv-mlflow}"
MLFLOW_VERSION="${MLFLOW_VERSION:-3.17.2}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import mlflow, sys; sys.exit(mlflow.__version__ != '$MLFLOW_VERSION')" 2>/dev/null; then
  echo "$VENV has mlflow $MLFLOW_VERSION"; exit 0
fi
"${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "mlflow==$MLFLOW_VERSION"
"$VENV/bin/python" -c "import mlflow; print('mlflow', mlflow.__version__, 'in $VENV')"
