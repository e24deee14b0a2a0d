#!/usr/bin/env bash
# Scale-out without spare cores: 1, 2 and 4 outbox-rs relay processes on
# one PostgreSQL, each capped to a fifth of a core (cgroup v1 cpu,
# cpu.cfs_quota_us; as root), draining 50k messages: msg/s, each relay's
# share, the cores busy and the database's CPU per message, so that claim
# contention shows apart from the relays' CPU (docs/performance.md,
# "Capped relays").
#
#   scripts/compare-graphile/capped.sh
#
# DATABASE_URL, ROUNDS (2), DRAIN_N (50000), CAP (0.2 of a core), PROCS
# (1,2,4), KEEP_PROCESSED (true). Exits 2 saying why when it cannot cap
# (not root, no cgroup v1 cpu controller).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
node compare.mjs capped
