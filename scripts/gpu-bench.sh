#!/usr/bin/env bash
# The GPU measurements in one go: ragkv's CUDA path against llama.cpp's CUDA build on the same
# GGUF files (random weights of real models' shapes, written on the GPU machine), JSON lines
# into a directory. Two steps, because a GPU machine here is lent for minutes and reaches no
# network:
#
#   scripts/gpu-bench.sh pack DIR   on the build machine: packs a stripped `--features cuda`
#                                   release ragkv, llama.cpp's CUDA build (scripts/llama-server.sh
#                                   cuda), the embedder and the evaluation dataset into DIR (xz
#                                   tarballs: bin 23, llama 4, llamacuda 37, cache 21, data 0.5 MiB)
#   scripts/gpu-bench.sh run DIR OUT   on the GPU machine: unpacks DIR, then writes into OUT
#                                   results.jsonl (every benchmark line) and log.txt (stderr)
#
# With llama.cpp the parts exceed what one call of the device tool carries (64 MiB with the
# working tree), so they go in two calls, the second within the machine's warm window (30 s)
# of the first, both carrying a git-ignored folder of the checkout: call A with llamacuda and
# cache (`mkdir -p /tmp/gp && cp A/* /tmp/gp/`), call B with bin, llama and data (`cp B/*
# /tmp/gp/ && scripts/gpu-bench.sh run /tmp/gp $OUT`).
#
# `run` links against the CUDA 13 libraries already on the GPU machine (the NVIDIA wheels of its
# PyTorch install), the driver's libcuda and the ONNX Runtime of its Python `onnxruntime`
# package (or `$ORT_DYLIB_PATH`). Measured (each step bounded by a timeout):
#   1. ragkv bench model --device cuda: prefill and decode against llama-bench (every layer on
#      the GPU), and the GPU's greedy tokens against the CPU path on the same file
#   2. ragkv bench ttft --device cuda: stored KV against full prefill, KV load hidden behind decode
#   3. ragkv bench peer --device cuda: llama-server CUDA (8 slots) beside ragkv, 1/8/32 clients
#
# Environment (run): GPU_BENCH_SHAPES (default "smollm2-135m:q4_1 qwen2.5-0.5b:q8_0"),
# GPU_BENCH_STEPS (default "model ttft peer"; also:
#   "quickstart" when the real SmolLM2 file was shipped as $DIR/smollm2.part*;
#   "ab" for `bench model` again with the serial combining attention kernel (and `bench ttft`
#     with one loading thread), without the fused norm and quantization, without CUDA graphs,
#     then on candle's operations instead of the fused GPU ones;
#   "ab-last" for the first of those alone (the newest change);
#   "redo" for `bench peer` again with RAGKV_CUDA_REDO=on (a chunk's recomputed rows on the
#     fused kernels, off by default until its answers are compared), and `bench ttft
#     --strategy link:K` with it on the first shape (log.txt says whether each strategy's
#     answers equal the "repair" step's: both steps' lines must be in the same OUT, so when
#     they run in two calls give both the same OUT outside the device tool's fresh $OUT, e.g.
#     /tmp/gb, and copy it into $OUT after each);
#   "repair" for `bench ttft --strategy S` on every shape (`link:2` to `link:64`, and the heavy
#     `reposition+recompute:0.5`, `query-aware:0.3`): what each repair costs in time to first
#     token against `reposition` on the GPU (issue 39's budget is 1.5x; on two CPU cores
#     `link:64` costs 4.4-6.7x);
#   "q4" for `bench ttft` again on stored KV in q4 (3.5x fewer bytes to read and copy; its
#     own directory);
#   "ncu" for Nsight Compute's GPU time of every kernel of a short `bench model` run, into
#     OUT/ncu.csv;
#   "cpu-peer" for issue 37's q8-cache `bench peer` (1 and 8 clients, q8 against f16 caches)
#     on this machine's CPU alone, with the real SmolLM2 file shipped as for "quickstart"),
# GPU_BENCH_CODEC (default q8, `kvstore.codec`'s default: the stored chunk KV of the ttft, repair,
#   redo and peer steps; "none" stores f16 as the runs before 2026-11-29 did);
# GPU_BENCH_TTFT_ARGS (more `bench ttft` flags);
# GPU_BENCH_RESIDENT_MB (default 4096: `serve.resident_mb` of the ttft and peer steps, chunk KV
#   kept in GPU memory between queries: `ttft_resident_p50`, and `bench peer`'s warm phase;
#   0 turns it off);
# RAGKV_CUDA_UPLOAD=plain runs candle's own host-to-device copy instead of the pinned one.
# The peer step logs the server's batch steps and graph captures (RAGKV_LOG) into log.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[gpu-bench] %s\n' "$*" >&2; }
cache="${RAGKV_CACHE:-$HOME/.cache/ragkv}"

