#!/usr/bin/env bash
# The project's main job, end to end: set-up, ingest the example corpus, start the server,
# ask a question through the HTTP endpoint.
#
# Not yet: ingestion (issue 5) and the HTTP endpoint (issue 6) have not landed. Until they do,
# this script builds the binary and exercises what exists: the KV store's operations.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ragkv/target}"
cargo build --release --locked -p ragkv
bin="$CARGO_TARGET_DIR/release/ragkv"
data="$(mktemp -d)"
trap 'rm -rf "$data"' EXIT
"$bin" --data-dir "$data" stats
"$bin" --data-dir "$data" verify
echo "not yet: ingest and serve are not implemented; see README.md (Status)." >&2
exit 2
