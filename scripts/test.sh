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
cargo test --workspace --locked
