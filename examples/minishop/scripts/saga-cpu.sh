#!/usr/bin/env bash
# Where MiniShop's CPU goes with RabbitMQ: one run of N orders at RATE
# orders/s, then the two cores' busy share over the run and the CPU time
# per order of the MiniShop process, the RabbitMQ broker (beam.smp) and the
# rest (PostgreSQL's backends on PostgreSQL, and anything else on the
# machine). docs/latency.md reads the result.
#
# Build first: cargo build --release -p minishop
# Environment: BIN (default target/release/minishop), ORDERS (3000), RATE
# (300), STORE (postgres, or sqlite: a file per module in a fresh
# directory), PG, AMQP (as saga-figures.sh).
set -u
. "$(dirname "$0")/common.sh"
ORDERS=${ORDERS:-3000}
RATE=${RATE:-300}
STORE=${STORE:-postgres}
case "$STORE" in
  postgres) store_args=(--postgres "$PG") ;;
  sqlite) store_args=() ;;
  *) echo "STORE must be postgres or sqlite, not \`$STORE\`"; exit 2 ;;
esac
beam=$(pgrep -f beam.smp | head -1)
[ -n "$beam" ] || { echo "no RabbitMQ broker (beam.smp) running: rabbitmq-server -detached"; exit 2; }
tick=$(getconf CLK_TCK)
beam_ticks() { awk '{print $14 + $15}' "/proc/$beam/stat"; }
busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
data=$(mktemp -d)
times=$(mktemp)
b0=$(beam_ticks); t0=$(busy_ticks); s0=$(date +%s.%N)
out=$(/usr/bin/time -f "%U %S" -o "$times" "$BIN" "${store_args[@]}" --amqp "$AMQP" --isolated \
  --data-dir "$data" --orders "$ORDERS" --rate "$RATE" --timeout 300s 2>&1)
status=$?
b1=$(beam_ticks); t1=$(busy_ticks); s1=$(date +%s.%N)
rm -rf "$data"
if [ $status -ne 0 ]; then echo "FAILED (exit $status)"; echo "$out" | tail -5; exit 1; fi
read -r user sys < "$times"; rm -f "$times"
echo "$out" | grep -E "elapsed|latency p(50|99)"
python3 - "$s0" "$s1" "$t0" "$t1" "$b0" "$b1" "$tick" "$user" "$sys" "$ORDERS" "$STORE" <<'PY'
import sys
s0, s1, t0, t1, b0, b1, tick, user, sys_, n = map(float, sys.argv[1:11])
rest_name = "PostgreSQL and the rest" if sys.argv[11] == "postgres" else "the rest"
wall, busy, beam, shop = s1 - s0, (t1 - t0) / tick, (b1 - b0) / tick, user + sys_
rest = busy - beam - shop
per = lambda s: s / n * 1000
print(f"cores busy {busy / wall / 2 * 100:.0f} % of 2 over {wall:.1f} s; CPU per order: "
      f"{per(busy):.2f} ms = MiniShop {per(shop):.2f} + RabbitMQ {per(beam):.2f} "
      f"+ {rest_name} {per(rest):.2f}")
PY
