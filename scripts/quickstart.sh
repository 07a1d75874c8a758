#!/usr/bin/env bash
# The project's main job, end to end, on a fresh machine: set-up (apt packages, models), build,
# ingest the example corpus (chunk, embed, index, prefill and store every chunk's KV), start the
# HTTP server, ask a question, print the streamed answer with its citations and timings, and
# stop the server.
#
#   scripts/quickstart.sh ["your question"]
#
# Environment: RAGKV_DATA (default: a temporary directory, removed afterwards),
# CARGO_TARGET_DIR (default ~/.cache/ragkv/target), RAGKV_PROFILE (dev, the default: the same
# build as scripts/test.sh, with every dependency optimized; or release: also optimizes
# ragkv's own crates, at the cost of a second cold build of RocksDB, Qdrant Edge and candle).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ragkv/target}"
if [ "${RAGKV_PROFILE:-dev}" = dev ]; then
  cargo build --locked -p ragkv
  bin="$CARGO_TARGET_DIR/debug/ragkv"
else
  cargo build --release --locked -p ragkv
  bin="$CARGO_TARGET_DIR/release/ragkv"
fi
question="${1:-Who was the last resident keeper of the Varrow Point Lighthouse, and what did she do in October 1972?}"

if [ -n "${RAGKV_DATA:-}" ]; then
  data="$RAGKV_DATA"
else
  data="$(mktemp -d)"
  trap 'rm -rf "$data"' EXIT
fi

echo "== ingest examples/corpus into $data" >&2
"$bin" --data-dir "$data" ingest examples/corpus

echo "== serve" >&2
"$bin" --data-dir "$data" serve --bind 127.0.0.1:0 &
server=$!
stop() { kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null || true; }
trap 'stop; [ -z "${RAGKV_DATA:-}" ] && rm -rf "$data"' EXIT
for _ in $(seq 1 600); do
  [ -s "$data/server.json" ] && break
  kill -0 "$server" 2>/dev/null || { echo "the server exited" >&2; exit 1; }
  sleep 0.1
done
url=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$data/server.json")
curl -sf "$url/healthz" >/dev/null

echo "== POST $url/v1/query" >&2
echo "Q: $question"
body=$(python3 -c 'import json,sys; print(json.dumps({"question": sys.argv[1], "top_k": 2, "max_tokens": 96}))' "$question")
curl -sN -X POST "$url/v1/query" -H 'content-type: application/json' -d "$body" | python3 -c '
import json, sys
event = None
for line in sys.stdin:
    line = line.rstrip("\n")
    if line.startswith("event:"):
        event = line[6:].strip()
    elif line.startswith("data:"):
        data = json.loads(line[5:].strip())
        if event == "token":
            if not getattr(sys, "_started", False):
                sys.stdout.write("A: "); sys._started = True
            sys.stdout.write(data["text"]); sys.stdout.flush()
        elif event == "done":
            print()
            for c in data["citations"]:
                print("  cited %s chunk %s (score %.3f, KV %s)" % (c["doc_id"], c["chunk"], c["score"], c["kv"]))
            t = data["timings"]
            print("  timings (ms): " + ", ".join("%s %.1f" % (k[:-3], v) for k, v in t.items()))
        elif event == "error":
            print("\nerror:", data["error"]["message"], file=sys.stderr); sys.exit(1)
'
