#!/usr/bin/env bash
# Real servers for the remote test suites, on loopback (never mocks):
#
#   scripts/test-servers.sh install   builds Garage (S3-compatible object store, from crates.io)
#                                     into ~/.cache/ragkv/servers (once; 74 min here on 2 shared cores)
#   scripts/test-servers.sh start     starts it (fresh data) and writes $RAGKV_SERVERS/env with
#                                     the variables the suites read (RAGKV_TEST_S3_*)
#   scripts/test-servers.sh stop
#   scripts/test-servers.sh installed exits 0 when Garage is installed
#   scripts/test-servers.sh cluster-start    three Garage nodes on loopback (replication factor
#                                     3, each its own ports and data directory), one bucket;
#                                     writes $RAGKV_SERVERS/cluster/env (RAGKV_TEST_GARAGE_*)
#   scripts/test-servers.sh cluster-kill N, cluster-revive N   SIGKILLs / restarts node N
#   scripts/test-servers.sh cluster-stop
#
# `scripts/test.sh` starts the servers that are installed and runs the remote suites against
# them. Qdrant's server is not on any package registry this project may use (crates.io has a
# placeholder); a Qdrant built by hand is used when QDRANT_URL names it (README, "Tests").
set -euo pipefail
cd "$(dirname "$0")/.."

GARAGE_VERSION=2.5.0
cache="${RAGKV_CACHE:-$HOME/.cache/ragkv}/servers"
run="${RAGKV_SERVERS:-${TMPDIR:-/tmp}/ragkv-servers}"
garage="$cache/garage-$GARAGE_VERSION/bin/garage"
# S3 API on this port, RPC on the next, admin on the one after.
port="${RAGKV_GARAGE_PORT:-39100}"
bucket=ragkv-test
# A test-only key pair (Garage's formats: GK + 24 hex digits, 64 hex digits).
key_id=GK0123456789abcdef01234567
secret=0000000000000000000000000000000000000000000000000000000000000001

install() {
  if [ -x "$garage" ]; then
    echo "garage $GARAGE_VERSION: $garage"
    return
  fi
  echo "building garage $GARAGE_VERSION into $cache (once; about an hour on 2 cores)..."
  # SQLite metadata only: no LMDB, no metrics exporter (fewer crates to build).
  cargo install garage --version "$GARAGE_VERSION" --locked \
    --no-default-features --features bundled-libs,sqlite \
    --root "$cache/garage-$GARAGE_VERSION" --target-dir "$cache/garage-build"
  rm -rf "$cache/garage-build"
}

stop() {
  if [ -f "$run/garage/pid" ]; then
    kill "$(cat "$run/garage/pid")" 2>/dev/null || true
    rm -f "$run/garage/pid"
  fi
}

start() {
  if [ ! -x "$garage" ]; then
    echo "garage is not installed: scripts/test-servers.sh install" >&2
    exit 1
  fi
  stop
  rm -rf "$run/garage"
  mkdir -p "$run/garage"
  chmod 700 "$run/garage"
  cat > "$run/garage/garage.toml" <<EOF
metadata_dir = "$run/garage/meta"
data_dir = "$run/garage/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$((port + 1))"
rpc_public_addr = "127.0.0.1:$((port + 1))"
rpc_secret = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$port"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$((port + 2))"
EOF
  chmod 600 "$run/garage/garage.toml"
  GARAGE_DEFAULT_ACCESS_KEY="$key_id" GARAGE_DEFAULT_SECRET_KEY="$secret" \
    GARAGE_DEFAULT_BUCKET="$bucket" RUST_LOG="${RUST_LOG_GARAGE:-warn}" \
    "$garage" -c "$run/garage/garage.toml" server --single-node --default-bucket \
    > "$run/garage/log" 2>&1 &
  echo $! > "$run/garage/pid"
  # Ready when the S3 port answers and the bucket exists (an unsigned request gets 403).
  for _ in $(seq 1 100); do
    if ! kill -0 "$(cat "$run/garage/pid")" 2>/dev/null; then
      echo "garage exited; its log:" >&2
      cat "$run/garage/log" >&2
      exit 1
    fi
    if grep -q "$bucket" <("$garage" -c "$run/garage/garage.toml" bucket list 2>/dev/null); then
      break
    fi
    sleep 0.2
  done
  printf 'access_key_id = %s\nsecret_access_key = %s\n' "$key_id" "$secret" > "$run/garage/credentials"
  cat > "$run/env" <<EOF
export RAGKV_TEST_S3_URL=http://127.0.0.1:$port
export RAGKV_TEST_S3_BUCKET=$bucket
export RAGKV_TEST_S3_REGION=garage
export RAGKV_TEST_S3_CREDENTIALS=$run/garage/credentials
EOF
  echo "garage on 127.0.0.1:$port (bucket $bucket); variables in $run/env"
}

# A three-node cluster: node i serves S3 on cluster_port + 10 i, RPC on the next port.
cluster_port="${RAGKV_GARAGE_CLUSTER_PORT:-39200}"
cluster_run="$run/cluster"

