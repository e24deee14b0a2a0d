//! Figures on the SQLite backend: enqueue overhead (sqlx and rusqlite),
//! drain throughput beside a bare rusqlite loop running the same SQL,
//! latency at 80 % of what the relay sustains beside a writer, and peak RSS while draining a large
//! backlog. The latency figures at a fixed rate are in `sqlite_latency`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{Handlers, Message, MessageKind, NewMessage, Relay, Timestamp};
use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite::{self, TransactionBehavior, params};
use outbox_sqlite::sqlx::{self, sqlite::SqliteConnectOptions, sqlite::SqlitePoolOptions};

use crate::common::{
    Figure, counting_handlers, drain_rate, histogram, latency_rows, metrics_figure,
};

pub async fn open(dir: &Path) -> SqliteStore {
    let store = SqliteStore::connect(dir.join("bench.db")).await.unwrap();
    store.migrate().await.unwrap();
    store
}

/// The application's own connection, configured as a production app would.
pub fn app_connection(path: &Path) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;
         CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, total INTEGER NOT NULL);",
    )
    .unwrap();
    conn
}

pub fn bench_message(i: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Bench", i.to_le_bytes().to_vec())
}

/// Enqueues `n` messages made by `make`, in transactions of 10 000.
pub fn fill_with(store: &SqliteStore, n: usize, make: impl Fn(usize) -> NewMessage) {
    let mut conn = app_connection(store.path());
    let outbox = store.outbox();
    for start in (0..n).step_by(10_000) {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        for i in start..(start + 10_000).min(n) {
            outbox.enqueue_rusqlite(&tx, make(i)).unwrap();
        }
        tx.commit().unwrap();
    }
}

/// Enqueues `n` bench messages.
pub fn fill(store: &SqliteStore, n: usize) {
    fill_with(store, n, bench_message);
}

/// The application's business transaction: one order row and, with
/// `enqueue`, the `n`-th bench message, committed on `conn`.
fn business_tx(
    conn: &mut rusqlite::Connection,
    outbox: &outbox_sqlite::SqliteOutbox,
    n: usize,
    enqueue: bool,
) {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    tx.execute(
        "INSERT INTO orders (customer, total) VALUES ('alice', 4200)",
        [],
    )
    .unwrap();
    if enqueue {
        outbox.enqueue_rusqlite(&tx, bench_message(n)).unwrap();
    }
    tx.commit().unwrap();
}

/// Business transaction (one order row) with and without one enqueue, via
/// rusqlite, alternating blocks so that both see the same machine.
fn enqueue_overhead_rusqlite(store: &SqliteStore, iterations: usize) -> (f64, f64) {
    let mut conn = app_connection(store.path());
    let outbox = store.outbox();
    let (mut plain, mut with) = (Duration::ZERO, Duration::ZERO);
    let block = 100;
    let mut n = 0;
    for round in 0..iterations / block {
        for enqueue in [round % 2 == 0, round % 2 != 0] {
            let start = Instant::now();
            for _ in 0..block {
                n += 1;
                business_tx(&mut conn, &outbox, n, enqueue);
            }
            *(if enqueue { &mut with } else { &mut plain }) += start.elapsed();
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / (iterations / 2) as f64;
    (per(with), per(plain))
}

/// The application's sqlx pool, configured as a production app would
/// (WAL, `synchronous = NORMAL`); one connection.
pub async fn sqlx_pool(path: &Path) -> sqlx::SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal),
        )
        .await
        .unwrap()
}

