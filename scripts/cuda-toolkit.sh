#!/usr/bin/env bash
# Assembles a CUDA 13.0 build toolkit from NVIDIA's PyPI wheels (nvcc, cicc, headers, cudart,
# cuBLAS, cuRAND, NVRTC) in a cache directory, for building ragkv with `--features cuda` on a
# machine without a system CUDA install. Idempotent; every wheel's sha256 is checked.
#
#   eval "$(scripts/cuda-toolkit.sh)"     # prints the exports, then:
#   cargo build --release -p ragkv --features cuda
#
# Prints `export CUDA_HOME=… NVCC=… LIBRARY_PATH=… CUDARC_CUDA_VERSION=… CUDA_COMPUTE_CAP=…` on
# stdout; logs go to stderr. PATH is left alone: candle's kernel build finds nvcc through NVCC /
# CUDA_HOME. A machine with its own CUDA toolkit (CUDA_HOME set) does not need this script.
#
# The first `--features cuda` build in a target directory also rebuilds RocksDB's C++ (~25 min
# on 2 cores): the CUDA crates' build-time dependencies change how bindgen, a build dependency
# of librocksdb-sys, is compiled.
#
# The wheels carry no driver library, so the script writes a link-time stub `libcuda.so` (SONAME
# libcuda.so.1, one empty function per driver entry point cudarc binds), as the toolkit's own
# lib64/stubs does; at run time the real driver's libcuda.so.1 is loaded. Running the result
# needs an NVIDIA driver for CUDA 13 (r580 or newer).
#
# Environment:
#   RAGKV_CACHE        cache root (default ~/.cache/ragkv); the toolkit lands in $RAGKV_CACHE/cuda-13.0
#   CUDA_COMPUTE_CAP   GPU architecture the kernels are built for (default 90: H100/H200)
set -euo pipefail

cache="${RAGKV_CACHE:-$HOME/.cache/ragkv}"
root="$cache/cuda-13.0"
wheels="$cache/wheels"
log() { printf '[cuda-toolkit] %s\n' "$*" >&2; }

[ "$(uname -sm)" = "Linux x86_64" ] || { log "the wheels are fetched for Linux x86_64 only"; exit 1; }
mkdir -p "$wheels" "$root"

# package version sha256 (CUDA 13.0 update 1 / 2 components).
components=(
  "nvidia-cuda-nvcc 13.0.88 56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"
  "nvidia-cuda-crt 13.0.88 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
  "nvidia-nvvm 13.0.88 c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"
  "nvidia-cuda-runtime 13.0.96 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
  "nvidia-cuda-cccl 13.0.85 e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"
  "nvidia-cuda-nvrtc 13.0.88 ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"
  "nvidia-cublas 13.0.2.14 0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c"
  "nvidia-curand 10.4.0.35 1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc"
)

stamp="$root/.complete"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${components[*]}" ]; then
  rm -rf "$root/unpacked"
  mkdir -p "$root/unpacked"
  for c in "${components[@]}"; do
    read -r pkg ver sha <<<"$c"
    norm="${pkg//-/_}"
    whl=$(ls "$wheels/${norm}-${ver}-"*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$whl" ]; then
      log "downloading $pkg==$ver"
      python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
        "$pkg==$ver" -d "$wheels" >&2
      whl=$(ls "$wheels/${norm}-${ver}-"*.whl | head -n 1)
    fi
    got=$(sha256sum "$whl" | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { log "sha256 mismatch for $whl: $got"; exit 1; }
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$root/unpacked"
  done
  # The wheels install under nvidia/cu13/{bin,include,lib,nvvm}: one CUDA_HOME layout.
  src="$root/unpacked/nvidia/cu13"
  [ -f "$src/bin/nvcc" ] || { log "nvcc missing from the unpacked wheels ($src/bin)"; exit 1; }
  rm -rf "$root/bin" "$root/include" "$root/lib64" "$root/nvvm"
  mv "$src/bin" "$src/include" "$src/nvvm" "$root/"
  mv "$src/lib" "$root/lib64"
  # zipfile drops the mode bits.
  chmod +x "$root"/bin/nvcc "$root"/bin/ptxas "$root"/bin/fatbinary "$root"/bin/nvlink \
    "$root"/bin/cudafe++ "$root"/bin/bin2c "$root"/nvvm/bin/cicc
  # Unversioned names for the linker (the wheels ship only the SONAME files).
  for lib in "$root"/lib64/lib*.so.*; do
    base="${lib##*/}"
    ln -sf "$base" "$root/lib64/${base%%.so.*}.so"
  done
  rm -rf "$root/unpacked"
  echo "${components[*]}" >"$stamp"
  log "toolkit assembled in $root"
fi

# Link-time stub of the driver library, generated from the entry points cudarc binds.
stub="$root/lib64/stubs/libcuda.so"
if [ ! -f "$stub" ]; then
  find_cudarc() { ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort | tail -n 1 || true; }
  cudarc=$(find_cudarc)
  if [ -z "$cudarc" ]; then
    # A fresh machine has not unpacked cudarc yet (only the cuda feature needs it).
    log "fetching the crates' sources (cudarc's entry points name the stub's symbols)"
    cargo fetch --manifest-path "$(dirname "$0")/../Cargo.toml" >&2 || true
    cudarc=$(find_cudarc)
  fi
  [ -n "$cudarc" ] || { log "cudarc sources not found: run 'cargo fetch' first"; exit 1; }
  mkdir -p "$root/lib64/stubs"
  grep -rhoE 'pub unsafe fn cu[A-Za-z0-9_]+' "$cudarc/src/driver/sys/" | sed 's/pub unsafe fn //' | sort -u |
    sed 's/.*/void &(void) {}/' >"$root/lib64/stubs/libcuda.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub" "$root/lib64/stubs/libcuda.c"
  log "driver stub with $(wc -l <"$root/lib64/stubs/libcuda.c") entry points: $stub"
fi

cat <<EOF
export CUDA_HOME="$root"
export NVCC="$root/bin/nvcc"
export LIBRARY_PATH="$root/lib64:$root/lib64/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export CUDARC_CUDA_VERSION=13000
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
EOF
