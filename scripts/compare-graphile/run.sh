#!/usr/bin/env bash
# outbox-rs beside graphile-worker (Node, from npm) on the same PostgreSQL,
# interleaved in one run: drains by one and two worker processes with the
# database's CPU per message, and commit → handler across processes at
# 500 msg/s (docs/performance.md, "Against graphile-worker").
#
#   scripts/compare-graphile/run.sh
#
# DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test), ROUNDS (3),
# DRAIN_N (50000), RATE (500), LATENCY_N (5000), COLD=1 (each drain also
# without the VACUUM ANALYZE and CHECKPOINT after the fill, labelled "cold"),
# SIDES (outbox or graphile), ONLY=latency. graphile-worker works in its
# schema `graphile_worker`, outbox-rs in `compare_outbox`, each dropped and
# made again for every figure, filled, then analysed as a table in use is.
# Needs Node.js and npm (and fetches Node 22 from the npm registry when the
# local one is older). The database's CPU is read from /proc, so the server
# must run on this machine.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
node compare.mjs run
