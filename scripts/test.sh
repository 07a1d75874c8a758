#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what the build needs, then runs
# every test of the workspace.
#
# The target directory defaults to ~/.cache/ragkv/target, outside the checkout, so that fresh
# clones on the same machine (CI) reuse the expensive RocksDB build. Set CARGO_TARGET_DIR to
# use another one.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ragkv/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

cargo fmt --all -- --check
# No import circle between sibling modules of any crate (docs/ARCHITECTURE.md, "Tests").
python3 scripts/module-graph.py

log="$(mktemp)"
# The suites that need a server are `#[ignore]`d in the main run; what the runs against real
# servers execute of them goes to its own log, so the totals count each test once.
remote_log="$(mktemp)"
trap 'rm -f "$log" "$remote_log"' EXIT
status=0
# --no-fail-fast: every test binary runs even after one fails, so one failure never hides
# another; the exit status still reports it.
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
# The Qwen2 suites need the benchmark model (RAGKV_MODELS=bench scripts/setup.sh); they run
# when it has been fetched into the model cache, and are reported as skipped otherwise.
models="${RAGKV_CACHE:-$HOME/.cache/ragkv}/models"
if [ -f "$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" ]; then
  cargo test --workspace --locked --no-fail-fast --test qwen2 --test tokenizer -- --ignored 2>&1 | tee -a "$remote_log" || status=$?
else
  echo "Qwen2 suites skipped: no benchmark model (RAGKV_MODELS=bench scripts/setup.sh fetches it)"
fi
# The remote vector-index suite needs a Qdrant server; it is skipped (reported as ignored, with
# the reason) unless QDRANT_URL names one.
if [ -n "${QDRANT_URL:-}" ]; then
  # `--workspace`, not `-p`: a one-package build resolves features differently and would
  # compile RocksDB's C++ again.
  cargo test --workspace --locked --no-fail-fast --test remote -- --ignored 2>&1 | tee -a "$remote_log" || status=$?
fi
# The remote KV suites need an S3 server: Garage on loopback, when `scripts/test-servers.sh
# install` has built it (once; it stays in ~/.cache/ragkv/servers).
if scripts/test-servers.sh installed; then
  scripts/test-servers.sh start
  trap 'rm -f "$log" "$remote_log"; scripts/test-servers.sh stop' EXIT
  # shellcheck disable=SC1091
  source "${RAGKV_SERVERS:-${TMPDIR:-/tmp}/ragkv-servers}/env"
  cargo test --workspace --locked --no-fail-fast --test tier --test remote_tier -- --ignored 2>&1 | tee -a "$remote_log" || status=$?
  # The same tier on a three-node Garage cluster: one node killed and brought back.
  scripts/test-servers.sh cluster-start
  trap 'rm -f "$log" "$remote_log"; scripts/test-servers.sh stop; scripts/test-servers.sh cluster-stop' EXIT
  # shellcheck disable=SC1091
  source "${RAGKV_SERVERS:-${TMPDIR:-/tmp}/ragkv-servers}/cluster/env"
  cargo test --workspace --locked --no-fail-fast --test cluster -- --ignored 2>&1 | tee -a "$remote_log" || status=$?
else
  echo "remote KV suites skipped: no S3 server (scripts/test-servers.sh install builds one)"
fi
# One closing line with the totals over every test binary (cargo prints one line per binary):
# skipped = ignored in the main run, less those the server runs executed.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1); if ($(i) ~ /^ignored/ && FILENAME == ARGV[1]) g += $(i-1); if (FILENAME == ARGV[2] && ($(i) ~ /^passed/ || $(i) ~ /^failed/)) g -= $(i-1) } }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, g }' "$log" "$remote_log"
exit "$status"