/// The same through sqlx.
async fn enqueue_overhead_sqlx(store: &SqliteStore, iterations: usize) -> (f64, f64) {
    drop(app_connection(store.path()));
    let pool = sqlx_pool(store.path()).await;
    let outbox = store.outbox();
    let (mut plain, mut with) = (Duration::ZERO, Duration::ZERO);
    let block = 100;
    let mut id = 1_000_000_000i64;
    for round in 0..iterations / block {
        for enqueue in [round % 2 == 0, round % 2 != 0] {
            let start = Instant::now();
            for _ in 0..block {
                id += 1;
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                sqlx::query("INSERT INTO orders (id, customer, total) VALUES (?, 'alice', 4200)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                if enqueue {
                    outbox
                        .enqueue(&mut *tx, bench_message(id as usize))
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
            *(if enqueue { &mut with } else { &mut plain }) += start.elapsed();
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / (iterations / 2) as f64;
    (per(with), per(plain))
}

async fn drain(n: usize, batch: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    fill(&store, n);
    let relay = Relay::builder(store)
        .dispatcher(counting_handlers(Arc::new(AtomicU64::new(0))))
        .batch_size(batch);
    drain_rate(relay, n).await
}

/// A bare rusqlite loop running the store's own claim and complete SQL, in
/// the relay's transactions: each one completes the previous batch and
/// claims the next.
async fn drain_bare(n: usize, batch: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    fill(&store, n);
    let (claim, complete) = (
        store.claim_statement(batch),
        store.complete_statement().to_owned(),
    );
    let path = store.path().to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn = app_connection(&path);
        let start = Instant::now();
        let mut done = 0;
        let mut previous: Vec<String> = Vec::new();
        loop {
            let now = Timestamp::now().as_millis();
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .unwrap();
            {
                let mut stmt = tx.prepare_cached(&complete).unwrap();
                for id in &previous {
                    stmt.execute(params![now, id]).unwrap();
                }
            }
            let ids: Vec<String> = tx
                .prepare_cached(&claim)
                .unwrap()
                .query_map(params!["bare", now + 60_000, now, None::<String>], |r| {
                    r.get::<_, String>(1)
                })
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            tx.commit().unwrap();
            done += previous.len();
            if ids.is_empty() {
                break;
            }
            previous = ids;
        }
        assert_eq!(done, n);
        n as f64 / start.elapsed().as_secs_f64()
    })
    .await
    .unwrap()
}

/// Commit → handled while a writer thread offers `rate` msg/s (in
/// transactions every millisecond) for `duration`.
async fn latency_loaded(
    rate: f64,
    duration: Duration,
    batch: usize,
) -> (hdrhistogram::Histogram<u64>, f64) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    let total = (rate * duration.as_secs_f64()) as usize;
    let base = Instant::now();
    let committed: Arc<Vec<AtomicU64>> = Arc::new((0..total).map(|_| AtomicU64::new(0)).collect());
    let hist = Arc::new(Mutex::new(histogram()));
    let handled = Arc::new(AtomicU64::new(0));
    let (c, h, n) = (committed.clone(), hist.clone(), handled.clone());
    let handlers = Handlers::new().on_message("Bench", move |m: &Message| {
        let i = usize::from_le_bytes(m.payload[..8].try_into().unwrap());
        let at = c[i].load(Ordering::Acquire);
        let now = base.elapsed().as_micros() as u64;
        h.lock().unwrap().record(now.saturating_sub(at)).unwrap();
        n.fetch_add(1, Ordering::Relaxed);
        async { Ok::<_, std::io::Error>(()) }
    });
    let relay = Relay::builder(store.clone())
        .dispatcher(handlers)
        .batch_size(batch)
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let path: PathBuf = store.path().to_owned();
    let outbox = store.outbox();
    let per_tick = ((rate / 1000.0).ceil() as usize).max(1);
    let writer = std::thread::spawn(move || {
        let mut conn = app_connection(&path);
        let mut i = 0;
        let mut next = Instant::now();
        while i < total {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .unwrap();
            let end = (i + per_tick).min(total);
            for j in i..end {
                outbox.enqueue_rusqlite(&tx, bench_message(j)).unwrap();
            }
            // Stamped before COMMIT: conservative (includes the commit itself).
            let at = base.elapsed().as_micros() as u64;
            for j in i..end {
                committed[j].store(at, Ordering::Release);
            }
            tx.commit().unwrap();
            i = end;
            next += Duration::from_millis(1);
            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
    });
    let started = Instant::now();
    tokio::task::spawn_blocking(move || writer.join().unwrap())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while handled.load(Ordering::Relaxed) < total as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let achieved = handled.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    let hist = hist.lock().unwrap().clone();
    (hist, achieved)
}

pub fn rss_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Child mode: fill `n`, reset the peak-RSS mark, drain with the relay, and
/// print `rss_before_kb peak_kb seconds`.
pub fn rss_child(n: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        fill(&store, n);
        let relay = Relay::builder(store.clone())
            .dispatcher(counting_handlers(Arc::new(AtomicU64::new(0))))
            .batch_size(500)
            .build()
            .unwrap();
        // Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let before = rss_kb("VmRSS:");
        let start = Instant::now();
        let report = relay.drain().await.unwrap();
        assert_eq!(report.delivered as usize, n);
        println!(
            "{before} {} {:.3}",
            rss_kb("VmHWM:"),
            start.elapsed().as_secs_f64()
        );
    });
}

