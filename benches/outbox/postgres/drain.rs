//! Drain figures: relays against a bare loop of the store's own statements, and drain beside a writer while a REPEATABLE READ transaction pins the xmin.

use super::*;

/// `relays` relays, each on its own store, drain a backlog of `n`; msg/s.
/// With `keep_processed` false their stores delete what they complete.
async fn drain_relays(relays: usize, batch: usize, n: usize, keep_processed: bool) -> f64 {
    let f = fixture(|b| b).await;
    fill(&f, n).await;
    let count = Arc::new(AtomicU64::new(0));
    let mut built = Vec::new();
    for i in 0..relays {
        let store = relay_store_with(&f, f.url(), 4, |b| b.keep_processed(keep_processed)).await;
        built.push(
            Relay::builder(store)
                .dispatcher(counting_handlers(count.clone()))
                .worker_id(format!("bench-relay-{i}"))
                .batch_size(batch)
                .build()
                .unwrap(),
        );
    }
    let start = Instant::now();
    let reports = futures_util::future::join_all(built.iter().map(|r| r.drain())).await;
    let secs = start.elapsed().as_secs_f64();
    let delivered: u64 = reports.into_iter().map(|r| r.unwrap().delivered).sum();
    assert_eq!(delivered as usize, n);
    n as f64 / secs
}

/// `workers` bare loops, each on a connection of its own, running the
/// store's own statements in the relay's transactions: each completes the
/// previous batch (one statement, its own transaction), then claims the
/// next in a claim transaction. The claim
/// binds a floor as the relay's store does (src/floor.rs): here, with no
/// writer and no retry, simply the lowest `seq` any loop still holds (retry
/// generation 0: the `_retries` sequence never moves in the bench). Walking
/// from the start instead, each claim would step over every message
/// completed so far.
async fn drain_bare(workers: usize, batch: usize, n: usize) -> f64 {
    let f = fixture(|b| b).await;
    fill(&f, n).await;
    let store = f.pg().clone();
    let pool: PgPool = f.pool().clone();
    // The lowest `seq` each loop holds (0 until it has claimed).
    let lows: Arc<Vec<AtomicI64>> = Arc::new((0..workers).map(|_| AtomicI64::new(0)).collect());
    let start = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let (store, pool, lows) = (store.clone(), pool.clone(), lows.clone());
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                let worker = format!("bare-{w}");
                let mut previous: Vec<uuid_of::Uuid> = Vec::new();
                let mut done = 0;
                loop {
                    let now = Timestamp::now().as_millis();
                    if !previous.is_empty() {
                        sqlx::query(AssertSqlSafe(store.complete_statement()))
                            .bind(now)
                            .bind(&previous)
                            .execute(&mut *conn)
                            .await
                            .unwrap();
                    }
                    sqlx::raw_sql(AssertSqlSafe(store.begin_claim_statement()))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                    let rows = sqlx::query(AssertSqlSafe(store.claim_statement()))
                        .bind(&worker)
                        .bind(now + 60_000)
                        .bind(now)
                        .bind(None::<String>)
                        .bind(batch as i64)
                        .bind(
                            lows.iter()
                                .map(|l| l.load(Ordering::Acquire))
                                .min()
                                .unwrap_or(0),
                        )
                        .bind(0_i64)
                        .fetch_all(&mut *conn)
                        .await
                        .unwrap();
                    sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
                    done += previous.len();
                    let low = rows.iter().map(|r| r.get::<i64, _>(0)).min();
                    lows[w].store(low.unwrap_or(i64::MAX), Ordering::Release);
                    if rows.is_empty() {
                        break;
                    }
                    previous = rows.iter().map(|r| r.get(1)).collect();
                }
                done
            })
        })
        .collect();
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(done, n);
    n as f64 / secs
}

