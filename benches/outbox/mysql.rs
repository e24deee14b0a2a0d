//! Figures on the MySQL/MariaDB backend (group `mysql`), each beside a
//! baseline from the same run: a relay's drain against a bare loop of the
//! claim's statements (a locking read with `SKIP LOCKED`, the lease
//! `UPDATE`, the completion `UPDATE`) on the same rows; an application's
//! enqueue (an order row and one message in one transaction) against the
//! same transaction inserting the outbox row by hand; and commit → handled
//! with the relay on the writer's store (woken after the commit) and on a
//! store of its own (woken by the poll across processes). Each figure
//! works on fresh tables in the test database (`OUTBOX_MYSQL_URL`, else
//! the local default), dropped afterwards.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{Handlers, Message, MessageId, Relay, Timestamp};
use outbox_api::testing::services::find;
use outbox_mysql::sqlx::{self, AssertSqlSafe, Row};
use outbox_mysql::testing::MySqlUnderTest;

use crate::common::{Figure, counting_handlers, histogram, latency_rows, not_measured};
use crate::sqlite::bench_message;

/// The figures of the group.
pub async fn figures(quick: bool) -> Vec<Figure> {
    if let Err(how) = find(&outbox_mysql::testing::MYSQL) {
        return vec![not_measured("every MySQL/MariaDB figure", &how)];
    }
    let mut out = Vec::new();
    let (n, rounds) = if quick { (2_000, 1) } else { (20_000, 3) };
    for batch in [20, 100] {
        // Alternated, and the best of each kept: the machine's noise only
        // ever slows a round down.
        let (mut relay, mut bare) = (0f64, 0f64);
        for _ in 0..rounds {
            relay = relay.max(drain_relay(batch, n).await);
            bare = bare.max(drain_bare(batch, n).await);
        }
        out.push(
            Figure::new(
                format!("MySQL drain {n}, 1 relay, batch {batch}"),
                relay,
                "msg/s",
                "≥ 0.6 × bare",
            )
            .beside("bare claim + lease + complete loop", bare),
        );
    }
    let writes = if quick { 300 } else { 3_000 };
    let (mut ours, mut bare) = (0f64, 0f64);
    for _ in 0..rounds {
        ours = ours.max(enqueue_rate(writes, true).await);
        bare = bare.max(enqueue_rate(writes, false).await);
    }
    out.push(
        Figure::new(
            "MySQL enqueue: an order row + 1 message per transaction, 1 writer",
            ours,
            "tx/s",
            "—",
        )
        .beside("the same row INSERTed by hand", bare),
    );
    let (rate, secs) = if quick { (200, 1.0) } else { (200, 10.0) };
    let count = (rate as f64 * secs) as usize;
    out.extend(latency_rows(
        &format!("MySQL commit → handled at {rate} msg/s, relay on the writer's store"),
        &latency(rate, count, false).await,
        "≤ 1 ms",
        "—",
    ));
    out.extend(latency_rows(
        &format!("MySQL commit → handled at {rate} msg/s, relay in another process"),
        &latency(rate, count, true).await,
        "≤ 10 ms (the 5 ms poll)",
        "—",
    ));
    out
}