pack() {
  local dir=$1 target="${CARGO_TARGET_DIR:-$cache/target}"
  mkdir -p "$dir"
  local bin="$target/release/ragkv"
  [ -x "$bin" ] || { log "no $bin: build it first (eval \"\$(scripts/cuda-toolkit.sh)\"; cargo build --release --features cuda --bin ragkv)"; exit 1; }
  local llama="$cache/llama.cpp-cuda/bin" parts=(bin llama llamacuda cache data)
  if [ ! -x "$llama/llama-server" ]; then
    log "no $llama (scripts/llama-server.sh cuda builds it): packing ragkv alone"
    parts=(bin cache data)
  fi
  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  mkdir -p "$stage/bin" "$stage/llama" "$stage/llamacuda/llama" "$stage/cache/models" "$stage/data"
  cp "$bin" "$stage/bin/ragkv"
  strip "$stage/bin/ragkv"
  if [[ " ${parts[*]} " == *" llama "* ]]; then
    cp -P "$llama"/llama-server "$llama"/llama-bench "$llama"/lib*.so* "$stage/llama/"
    strip "$stage/llama/llama-server" "$stage/llama/llama-bench"
    for f in "$stage"/llama/lib*.so*; do [ -L "$f" ] || strip --strip-unneeded "$f"; done
    # libggml-cuda (~60 MB stripped, ~37 MiB packed) is a part of its own, unpacked beside
    # the rest of llama/: with it the parts exceed one call's 64 MiB.
    mv "$stage"/llama/libggml-cuda.so* "$stage/llamacuda/llama/"
  fi
  cp -r "$cache/models/all-MiniLM-L6-v2" "$stage/cache/models/"
  # The questions and the first documents (the runs index 200).
  local ds="${RAGKV_DATASET:-../shared/datasets/longbench-hotpotqa}"
  mkdir -p "$stage/data/longbench-hotpotqa/documents"
  cp "$ds/dev.jsonl" "$stage/data/longbench-hotpotqa/"
  for ((i = 0; i < ${GPU_BENCH_DOCS:-250}; i++)); do
    cp "$ds/documents/doc_$i.txt" "$stage/data/longbench-hotpotqa/documents/"
  done
  for part in "${parts[@]}"; do
    if [ "$part" = llamacuda ]; then
      tar -C "$stage/llamacuda" -cf - llama | xz -9e -T0 >"$dir/$part.tar.xz"
    else
      tar -C "$stage" -cJf "$dir/$part.tar.xz" "$part"
    fi
  done
  du -ch "$dir"/*.tar.xz >&2
}

run() {
  local dir=$1 out=$2
  mkdir -p "$out"
  local root
  root=$(mktemp -d /tmp/gpu-bench.XXXX)
  for part in bin llama llamacuda cache data; do
    [ -f "$dir/$part.tar.xz" ] || continue
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$dir/$part.tar.xz" "$root"
  done
  # The real SmolLM2 file, shipped in parts (it does not fit in one transfer beside the rest).
  if ls "$dir"/smollm2.part* >/dev/null 2>&1; then
    cat "$dir"/smollm2.part* >"$root/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  if [ -z "${ORT_DYLIB_PATH:-}" ]; then
    ORT_DYLIB_PATH=$(python3 -c 'import glob, os, onnxruntime; print(sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))[0])') || true
    export ORT_DYLIB_PATH
  fi
  # CUDA 13 user-space libraries from the machine's Python wheels (cuBLAS, cudart, NVRTC, ...).
  local libs
  libs=$(python3 - <<'EOF'
import glob, os, site
dirs = set()
for sp in site.getsitepackages():
    for f in glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
EOF
)
  export LD_LIBRARY_PATH="$root/llama:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export RAGKV_CACHE="$root/cache" RUST_BACKTRACE=1
  local ragkv="$root/bin/ragkv" ds="$root/data/longbench-hotpotqa" synth="$root/cache/models/synthetic"
  local logf="$out/log.txt" res="$out/results.jsonl"
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv || true
    lscpu | grep -E 'Model name|^CPU\(s\)'
  } >>"$logf" 2>&1
  local shapes="${GPU_BENCH_SHAPES:-smollm2-135m:q4_1 qwen2.5-0.5b:q8_0}"
  local steps=" ${GPU_BENCH_STEPS:-model ttft peer} "
  step() { # name timeout-seconds command...
    local name=$1 limit=$2
    shift 2
    log "$name: $*"
    echo "=== $name ($(date +%T)): $*" >>"$logf"
    local t0=$SECONDS rc=0
    if declare -F "$1" >/dev/null; then # a function of this script: the call's limit bounds it
      "$@" >"$out/.lines" 2>>"$logf" || rc=$?
    else
      timeout "$limit" "$@" >"$out/.lines" 2>>"$logf" || rc=$?
    fi
    echo "=== $name exit $rc after $((SECONDS - t0)) s" >>"$logf"
    sed "s/^{/{\"step\":\"$name\",/" "$out/.lines" >>"$res"
    rm -f "$out/.lines"
    return "$rc"
  }
  # The host-to-device limit this machine reaches: pinned 1 GiB copies through PyTorch.
  if [[ $steps == *" model "* ]]; then
    step h2d 60 python3 -c '
import json, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
y = torch.empty_like(x, device="cuda")
y.copy_(x, non_blocking=True); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5): y.copy_(x, non_blocking=True)
torch.cuda.synchronize()
gbs = 5 * x.numel() / (time.perf_counter() - t) / 1e9
print(json.dumps({"bench": "h2d_pinned_limit", "ours": gbs, "baseline": gbs, "ratio": 1.0, "unit": "GB/s",
  "baseline_name": "PyTorch pinned 1 GiB host-to-device copies (the limit ragkv is measured against)"}))' || true
  fi
  # The quickstart on the GPU: ingest examples/corpus (prefill on the GPU), serve, ask the
  # README's question from stored KV; then the same question on the CPU from the same store.
  if [[ $steps == *" quickstart "* ]]; then
    quickstart() {
      local device=$1 data="$root/quickstart"
      export RAGKV__MODEL__DEVICE=$device
      if [ ! -f "$data/.ingested" ]; then
        "$ragkv" --data-dir "$data" ingest examples/corpus --progress lines >&2 || return 1
        touch "$data/.ingested"
      fi
      "$ragkv" --data-dir "$data" serve --bind 127.0.0.1:0 >&2 &
      local server=$! url
      for _ in $(seq 1 600); do [ -s "$data/server.json" ] && break; sleep 0.1; done
      url=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$data/server.json")
      curl -sf -X POST "$url/v1/query" -H 'content-type: application/json' \
        -d '{"question": "Who was the last resident keeper of the Varrow Point Lighthouse, and what did she do in October 1972?", "top_k": 2, "max_tokens": 96, "stream": false}' |
        python3 -c 'import json, sys; d = json.load(sys.stdin); a = d.get("answer", ""); print(json.dumps({"bench": "quickstart_answer", "ours": float("Thorvald" in a), "baseline": 1.0, "ratio": float("Thorvald" in a), "unit": "names the keeper", "baseline_name": "the corpus: Agnes Thorvald", "detail": {"device": sys.argv[1], "answer": a, "kv": [c.get("kv") for c in d.get("citations", [])], "timings": d.get("timings")}}))' "$device"
      kill -TERM "$server"; wait "$server" || true
      rm -f "$data/server.json"
    }
    for d in ${GPU_BENCH_QUICKSTART_DEVICES:-cuda cpu}; do
      step "quickstart-$d" 120 quickstart "$d" || true
    done
  fi
  # Without llama.cpp's build shipped (a first, diagnostic run), ragkv alone.
  local bench_peer=(--llama-bench "$root/llama/llama-bench")
  local server_peer=(--llama-server "$root/llama/llama-server")
  if [ ! -x "$root/llama/llama-server" ]; then
    log "no llama.cpp shipped: ragkv alone"
    bench_peer=()
    server_peer=(--skip-llama)
  fi
  local resident="${GPU_BENCH_RESIDENT_MB:-4096}"
  # Stored chunk KV in the product's default codec (q8: half of f16's bytes to read and copy).
  local codec="${GPU_BENCH_CODEC:-q8}"
  local kv=(--codec "$codec")
  local synth_args=()
  for s in $shapes; do synth_args+=(--synthetic "$s"); done
  if [[ $steps == *" model "* ]]; then
    local model_rc=0
    step model 180 "$ragkv" bench model --device cuda "${synth_args[@]}" --synthetic-dir "$synth" \
      "${bench_peer[@]}" --no-stock --reps 3 || model_rc=$?
    # Should the graphed decode fail or disagree with the CPU path, the later steps run
    # without graphs (the fused operations one by one), so the lease still measures them.
    if [ "$model_rc" != 0 ] || ! python3 - "$res" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
agree = [l["ours"] for l in lines
         if l.get("step") == "model" and l.get("bench") == "model.device_tokens_vs_cpu"]
sys.exit(0 if agree and min(agree) >= 90 else 1)
EOF
    then
      log "the graphed decode failed or disagrees with the CPU: RAGKV_CUDA_GRAPH=off from here"
      echo "=== RAGKV_CUDA_GRAPH=off from here" >>"$logf"
      export RAGKV_CUDA_GRAPH=off
    fi
  fi
  for s in $shapes; do
    local file="$synth/${s%%:*}-${s##*:}.gguf"
    if [[ ! -f $file && ($steps == *" ttft "* || $steps == *" peer "* || $steps == *" repair "* ||
      $steps == *" q4 "*) ]]; then
      # The model step writes the file; without that step, a one-rep CPU run does.
      "$ragkv" bench model --synthetic "$s" --synthetic-dir "$synth" --reps 1 --no-stock \
        --device cpu --prompt-tokens 16 --decode-tokens 1 >/dev/null 2>>"$logf" || true
    fi
    if [[ $steps == *" ttft "* ]]; then
      local ttft=("$ragkv" bench ttft --device cuda --model "$file" --quantized --dataset "$ds"
        --docs 200 --questions 10 --dir "$root/ttft-${s%%:*}-$codec" "${kv[@]}"
        --resident-mb "$resident" ${GPU_BENCH_TTFT_ARGS:-})
      # Should the pinned upload fail, the same run on candle's own copy.
      step "ttft:$s" 120 "${ttft[@]}" ||
        RAGKV_CUDA_UPLOAD=plain step "ttft-plain:$s" 90 "${ttft[@]}" || true
    fi
    if [[ $steps == *" q4 "* ]]; then
      step "ttft-q4:$s" 120 "$ragkv" bench ttft --device cuda --model "$file" --quantized \
        --dataset "$ds" --docs 200 --questions 10 --dir "$root/ttft-q4-${s%%:*}" --codec q4 || true
    fi
    if [[ $steps == *" repair "* ]]; then
      step "repair:$s" 120 "$ragkv" bench ttft --device cuda --model "$file" --quantized \
        --dataset "$ds" --docs 200 --questions 10 --dir "$root/ttft-${s%%:*}-$codec" "${kv[@]}" \
        --strategy link:2 --strategy link:16 --strategy link:32 --strategy link:64 \
        --strategy reposition+recompute:0.5 --strategy query-aware:0.3 || true
    fi
    # The peer comparison for the first shape only (the lease is minutes long).
    if [[ $steps == *" peer "* && $s == "${shapes%% *}" ]]; then
      RAGKV_LOG="warn,serve::pipeline=debug,model::decoder=debug" \
        step "peer:$s" 150 "$ragkv" bench peer --device cuda --model "$file" --quantized \
        --dataset "$ds" --docs 200 --clients 1,8,32 --rounds 1 --resident-mb "$resident" \
        "${server_peer[@]}" --dir "$root/peer-${s%%:*}-$codec" "${kv[@]}" || true
    fi
    # The same with a chunk's recomputed rows on the fused kernels (RAGKV_CUDA_REDO=on): its
    # answers_stored_kv against the default's says whether that path may become the default.
    if [[ $steps == *" redo "* && $s == "${shapes%% *}" ]]; then
      RAGKV_CUDA_REDO=on step "peer-redo:$s" 150 "$ragkv" bench peer --device cuda \
        --model "$file" --quantized --dataset "$ds" --docs 200 --clients 1,8 --rounds 1 \
        "${server_peer[@]}" --dir "$root/peer-${s%%:*}-$codec" "${kv[@]}" || true
      # The repairs' cost with their rows on the fused kernels (issue 39's budget: 1.5x
      # `reposition`), and whether they answer as candle's operations do: each strategy's
      # answers_digest against the "repair" step's, when that step ran in this OUT.
      RAGKV_CUDA_REDO=on step "repair-redo:$s" 120 "$ragkv" bench ttft --device cuda \
        --model "$file" --quantized --dataset "$ds" --docs 200 --questions 10 \
        --dir "$root/ttft-${s%%:*}-$codec" "${kv[@]}" --strategy link:2 --strategy link:16 \
        --strategy link:64 || true
      python3 - "$res" "$s" >>"$logf" 2>&1 <<'EOF2' || true
import json, sys
res, shape = sys.argv[1], sys.argv[2]
lines = [json.loads(l) for l in open(res) if l.startswith("{")]
def digests(step):
    return {l["bench"]: l["detail"]["answers_digest"] for l in lines
            if l.get("step") == step and "answers_digest" in (l.get("detail") or {})}
off, on = digests("repair:" + shape), digests("repair-redo:" + shape)
for bench, d in sorted(on.items()):
    print("=== fused recomputed rows, %s: %s" % (bench, "no repair run to compare" if bench not in off
          else "same answers" if off[bench] == d else "answers differ"))
EOF2
    fi
  done
  # Issue 37's q8 decoding-cache bars on this machine's CPU (its 16 cores: on the 2-core
  # build machines a batched step is bound by both cores' whole work, weights and caches
  # alike): the real SmolLM2 file (shipped as $DIR/smollm2.part*), no GPU.
  if [[ $steps == *" cpu-peer "* ]]; then
    local smol="$root/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ -f "$smol" ]; then
      step cpu-peer 300 "$ragkv" bench peer --device cpu --model "$smol" --quantized \
        --dataset "$ds" --docs 200 --skip-llama --clients 1,8 --rounds 4 --cache-dtype q8 \
        --versus-cache f16 --dir "$root/cpu-peer" || true
    else
      log "cpu-peer: no SmolLM2 file shipped (smollm2.part*): skipped"
    fi
  fi
  # The same `bench model` without CUDA graphs (the fused operations launched one by one),
  # then on the path before both (candle's attention, separate projections, cudarc's event
  # tracking on): what each changed, on this machine, beside llama.cpp again.
  if [[ $steps == *" ab "* || $steps == *" ab-last "* ]]; then
    RAGKV_CUDA_COMBINE=serial \
      step model-serial-combine 150 "$ragkv" bench model --device cuda "${synth_args[@]}" \
      --synthetic-dir "$synth" "${bench_peer[@]}" --no-stock --reps 3 || true
    # The chunks loaded by one thread, one after the other (the default on a GPU: side by side).
    local first="${shapes%% *}"
    step "ttft-one-loader:$first" 90 "$ragkv" bench ttft --device cuda \
      --model "$synth/${first%%:*}-${first##*:}.gguf" --quantized --dataset "$ds" --docs 200 \
      --questions 10 --dir "$root/ttft-${first%%:*}-$codec" "${kv[@]}" --load-threads 1 || true
  fi
  if [[ $steps == *" ab "* ]]; then
    RAGKV_CUDA_NORM_Q8=off \
      step model-no-norm-q8 150 "$ragkv" bench model --device cuda "${synth_args[@]}" \
      --synthetic-dir "$synth" "${bench_peer[@]}" --no-stock --reps 3 || true
    RAGKV_CUDA_GRAPH=off \
      step model-no-graphs 150 "$ragkv" bench model --device cuda "${synth_args[@]}" \
      --synthetic-dir "$synth" "${bench_peer[@]}" --no-stock --reps 3 || true
    RAGKV_CUDA_GRAPH=off RAGKV_CUDA_ATTENTION=candle RAGKV_CUDA_FUSED=off RAGKV_CUDA_JOIN=off \
      RAGKV_CUDA_EVENTS=on \
      step model-candle-ops 150 "$ragkv" bench model --device cuda "${synth_args[@]}" \
      --synthetic-dir "$synth" "${bench_peer[@]}" --no-stock --reps 3 || true
  fi
  # Every kernel's GPU time in a short run of the first shape (a warm-up and one timed run,
  # each a prefill of 512 tokens and 8 tokens decoded): where a decode step's time goes.
  if [[ $steps == *" ncu "* ]]; then
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1 || true)
    if [ -n "$ncu" ]; then
      step ncu 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
        --print-units base --log-file "$out/ncu.csv" \
        "$ragkv" bench model --device cuda --synthetic "${shapes%% *}" --synthetic-dir "$synth" \
        --no-stock --reps 1 --decode-tokens 8 || true
    else
      log "no ncu on this machine"
    fi
  fi
  log "done: $res"
}

case "${1:-}" in
  pack) pack "${2:?pack DIR}" ;;
  run) run "${2:?run DIR OUT}" "${3:?run DIR OUT}" ;;
  *)
    log "usage: scripts/gpu-bench.sh pack DIR | run DIR OUT"
    exit 2
    ;;
esac
