#!/usr/bin/env bash
# Where a MiniShop saga's time goes, stage by stage, on PostgreSQL and
# RabbitMQ: one run of N orders at RATE orders/s under a run id of its own
# (so that its schemas outlive the process), then, from the timestamps the
# run left in both modules' outboxes, inboxes and orders (milliseconds, the
# relays' and consumers' own clocks), p50 and p99 of each stage over the
# confirmed orders; then the run's schemas, queues and exchanges are
# deleted. docs/latency.md reads the result.
#
# Build first: cargo build --release -p minishop
# Environment: BIN (default target/release/minishop), ORDERS (1000), RATE
# (100), PG, AMQP (as saga-figures.sh).
set -u
. "$(dirname "$0")/common.sh"
ORDERS=${ORDERS:-1000}
RATE=${RATE:-100}
RUN=stages$(date +%s)$$

cleanup() {
  psql "$PG" -qc "DROP SCHEMA IF EXISTS ordering_run_$RUN CASCADE; DROP SCHEMA IF EXISTS warehouse_run_$RUN CASCADE" >/dev/null 2>&1
  if command -v rabbitmqctl >/dev/null; then
    for q in $(rabbitmqctl -q list_queues name 2>/dev/null | grep -- "run-$RUN"); do
      rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1
    done
    for x in $(rabbitmqctl -q list_exchanges name 2>/dev/null | grep -- "run-$RUN"); do
      rabbitmqctl -q eval "rabbit_exchange:delete(rabbit_misc:r(<<\"/\">>, exchange, <<\"$x\">>), false, <<\"cli\">>)." >/dev/null 2>&1
    done
  fi
}
trap cleanup EXIT

"$BIN" --postgres "$PG" --amqp "$AMQP" --run "$RUN" --orders "$ORDERS" --rate "$RATE" --timeout 300s 2>&1 | tail -7
sed "s/SUF/$RUN/g" <<'SQL' | psql "$PG"
with o as (select key, min(created_at) filter (where message_type='OrderPlaced') placed_at,
                  min(processed_at) filter (where message_type='OrderPlaced') placed_confirmed,
                  min(id::text) filter (where message_type='OrderPlaced') placed_id,
                  min(created_at) filter (where message_type='OrderConfirmed') oc_created,
                  min(processed_at) filter (where message_type='OrderConfirmed') oc_done
           from ordering_run_SUF.ordering_outbox group by key),
w as (select key, min(created_at) ans_created, min(processed_at) ans_confirmed, min(id::text) ans_id
      from warehouse_run_SUF.warehouse_outbox where message_type='StockReserved' group by key),
t as (select o.key,
  wi.received_at - o.placed_at as a_commit_to_wh_inbox,
  o.placed_confirmed - o.placed_at as a1_placed_confirm_recorded,
  w.ans_created - wi.received_at as b_wh_handler,
  oi.received_at - w.ans_created as c_answer_to_ord_inbox,
  w.ans_confirmed - w.ans_created as c1_answer_confirm_recorded,
  o.oc_created - oi.received_at as d_ord_handler,
  ord.confirmed_at - o.oc_created as e_confirmed_handled,
  o.oc_done - ord.confirmed_at as e1_handled_to_recorded,
  ord.confirmed_at - ord.created_at as total,
  o.placed_at - ord.created_at as z_order_created_to_enqueue
  from o join w using (key)
  join warehouse_run_SUF.warehouse_inbox wi on wi.message_id::text = o.placed_id
  join ordering_run_SUF.ordering_inbox oi on oi.message_id::text = w.ans_id
  join ordering_run_SUF.orders ord on ord.id = o.key
  where o.oc_done is not null)
select s.stage,
  percentile_cont(0.5) within group (order by s.v) p50,
  percentile_cont(0.99) within group (order by s.v) p99, count(*)
from t, lateral (values ('a commit -> warehouse inbox', a_commit_to_wh_inbox), ('  a1 OrderPlaced confirmed+recorded', a1_placed_confirm_recorded),
  ('b warehouse handler tx', b_wh_handler), ('c answer commit -> ordering inbox', c_answer_to_ord_inbox),
  ('  c1 answer confirmed+recorded', c1_answer_confirm_recorded),
  ('d ordering handler tx', d_ord_handler), ('e OrderConfirmed commit -> handled', e_confirmed_handled), ('  e1 handled -> recorded', e1_handled_to_recorded), ('total', total), ('z order created_at -> enqueue', z_order_created_to_enqueue)) s(stage, v)
group by s.stage order by s.stage;
SQL