/// Fresh tables holding `n` bench messages, enqueued in transactions of
/// 1,000.
async fn filled(n: usize) -> MySqlUnderTest {
    let f = MySqlUnderTest::fresh(None).await;
    let outbox = f.mysql().outbox();
    for start in (0..n).step_by(1000) {
        let mut tx = f.pool().begin().await.unwrap();
        outbox
            .enqueue_many(
                &mut tx,
                (start..(start + 1000).min(n)).map(bench_message).collect(),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    sqlx::query(AssertSqlSafe(format!(
        "ANALYZE TABLE `{}`",
        f.mysql().table()
    )))
    .execute(f.pool())
    .await
    .unwrap();
    f
}

/// A relay drains `n` messages with claims of `batch`; msg/s.
async fn drain_relay(batch: usize, n: usize) -> f64 {
    let f = filled(n).await;
    let count = Arc::new(AtomicU64::new(0));
    let relay = Relay::builder(f.mysql().clone())
        .dispatcher(counting_handlers(count))
        .batch_size(batch)
        .build()
        .unwrap();
    let start = Instant::now();
    let report = relay.drain().await.unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(report.delivered as usize, n, "{report:?}");
    n as f64 / secs
}

/// The bare loop on one connection at READ COMMITTED (as the store's):
/// complete the previous batch (one statement), then claim the next —
/// `START TRANSACTION`, the oldest `batch` pending rows `FOR UPDATE SKIP
/// LOCKED` with every column, their lease `UPDATE`, `COMMIT` — until none
/// is left; msg/s. It skips what the store adds: the per-key rule's
/// subqueries, decoding rows into messages, the handlers.
async fn drain_bare(batch: usize, n: usize) -> f64 {
    let f = filled(n).await;
    let t = format!("`{}`", f.mysql().table());
    let claim = format!(
        "SELECT seq, id, kind, message_type, `key`, exchange, routing_key, payload, content_type, \
         headers, trace_parent, created_at, available_at, attempts FROM {t} \
         WHERE state = 'pending' AND available_at <= ? \
           AND (locked_until IS NULL OR locked_until <= ?) \
         ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
    );
    let in_list = |n: usize| vec!["?"; n].join(", ");
    let mut conn = f.pool().acquire().await.unwrap();
    sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *conn)
        .await
        .unwrap();
    let start = Instant::now();
    let mut previous: Vec<i64> = Vec::new();
    let mut done = 0;
    loop {
        let now = Timestamp::now().as_millis();
        if !previous.is_empty() {
            let sql = format!(
                "UPDATE {t} SET state = 'processed', processed_at = ?, locked_by = NULL, \
                 locked_until = NULL WHERE state = 'pending' AND seq IN ({})",
                in_list(previous.len())
            );
            let mut q = sqlx::query(AssertSqlSafe(sql)).bind(now);
            for seq in &previous {
                q = q.bind(*seq);
            }
            q.execute(&mut *conn).await.unwrap();
            done += previous.len();
        }
        sqlx::raw_sql("START TRANSACTION")
            .execute(&mut *conn)
            .await
            .unwrap();
        let rows = sqlx::query(AssertSqlSafe(claim.as_str()))
            .bind(now)
            .bind(now)
            .bind(batch as i64)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        previous = rows.iter().map(|r| r.get::<i64, _>(0)).collect();
        if !previous.is_empty() {
            let sql = format!(
                "UPDATE {t} SET locked_by = ?, locked_until = ? WHERE seq IN ({})",
                in_list(previous.len())
            );
            let mut q = sqlx::query(AssertSqlSafe(sql))
                .bind("bare")
                .bind(now + 60_000);
            for seq in &previous {
                q = q.bind(*seq);
            }
            q.execute(&mut *conn).await.unwrap();
        }
        sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
        if previous.is_empty() {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(done, n);
    n as f64 / secs
}

/// `count` business transactions, one after another on one connection:
/// an order row and one message, through the outbox (`through_outbox`) or
/// with the outbox row INSERTed by hand (the same columns, no validation,
/// no commit watch); transactions per second.
async fn enqueue_rate(count: usize, through_outbox: bool) -> f64 {
    let f = MySqlUnderTest::fresh(None).await;
    let orders = format!("`{}_orders`", f.prefix());
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {orders} (id BIGINT PRIMARY KEY, customer VARCHAR(64) NOT NULL, \
         total BIGINT NOT NULL) ENGINE = InnoDB"
    )))
    .execute(f.pool())
    .await
    .unwrap();
    let insert_order = format!("INSERT INTO {orders} (id, customer, total) VALUES (?, ?, ?)");
    // Every column the store writes, with the values it would write.
    let insert_row = format!(
        "INSERT INTO `{}` (id, kind, message_type, `key`, exchange, routing_key, payload, \
         content_type, headers, trace_parent, created_at, available_at) \
         VALUES (?, 'domain', 'Bench', NULL, NULL, NULL, ?, 'application/octet-stream', NULL, \
         NULL, ?, ?)",
        f.mysql().table()
    );
    let outbox = f.mysql().outbox();
    let mut conn = f.pool().acquire().await.unwrap();
    let start = Instant::now();
    for i in 0..count {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        sqlx::query(AssertSqlSafe(insert_order.as_str()))
            .bind(i as i64)
            .bind("customer")
            .bind(100_i64)
            .execute(&mut *tx)
            .await
            .unwrap();
        if through_outbox {
            outbox.enqueue(&mut tx, bench_message(i)).await.unwrap();
        } else {
            let now = Timestamp::now().as_millis();
            sqlx::query(AssertSqlSafe(insert_row.as_str()))
                .bind(MessageId::new().as_uuid())
                .bind(i.to_le_bytes().to_vec())
                .bind(now)
                .bind(now)
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    count as f64 / start.elapsed().as_secs_f64()
}

/// Commit → handled (µs) of `count` messages, one per transaction, at
/// `rate` msg/s; the relay on the writer's store, or (`other_process`) on
/// a store of its own whose pool and signals are not the writer's.
async fn latency(rate: u64, count: usize, other_process: bool) -> hdrhistogram::Histogram<u64> {
    let f = MySqlUnderTest::fresh(None).await;
    let handled: Arc<Mutex<HashMap<MessageId, Instant>>> = Default::default();
    let seen = handled.clone();
    let handlers = Handlers::new().on_message("Bench", move |m: &Message| {
        seen.lock().unwrap().insert(m.id, Instant::now());
        async { Ok::<_, std::io::Error>(()) }
    });
    let store = if other_process {
        f.second_store(4).await
    } else {
        f.mysql().clone()
    };
    let relay = Relay::builder(store)
        .dispatcher(handlers)
        .batch_size(100)
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let outbox = f.mysql().outbox();
    let mut conn = f.pool().acquire().await.unwrap();
    let gap = Duration::from_secs_f64(1.0 / rate as f64);
    let mut next = Instant::now();
    let mut commits = Vec::with_capacity(count);
    for i in 0..count {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        let id = outbox.enqueue(&mut tx, bench_message(i)).await.unwrap();
        let at = Instant::now();
        tx.commit().await.unwrap();
        commits.push((id, at));
        next += gap;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while handled.lock().unwrap().len() < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    relay.shutdown().await;
    let handled = handled.lock().unwrap();
    let mut hist = histogram();
    for (id, at) in commits {
        if let Some(h) = handled.get(&id) {
            hist.record(h.saturating_duration_since(at).as_micros() as u64)
                .unwrap();
        }
    }
    assert_eq!(hist.len() as usize, count, "every message handled");
    hist
}