fn rss_figure(n: usize) -> Figure {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("OUTBOX_BENCH_RSS_CHILD", n.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<f64> = text
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    if !out.status.success() || fields.len() != 3 {
        return crate::common::not_measured(
            &format!("peak RSS draining {n} pending"),
            &format!(
                "child failed: {}",
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            ),
        );
    }
    Figure::new(
        format!(
            "peak RSS while draining {n} pending, SQLite, batch 500 ({:.1} s)",
            fields[2]
        ),
        fields[1] / 1024.0,
        "MB",
        "flat; < 100 MB",
    )
    .beside(
        "RSS of the same process just before the drain",
        fields[0] / 1024.0,
    )
}

/// The drain figures (group `sqlite-drain`) and the relay's drain rate at
/// batch 100, the capacity the loaded-latency figure is taken of.
pub async fn drain_figures(quick: bool) -> (Vec<Figure>, f64) {
    let mut out = Vec::new();
    let n = if quick { 10_000 } else { 100_000 };
    let mut capacity: f64 = 0.0;
    for batch in [20, 100, 500] {
        let bare = drain_bare(n, batch).await;
        let relay = drain(n, batch).await;
        if batch == 100 {
            capacity = relay;
        }
        out.push(
            Figure::new(
                format!("drain {n} to an in-process handler, SQLite, batch {batch}"),
                relay,
                "msg/s",
                "≥ 0.8 × bare",
            )
            .beside(
                "bare rusqlite loop, same claim + complete SQL and transactions",
                bare,
            ),
        );
    }
    (out, capacity)
}

/// Drain throughput with a Prometheus recorder installed beside the same
/// drain without one (group `sqlite-metrics`): the cost of metrics on the
/// drain as an application with a database sees it.
pub async fn metrics_figures(quick: bool) -> Vec<Figure> {
    let (n, rounds) = if quick { (10_000, 1) } else { (100_000, 5) };
    vec![metrics_figure("SQLite", n, rounds, move || drain(n, 100)).await]
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    let mut out = Vec::new();
    let iterations = if quick { 1_000 } else { 10_000 };
    {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let path = store.path().to_owned();
        let s = store.clone();
        let (with, plain) =
            tokio::task::spawn_blocking(move || enqueue_overhead_rusqlite(&s, iterations))
                .await
                .unwrap();
        out.push(
            Figure::new(
                "business tx + one enqueue, rusqlite",
                with,
                "µs/tx",
                "ratio ≤ 1.5",
            )
            .beside("the same tx without the enqueue", plain),
        );
        let (with, plain) = enqueue_overhead_sqlx(&store, iterations).await;
        out.push(
            Figure::new(
                "business tx + one enqueue, sqlx",
                with,
                "µs/tx",
                "ratio ≤ 1.5",
            )
            .beside("the same tx without the enqueue", plain),
        );
        drop(path);
    }
    let (drains, capacity) = drain_figures(quick).await;
    out.extend(drains);
    // Capacity under load: the drain figures above have the machine to
    // themselves, but here a writer shares the two cores and the database's
    // write lock. Offer 1.5 × the drain capacity; what the relay sustains
    // beside that writer is the capacity the 80 % is taken of.
    let secs = Duration::from_secs(if quick { 1 } else { 5 });
    let (_, sustained) = latency_loaded((capacity * 1.5).min(300_000.0), secs, 100).await;
    let rate = sustained * 0.8;
    let (hist, achieved) = latency_loaded(rate, secs, 100).await;
    out.extend(latency_rows(&format!("commit → handled, SQLite, {rate:.0} msg/s offered (80 % of the {sustained:.0} msg/s sustained beside a writer; {achieved:.0} achieved)"), &hist, "—", "—"));
    out.extend(purge_vs_enqueue(if quick { 20_000 } else { 300_000 }, quick).await);
    out.extend(health_check_cost(if quick { 50_000 } else { 1_000_000 }).await);
    out.push(rss_figure(if quick { 100_000 } else { 1_000_000 }));
    out
}

/// Marks every message of the store processed, `processed_at` at the epoch,
/// so that any retention purges all of them.
fn mark_all_processed(store: &SqliteStore) {
    let conn = app_connection(store.path());
    conn.execute(
        &format!(
            "UPDATE {} SET state = 'processed', processed_at = 0",
            store.table()
        ),
        [],
    )
    .unwrap();
}

/// Business tx + one enqueue every millisecond on the application's own
/// connection until `stop` is set (and for at least `min`); the latency of
/// each transaction, BEGIN IMMEDIATE to COMMIT, in µs.
fn paced_writer(
    store: &SqliteStore,
    min: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<hdrhistogram::Histogram<u64>> {
    let mut conn = app_connection(store.path());
    let outbox = store.outbox();
    std::thread::spawn(move || {
        let mut hist = histogram();
        let started = Instant::now();
        let mut next = started;
        let mut id = 0;
        while started.elapsed() < min || !stop.load(Ordering::Acquire) {
            id += 1;
            let t = Instant::now();
            business_tx(&mut conn, &outbox, id, true);
            hist.record(t.elapsed().as_micros() as u64).unwrap();
            next += Duration::from_millis(1);
            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        hist
    })
}

/// Enqueue latency while the relay's retention purge deletes `n` processed
/// rows in batches, beside the same writer with no purge running, and
/// beside one unbatched `DELETE` of the same rows (the failure of
/// `docs/failures.md#the-table-grows-and-cleaning-it-blocks-writers`).
async fn purge_vs_enqueue(n: usize, quick: bool) -> Vec<Figure> {
    use std::sync::atomic::AtomicBool;
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    let calm = Duration::from_secs(if quick { 1 } else { 3 });
    type Work = std::pin::Pin<Box<dyn std::future::Future<Output = Duration>>>;
    // The writer runs until `work` is done (or for `calm` without work).
    let run = |work: Option<Work>| {
        let stop = Arc::new(AtomicBool::new(false));
        let writer = paced_writer(&store, Duration::from_millis(200), stop.clone());
        async move {
            let took = match work {
                Some(work) => Some(work.await),
                None => {
                    tokio::time::sleep(calm).await;
                    None
                }
            };
            stop.store(true, Ordering::Release);
            let hist = tokio::task::spawn_blocking(move || writer.join().unwrap())
                .await
                .unwrap();
            (hist, took)
        }
    };
    // Baseline: the same writer, the processed backlog present, no purge.
    fill(&store, n);
    mark_all_processed(&store);
    let (calm_hist, _) = run(None).await;
    // The relay's purge, in batches of the default 500.
    let relay = Relay::builder(store.clone())
        .dispatcher(Handlers::new())
        .retention(Some(Duration::from_millis(1)))
        .build()
        .unwrap();
    let purge_batch = relay.config().purge_batch;
    let (batched, took_batched) = run(Some(Box::pin(async move {
        let start = Instant::now();
        let purged = relay.purge().await.unwrap();
        assert!(purged as usize >= n, "purged {purged} of {n}");
        start.elapsed()
    })))
    .await;
    // One unbatched DELETE of as many rows.
    fill(&store, n);
    mark_all_processed(&store);
    let path = store.path().to_owned();
    let table = store.table().to_owned();
    let (single, took_single) = run(Some(Box::pin(async move {
        tokio::task::spawn_blocking(move || {
            let conn = app_connection(&path);
            let start = Instant::now();
            conn.execute(
                &format!("DELETE FROM {table} WHERE state = 'processed' AND processed_at < 1"),
                [],
            )
            .unwrap();
            start.elapsed()
        })
        .await
        .unwrap()
    })))
    .await;
    let ms = |h: &hdrhistogram::Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let secs = |d: Option<Duration>| d.unwrap_or_default().as_secs_f64();
    vec![
        Figure::new(
            format!(
                "enqueue tx latency while the relay purges {n} processed rows in batches of {purge_batch} ({:.1} s), p99",
                secs(took_batched)
            ),
            ms(&batched, 0.99),
            "ms",
            "not blocked by the purge",
        )
        .beside("no purge running, p99", ms(&calm_hist, 0.99)),
        Figure::new(
            "… the same, max",
            ms(&batched, 1.0),
            "ms",
            "—",
        )
        .beside("no purge running, max", ms(&calm_hist, 1.0)),
        Figure::new(
            format!(
                "enqueue tx latency during one unbatched DELETE of {n} rows ({:.1} s; for contrast), max",
                secs(took_single)
            ),
            ms(&single, 1.0),
            "ms",
            "—",
        )
        .beside("no purge running, max", ms(&calm_hist, 1.0)),
    ]
}

/// What a health check costs beside a long processed history: the relay's
/// `backlog()` (pending and poisoned counts, oldest pending) against the
/// full `stats()`, which also counts the processed rows, on a table with
/// `history` processed and 1 000 pending messages. Median of 5.
async fn health_check_cost(history: usize) -> Vec<Figure> {
    use outbox::Store;
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    fill(&store, history);
    mark_all_processed(&store);
    fill(&store, 1_000);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut backlog, mut stats) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let b = store.backlog().await.unwrap();
        backlog.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let s = store.stats().await.unwrap();
        stats.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!((b.pending, s.processed as usize), (1_000, history));
    }
    vec![
        Figure::new(
            format!(
                "health check (backlog: pending, poisoned, oldest) beside {history} processed rows"
            ),
            median(backlog),
            "ms",
            "proportional to the backlog, not the history",
        )
        .beside("full stats (also counts processed)", median(stats)),
    ]
}
