#!/usr/bin/env bash
# Creates .venv-bench/ (git-ignored) with NVIDIA's aiperf load generator and py-spy.
# aiperf lives in its own environment because its pins (transformers, pydantic, zmq, ...) may
# clash with Tandem's. Idempotent: reruns only install what is missing.
#
# Usage: benchmarks/setup_aiperf.sh            (from anywhere)
#        PYTHON=python3.12 benchmarks/setup_aiperf.sh
set -euo pipefail

AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
PY_SPY_VERSION="${PY_SPY_VERSION:-0.4.3}"
# If aiperf's dependency tree pulls torch, take the local CPU wheel (seconds) and never a
# multi-GB CUDA build from the index.
TORCH_PIN="torch==2.13.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-bench"
# aiperf needs Python >= 3.10; Tandem's own interpreter is a safe default.
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [[ ! -x "${VENV}/bin/python" ]]; then
  echo "creating ${VENV} with ${PYTHON}"
  "${PYTHON}" -m venv "${VENV}"
fi

have() { "${VENV}/bin/python" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }

if [[ "$(have aiperf)" != "${AIPERF_VERSION}" || "$(have py-spy)" != "${PY_SPY_VERSION}" ]]; then
  # (grep drops pip's notes about this machine's optional local index mirrors.)
  quiet_notes() { grep -v "is neither a file nor a directory" >&2 || true; }
  "${VENV}/bin/python" -m pip install --quiet --upgrade pip 2> >(quiet_notes)
  # The constraint only bites if something depends on torch.
  constraints="$(mktemp)"
  trap 'rm -f "${constraints}"' EXIT
  echo "${TORCH_PIN}" >"${constraints}"
  "${VENV}/bin/python" -m pip install --quiet -c "${constraints}" \
    "aiperf==${AIPERF_VERSION}" "py-spy==${PY_SPY_VERSION}" 2> >(quiet_notes)
fi

"${VENV}/bin/aiperf" --version 2>/dev/null || "${VENV}/bin/python" -m pip show aiperf | head -2
echo "aiperf ready: ${VENV}/bin/aiperf"
