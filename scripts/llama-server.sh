#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-bench` (the CPU peer of `ragkv bench peer` and
# `bench model`) and `llama-quantize` (to re-quantize a GGUF for the benchmark matrix) from the source that the `llama-cpp-python` sdist vendors, into the cache, outside the repo.
# Idempotent: does nothing when the binaries are already there. About 6 minutes on 2 cores.
#
#   scripts/llama-server.sh          native build (every instruction set this CPU has); prints
#                                    the path of llama-server on its last line
#   scripts/llama-server.sh avx2     AVX2 + FMA + F16C only, AVX-512 off: the peer of ragkv's
#                                    `model.kernels = "avx2"` path (into $RAGKV_CACHE/llama.cpp-avx2)
#   scripts/llama-server.sh avx512   AVX-512 (F/BW/VL, VBMI, VNNI, BF16) without AMX: the peer on
#                                    AMX CPUs (Xeon since Sapphire Rapids), where the native
#                                    build's AMX prompt kernels die of SIGILL (sdist 0.3.36,
#                                    docs/BENCHMARKS.md) (into $RAGKV_CACHE/llama.cpp-avx512)
#   scripts/llama-server.sh avxvnni  AVX2 + AVX-VNNI, AVX-512 off: the peer of `model.kernels =
#                                    "avxvnni"` (Intel's cores since Alder Lake; into
#                                    $RAGKV_CACHE/llama.cpp-avxvnni)
#   scripts/llama-server.sh cuda     the CUDA peer of `--features cuda` (into $RAGKV_CACHE/llama.cpp-cuda):
#                                    kernels for $CUDA_COMPUTE_CAP (default 90, H100/H200), CPU code
#                                    for any AVX2 x86; needs the toolkit from scripts/cuda-toolkit.sh
#                                    (eval its output first). About an hour on 2 cores.
#
# Environment:
#   RAGKV_CACHE   cache directory (default: ~/.cache/ragkv); the build lands in $RAGKV_CACHE/llama.cpp
set -euo pipefail

log() { printf '[llama-server] %s\n' "$*" >&2; }

version=0.3.36
cache="${RAGKV_CACHE:-$HOME/.cache/ragkv}"
isa="${1:-native}"
case "$isa" in
  native)
    dest="$cache/llama.cpp"
    isa_flags=(-DGGML_NATIVE=ON)
    ;;
  avx2)
    dest="$cache/llama.cpp-avx2"
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
      -DGGML_AVX_VNNI=OFF -DGGML_BMI2=ON)
    ;;
  avx512)
    dest="$cache/llama.cpp-avx512"
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
      -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
      -DGGML_BMI2=ON)
    ;;
  avxvnni)
    dest="$cache/llama.cpp-avxvnni"
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
      -DGGML_AVX_VNNI=ON -DGGML_BMI2=ON)
    ;;
  cuda)
    dest="$cache/llama.cpp-cuda"
    [ -n "${CUDA_HOME:-}" ] || { log "CUDA_HOME is not set: eval \"\$(scripts/cuda-toolkit.sh)\" first"; exit 2; }
    # libggml-cuda needs libcuda.so.1 (the SONAME); the toolkit's stub is named libcuda.so.
    stub_dir="$cache/llama.cpp-cuda/link-stubs"
    mkdir -p "$stub_dir"
    ln -sf "$CUDA_HOME/lib64/stubs/libcuda.so" "$stub_dir/libcuda.so.1"
    isa_flags=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_COMPUTE_CAP:-90}"
      -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_HOME"
      # The executables link libggml-cuda, whose own CUDA libraries (and the driver stub) the
      # linker must find too.
      "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$CUDA_HOME/lib64:$stub_dir"
      -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    ;;
  *)
    log "unknown build '$isa' (native, avx512, avx2, avxvnni, cuda)"
    exit 2
    ;;
esac
if [ -x "$dest/bin/llama-server" ] && [ -x "$dest/bin/llama-bench" ] && [ -x "$dest/bin/llama-quantize" ]; then
  echo "$dest/bin/llama-server"
  exit 0
fi

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)
# shellcheck source=scripts/apt.sh
. "$(dirname "$0")/apt.sh"
apt_install ${need_apt[@]+"${need_apt[@]}"}

src="$cache/llama_cpp_python-$version"
if [ ! -d "$src/vendor/llama.cpp" ]; then
  mkdir -p "$cache/wheels"
  sdist="$cache/wheels/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$sdist" ]; then
    log "downloading the llama-cpp-python $version sdist (it vendors llama.cpp's source)"
    python3 -m pip download --quiet --no-deps "llama-cpp-python==$version" -d "$cache/wheels" >&2
  fi
  tar -xzf "$sdist" -C "$cache"
fi

log "building llama-server, llama-bench and llama-quantize (cmake, $isa; several minutes)"
build="$src/vendor/llama.cpp/build-$isa"
cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$build" --config Release -j "$(nproc)" --target llama-server llama-bench llama-quantize >&2
mkdir -p "$dest/bin"
cp "$build/bin/llama-server" "$build/bin/llama-bench" "$build/bin/llama-quantize" "$dest/bin/"
# Shared libraries the binaries link (libllama, libggml*), when built shared.
find "$build" -name '*.so*' -exec cp -P {} "$dest/bin/" \; 2>/dev/null || true
log "done: $dest/bin"
echo "$dest/bin/llama-server"
