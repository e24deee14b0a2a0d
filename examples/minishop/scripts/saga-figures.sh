#!/usr/bin/env bash
# MiniShop's saga figures, as issue 19 asks for them: for each store and bus
# (SQLite / PostgreSQL, embedded bus / RabbitMQ) and each offered rate, one
# run of N orders; prints the sustained rate, the saga's latency (order
# commit -> OrderConfirmed handled, p50 / p99) and, on PostgreSQL, the WAL
# flushes per order (pg_stat_wal.wal_sync over the run, read before and
# after with the shop's connections closed).
#
# Build first: cargo build --release -p minishop
# Environment: BIN (the minishop binary, default target/release/minishop),
# ORDERS (default 3000), PG (default postgres://postgres@127.0.0.1:5432/test),
# AMQP (default amqp://guest:guest@127.0.0.1:5672/%2f), ONLY (a substring of
# the configuration names to run, e.g. "postgres+rabbitmq").
set -u
. "$(dirname "$0")/common.sh"
ORDERS=${ORDERS:-3000}
ONLY=${ONLY:-}

wal_syncs() { psql "$PG" -Atc "select wal_sync from pg_stat_wal" 2>/dev/null; }

# run NAME RATE ARGS...: one run, one line of figures.
run() {
  local name=$1 rate=$2; shift 2
  case "$name" in *"$ONLY"*) ;; *) return ;; esac
  local data before after out
  data=$(mktemp -d)
  # A backend reports its WAL statistics at most once a second and when it
  # exits: let the earlier runs' reports land first.
  sleep 1.5
  before=$(wal_syncs)
  out=$("$BIN" "$@" --data-dir "$data" --orders "$ORDERS" --rate "$rate" --timeout 300s 2>&1)
  local status=$?
  sleep 1.5
  after=$(wal_syncs)
  rm -rf "$data"
  if [ $status -ne 0 ]; then
    echo "$name at $rate orders/s: FAILED (exit $status)"; echo "$out" | tail -5; return
  fi
  local sustained p50 p99 flushes="—"
  sustained=$(echo "$out" | sed -n 's/.*elapsed .*(\([0-9.]*\) orders\/s).*/\1/p')
  p50=$(echo "$out" | sed -n 's/.*latency p50 *\([0-9.]*\) ms.*/\1/p')
  p99=$(echo "$out" | sed -n 's/.*latency p99 *\([0-9.]*\) ms.*/\1/p')
  case "$name" in postgres*)
    [ -n "$before" ] && [ -n "$after" ] &&
      flushes=$(python3 -c "print(round(($after - $before) / $ORDERS, 2))") ;;
  esac
  printf '%-22s offered %5s orders/s: sustained %6s orders/s, p50 %8s ms, p99 %8s ms, WAL flushes/order %s\n' \
    "$name" "$rate" "$sustained" "$p50" "$p99" "$flushes"
}

for rate in 50 300 1000; do run "sqlite+embedded" "$rate"; done
for rate in 50 300 1000; do run "sqlite+rabbitmq" "$rate" --amqp "$AMQP" --isolated; done
for rate in 100 300 1000; do run "postgres+embedded" "$rate" --postgres "$PG" --isolated; done
for rate in 100 300 1000; do run "postgres+rabbitmq" "$rate" --postgres "$PG" --amqp "$AMQP" --isolated; done