/// The least a drain of these rows can cost on this server: one loop on
/// one connection deleting the oldest `batch` messages with `DELETE …
/// RETURNING` every column, each statement its own transaction committed
/// without waiting for a flush (as the relay's bookkeeping commits), until
/// none is left; msg/s. It neither leases nor keeps anything: what a queue
/// that forgets its jobs pays.
async fn drain_delete(batch: usize, n: usize) -> f64 {
    let f = fixture(|b| b).await;
    let t = format!(r#""{}"."{}""#, f.schema(), f.pg().table());
    // Its best layout: full pages (the outbox's are half full, for the
    // leases' sake), so the fewest pages to read and dirty.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {t} SET (fillfactor = 100)"
    )))
    .execute(f.pool())
    .await
    .unwrap();
    fill(&f, n).await;
    let delete = format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE state = 'pending' \
         ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING *"
    );
    let mut conn = f.pool().acquire().await.unwrap();
    sqlx::raw_sql("SET synchronous_commit = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    let start = Instant::now();
    let mut done = 0;
    loop {
        let rows = sqlx::query(AssertSqlSafe(delete.as_str()))
            .bind(batch as i64)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        if rows.is_empty() {
            break;
        }
        done += rows.len();
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(done, n);
    n as f64 / secs
}

/// The uuid type sqlx binds (the same crate `MessageId` wraps).
mod uuid_of {
    pub type Uuid = outbox_postgres::sqlx::types::Uuid;
}

pub(super) async fn drains(quick: bool) -> Vec<Figure> {
    let mut out = Vec::new();
    let n = if quick { 2_000 } else { 100_000 };
    let batches: &[usize] = if quick { &[100] } else { &[20, 100, 500] };
    for relays in [1usize, 2, 4] {
        for &batch in batches {
            let bare = drain_bare(relays, batch, n).await;
            let relay = drain_relays(relays, batch, n, true).await;
            let target = if batch == 500 {
                "≥ 0.6 × bare and ≥ 30k msg/s"
            } else {
                "≥ 0.6 × bare"
            };
            let name = format!(
                "drain {n} to an in-process handler, PostgreSQL, {relays} relay(s), batch {batch}"
            );
            out.push(Figure::new(name.clone(), relay, "msg/s", target).beside(
                format!(
                    "{relays} bare SQL loop(s), same claim + complete statements and transactions"
                ),
                bare,
            ));
            if relays == 1 && batch == *batches.last().unwrap() {
                // The same relay figure against the cheapest drain there is.
                let delete = drain_delete(batch, n).await;
                let forgetting = drain_relays(relays, batch, n, false).await;
                for (what, value) in [(", keep_processed(false)", forgetting), ("", relay)] {
                    out.push(
                        Figure::new(
                            format!("{name}{what}, against DELETE … RETURNING"),
                            value,
                            "msg/s",
                            "≥ 0.5 × DELETE … RETURNING",
                        )
                        .beside(
                            format!("one loop of DELETE … RETURNING {batch} (no lease, no flush)"),
                            delete,
                        ),
                    );
                }
            }
        }
    }
    out
}

/// One phase of the pinned-xmin figure: for `period`, a writer enqueues
/// batches of 100 as fast as it can while a relay (batch 100) drains;
/// with `pinned`, a REPEATABLE READ transaction that has taken its
/// snapshot stays open throughout, so no row deleted or updated in the
/// phase can be vacuumed. Returns (delivered msg/s, enqueued msg/s).
/// What one phase of the pinned-xmin figure measured.
struct PinnedPhase {
    /// Messages the relay delivered per second during the phase.
    delivered: f64,
    /// Messages the writer enqueued per second.
    enqueued: f64,
    /// Shared buffers one claim touched at the end of the phase, walking
    /// from the relay's floor and from the start of the index.
    claim_buffers: (u64, u64),
}

/// The writer's pace: batches of 100 every 10 ms, 10k msg/s — what one
/// relay keeps up with on these 2 cores beside the writer, so that a claim
/// that slows down shows as a backlog and a lower delivery rate.
const PINNED_PACE: Duration = Duration::from_millis(10);

async fn pinned_phase(pinned: bool, period: Duration) -> PinnedPhase {
    let f = fixture(|b| b).await;
    let mut holder = None;
    if pinned {
        let mut conn = f.pool().acquire().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM "{}".orders"#,
            f.schema()
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        holder = Some(conn);
    }
    let count = Arc::new(AtomicU64::new(0));
    let relay = Relay::builder(f.pg().clone())
        .dispatcher(counting_handlers(count.clone()))
        .batch_size(100)
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (pool, outbox, s) = (f.pool().clone(), f.pg().outbox(), stop.clone());
    let writer = tokio::spawn(async move {
        let mut n = 0usize;
        let mut pace = tokio::time::interval(PINNED_PACE);
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !s.load(Ordering::Acquire) {
            pace.tick().await;
            let mut tx = pool.begin().await.unwrap();
            outbox
                .enqueue_many(&mut tx, (n..n + 100).map(bench_message).collect())
                .await
                .unwrap();
            tx.commit().await.unwrap();
            n += 100;
        }
        n
    });
    let start = Instant::now();
    let before = count.load(Ordering::Relaxed);
    tokio::time::sleep(period).await;
    let delivered = count.load(Ordering::Relaxed) - before;
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    let enqueued = writer.await.unwrap();
    relay.shutdown().await;
    let claim_buffers = (
        f.claim_buffers(f.pg().claim_floor(), 100).await.0,
        f.claim_buffers((0, -1), 100).await.0,
    );
    if let Some(mut conn) = holder {
        sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
    }
    PinnedPhase {
        delivered: delivered as f64 / secs,
        enqueued: enqueued as f64 / secs,
        claim_buffers,
    }
}

pub(super) async fn pinned_xmin(quick: bool) -> Vec<Figure> {
    // The issue asks for at least 2 minutes with the xmin pinned.
    let period = Duration::from_secs(if quick { 1 } else { 120 });
    let free = pinned_phase(false, period).await;
    let pinned = pinned_phase(true, period).await;
    vec![
        Figure::new(
            format!(
                "drain beside a writer at 10k msg/s, PostgreSQL, batch 100, a REPEATABLE READ transaction open throughout ({} s)",
                period.as_secs()
            ),
            pinned.delivered,
            "msg/s",
            "≥ 0.9 × without",
        )
        .beside("the same without it", free.delivered),
        Figure::new(
            "… the writer's enqueue rate (enqueue_many of 100 every 10 ms), pinned",
            pinned.enqueued,
            "msg/s",
            "—",
        )
        .beside("without", free.enqueued),
        Figure::new(
            "… one claim at the end of the pinned phase, walking from the relay's floor",
            pinned.claim_buffers.0 as f64,
            "buffers",
            "far below the walk from the start",
        )
        .beside(
            "the same claim walking from the start of the index",
            pinned.claim_buffers.1 as f64,
        ),
    ]
}

/// `pg_stat_wal.wal_sync`: how many times the server has flushed WAL to
/// disk, in all.
async fn wal_syncs(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One relay (batch 100) drains `n` messages on a store with
/// `durable_bookkeeping` as given; WAL flushes per delivered message,
/// counted by `pg_stat_wal` over the drain. The server counts a backend's
/// flushes when it reports its statistics (at most once a second, and when
/// it exits), so the relay's connections are closed, and gone from
/// `pg_stat_activity`, before the second reading.
async fn wal_flushes_per_message(durable: bool, n: usize) -> f64 {
    let f = fixture(|b| b).await;
    fill(&f, n).await;
    // The relay's connections carry a name of their own.
    let name = format!("{}_relay", f.schema());
    let separator = if f.url().contains('?') { '&' } else { '?' };
    let store = PgStore::builder(format!("{}{separator}application_name={name}", f.url()))
        .schema(f.schema())
        .table(f.pg().table())
        .inbox_table(f.pg().inbox_table())
        .max_connections(4)
        .durable_bookkeeping(durable)
        .connect()
        .await
        .unwrap();
    let count = Arc::new(AtomicU64::new(0));
    let relay = Relay::builder(store.clone())
        .dispatcher(counting_handlers(count.clone()))
        .batch_size(100)
        .build()
        .unwrap();
    let before = wal_syncs(f.pool()).await;
    let report = relay.drain().await.unwrap();
    assert_eq!(report.delivered as usize, n);
    drop(relay);
    store.pool().close().await;
    drop(store);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let open: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(&name)
                .fetch_one(f.pool())
                .await
                .unwrap();
        if open == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = wal_syncs(f.pool()).await;
    (after - before) as f64 / n as f64
}

/// WAL flushes per delivered message while a relay drains, beside the same
/// drain with `durable_bookkeeping(true)` (every claim and completion
/// commit waiting for the disk, as before this release).
pub(super) async fn wal_flushes(quick: bool) -> Vec<Figure> {
    let n = if quick { 2_000 } else { 20_000 };
    let durable = wal_flushes_per_message(true, n).await;
    let relaxed = wal_flushes_per_message(false, n).await;
    vec![
        Figure::new(
            format!("WAL flushes per delivered message, PostgreSQL, 1 relay draining {n}, batch 100 (pg_stat_wal.wal_sync)"),
            relaxed,
            "flushes/msg",
            "≤ 0.05",
        )
        .beside("the same drain with durable_bookkeeping(true)", durable),
    ]
}
