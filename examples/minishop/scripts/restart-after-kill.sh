#!/usr/bin/env bash
# MiniShop killed with SIGKILL mid-run (3000 orders), restarted on the same
# data dir: seconds from the restart until both outboxes have nothing
# pending. Build first: cargo build --release -p minishop -p outbox-cli
set -u
command -v bc >/dev/null || { echo "needs bc (apt-get install bc)"; exit 2; }
BIN=${BIN:-target/release}
D=$(mktemp -d)
$BIN/minishop --orders 3000 --data-dir $D >/dev/null 2>&1 &
P=$!
sleep ${KILL_AFTER:-1.5}
kill -9 $P; wait $P 2>/dev/null
pend() { $BIN/outbox --database sqlite:$D/$1.db --table $1_outbox --json stats 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["pending"])' 2>/dev/null || echo "?"; }
echo "after kill: ordering pending $(pend ordering), warehouse pending $(pend warehouse)"
$BIN/minishop --listen 127.0.0.1:0 --data-dir $D >/dev/null 2>&1 &
R=$!
start=$(date +%s.%N)
while true; do
  o=$(pend ordering); w=$(pend warehouse)
  if [ "$o" = "0" ] && [ "$w" = "0" ]; then break; fi
  now=$(date +%s.%N)
  if (( $(echo "$now - $start > 120" | bc) )); then echo "timeout: $o $w"; break; fi
  sleep 0.05
done
end=$(date +%s.%N)
echo "settled $(echo "$end - $start" | bc) s after the restart"
kill -INT $R; wait $R 2>/dev/null
rm -rf $D