node_cfg() { echo "$cluster_run/node$1/garage.toml"; }

node_start() {
  RUST_LOG="${RUST_LOG_GARAGE:-warn}" "$garage" -c "$(node_cfg "$1")" server \
    >> "$cluster_run/node$1/log" 2>&1 &
  echo $! > "$cluster_run/node$1/pid"
}

node_kill() {
  if [ -f "$cluster_run/node$1/pid" ]; then
    kill -9 "$(cat "$cluster_run/node$1/pid")" 2>/dev/null || true
    rm -f "$cluster_run/node$1/pid"
  fi
}

cluster_stop() {
  for i in 0 1 2; do node_kill "$i"; done
}

# Runs a garage admin command against node 0 until it succeeds (the nodes take a moment to
# open their RPC ports and to see each other).
admin() {
  for _ in $(seq 1 100); do
    if "$garage" -c "$(node_cfg 0)" "$@" > "$cluster_run/admin.out" 2>&1; then
      return 0
    fi
    sleep 0.2
  done
  echo "garage $*: $(cat "$cluster_run/admin.out")" >&2
  exit 1
}

cluster_start() {
  if [ ! -x "$garage" ]; then
    echo "garage is not installed: scripts/test-servers.sh install" >&2
    exit 1
  fi
  cluster_stop
  rm -rf "$cluster_run"
  mkdir -p "$cluster_run"
  chmod 700 "$cluster_run"
  local secret_rpc ids=() i p id
  secret_rpc="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  for i in 0 1 2; do
    p=$((cluster_port + 10 * i))
    mkdir -p "$cluster_run/node$i"
    cat > "$(node_cfg "$i")" <<EOF
metadata_dir = "$cluster_run/node$i/meta"
data_dir = "$cluster_run/node$i/data"
db_engine = "sqlite"
replication_factor = 3
rpc_bind_addr = "127.0.0.1:$((p + 1))"
rpc_public_addr = "127.0.0.1:$((p + 1))"
rpc_secret = "$secret_rpc"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$p"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$((p + 2))"
EOF
    chmod 600 "$(node_cfg "$i")"
    node_start "$i"
  done
  for i in 0 1 2; do
    id=""
    for _ in $(seq 1 100); do
      id="$("$garage" -c "$(node_cfg "$i")" node id -q 2>/dev/null)" && break
      sleep 0.2
    done
    if [ -z "$id" ]; then
      echo "garage node $i did not start; its log:" >&2
      cat "$cluster_run/node$i/log" >&2
      exit 1
    fi
    ids+=("$id")
  done
  sleep 0.5
  for i in 0 1 2; do
    if ! kill -0 "$(cat "$cluster_run/node$i/pid")" 2>/dev/null; then
      echo "garage node $i exited (ports $((cluster_port + 10 * i))-$((cluster_port + 10 * i + 2)) taken?); its log:" >&2
      tail -20 "$cluster_run/node$i/log" >&2
      exit 1
    fi
  done
  admin node connect "${ids[1]}"
  admin node connect "${ids[2]}"
  # One zone per node, so that each node keeps a copy of everything.
  for i in 0 1 2; do admin layout assign -z "dc$i" -c 1G "${ids[$i]%%@*}"; done
  admin layout apply --version 1
  admin key import --yes -n "$bucket" "$key_id" "$secret"
  admin bucket create "$bucket"
  admin bucket allow --read --write --owner "$bucket" --key "$key_id"
  printf 'access_key_id = %s\nsecret_access_key = %s\n' "$key_id" "$secret" > "$cluster_run/credentials"
  cat > "$cluster_run/env" <<EOF
export RAGKV_TEST_GARAGE_CLUSTER_URLS=http://127.0.0.1:$cluster_port,http://127.0.0.1:$((cluster_port + 10)),http://127.0.0.1:$((cluster_port + 20))
export RAGKV_TEST_GARAGE_CLUSTER_BUCKET=$bucket
export RAGKV_TEST_GARAGE_CLUSTER_CREDENTIALS=$cluster_run/credentials
export RAGKV_TEST_GARAGE_CLUSTER_SCRIPT=$PWD/scripts/test-servers.sh
EOF
  echo "garage cluster of 3 nodes on 127.0.0.1:$cluster_port/$((cluster_port + 10))/$((cluster_port + 20)) (bucket $bucket); variables in $cluster_run/env"
}

case "${1:-start}" in
  install) install ;;
  installed) [ -x "$garage" ] ;;
  start) start ;;
  stop) stop ;;
  cluster-start) cluster_start ;;
  cluster-stop) cluster_stop ;;
  cluster-kill) node_kill "${2:?node number}" ;;
  cluster-revive) node_start "${2:?node number}" ;;
  *)
    echo "usage: $0 install|installed|start|stop|cluster-start|cluster-stop|cluster-kill N|cluster-revive N" >&2
    exit 2
    ;;
esac
