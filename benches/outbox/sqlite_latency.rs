//! Latency figures on SQLite. An open-loop producer commits one business
//! transaction (an order row and one message) on a fixed schedule, whether
//! or not earlier messages were handled, and every time is measured from
//! the message's *scheduled* time: a producer that falls behind (a slow
//! commit) is charged for every message it delays, never only for the one
//! it was committing (no coordinated omission). Each figure stands beside
//! the same producer with no relay running: the database's own commit tail.
//!
//! `OUTBOX_BENCH_TRACE=1` also writes each run's per-message times and the
//! WAL's counters, and prints a summary of each (`latency_trace`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use outbox::{Handlers, Message, Relay, RelayHandle};
use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite::TransactionBehavior;
use outbox_sqlite::sqlx;

use crate::common::{Figure, histogram, latency_rows};
use crate::latency_trace::{self, Trace, WalSampler};
use crate::sqlite::{app_connection, bench_message, open, sqlx_pool};

/// The driver the producer commits through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Rusqlite,
    /// A sqlx pool, each transaction `BEGIN IMMEDIATE`.
    Sqlx,
}

impl Driver {
    fn name(self) -> &'static str {
        match self {
            Driver::Rusqlite => "rusqlite",
            Driver::Sqlx => "sqlx",
        }
    }
}

/// Per-message times of one run, µs since the run's base instant (0: not
/// reached).
pub struct Times {
    pub scheduled: Vec<u64>,
    pub began: Vec<AtomicU64>,
    /// Just before COMMIT.
    pub committing: Vec<AtomicU64>,
    pub committed: Vec<AtomicU64>,
    pub handled: Vec<AtomicU64>,
}

impl Times {
    pub fn new(n: usize, period_us: f64, lead_us: u64) -> Self {
        let zeros = || (0..n).map(|_| AtomicU64::new(0)).collect();
        Times {
            scheduled: (0..n)
                .map(|i| lead_us + (i as f64 * period_us) as u64)
                .collect(),
            began: zeros(),
            committing: zeros(),
            committed: zeros(),
            handled: zeros(),
        }
    }

    pub fn hist(&self, of: &[AtomicU64]) -> Histogram<u64> {
        self.between(&self.scheduled, of)
    }

    /// `to` − `from` of every message that reached both.
    pub fn between(&self, from: &[u64], to: &[AtomicU64]) -> Histogram<u64> {
        let mut h = histogram();
        for (s, t) in from.iter().zip(to) {
            let t = t.load(Ordering::Acquire);
            if t > 0 {
                h.record(t.saturating_sub(*s)).unwrap();
            }
        }
        h
    }

    /// Stamps message `i` in `at` (µs since `base`).
    pub fn stamp(at: &[AtomicU64], i: usize, base: Instant) {
        at[i].store(
            (base.elapsed().as_micros() as u64).max(1),
            Ordering::Release,
        );
    }

    /// Handlers that stamp each bench message's `handled` time (the
    /// message's index is its payload's first 8 bytes).
    pub fn recording_handlers(self: &Arc<Self>, base: Instant) -> Handlers {
        let t = Arc::clone(self);
        Handlers::new().on_message("Bench", move |m: &Message| {
            let i = usize::from_le_bytes(m.payload[..8].try_into().unwrap());
            Times::stamp(&t.handled, i, base);
            async { Ok::<_, std::io::Error>(()) }
        })
    }

    /// Waits (at most 30 s) until the relay handled every message, then
    /// shuts it down; nothing without a relay.
    pub async fn settle(&self, relay: Option<RelayHandle>) {
        if let Some(relay) = relay {
            let deadline = Instant::now() + Duration::from_secs(30);
            let all = || self.handled.iter().all(|h| h.load(Ordering::Acquire) > 0);
            while !all() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            relay.shutdown().await;
        }
    }

    /// The just-before-COMMIT times, as loaded now.
    pub fn committing_times(&self) -> Vec<u64> {
        self.committing
            .iter()
            .map(|t| t.load(Ordering::Acquire))
            .collect()
    }

    /// The run's histograms, given [`committing_times`](Self::committing_times).
    pub fn run(&self, committing: &[u64]) -> Run {
        Run {
            commit: self.hist(&self.committed),
            handled: self.hist(&self.handled),
            commit_to_handled: self.between(committing, &self.handled),
        }
    }
}

/// What open-loop runs measured (µs).
pub struct Run {
    /// Scheduled time → the producer's COMMIT returned.
    pub commit: Histogram<u64>,
    /// Scheduled time → the handler started (empty without a relay).
    pub handled: Histogram<u64>,
    /// Just before COMMIT → the handler started (empty without a relay).
    pub commit_to_handled: Histogram<u64>,
}

impl Run {
    pub fn new() -> Self {
        Run {
            commit: histogram(),
            handled: histogram(),
            commit_to_handled: histogram(),
        }
    }

    pub fn add(&mut self, other: &Run) {
        self.commit.add(&other.commit).unwrap();
        self.handled.add(&other.handled).unwrap();
        self.commit_to_handled
            .add(&other.commit_to_handled)
            .unwrap();
    }
}

/// One business transaction: an order row and message `i`; `committing`
/// runs just before COMMIT.
fn commit_rusqlite(
    conn: &mut outbox_sqlite::rusqlite::Connection,
    outbox: &outbox_sqlite::SqliteOutbox,
    i: usize,
    committing: impl FnOnce(),
) {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    tx.execute(
        "INSERT INTO orders (customer, total) VALUES ('alice', 4200)",
        [],
    )
    .unwrap();
    outbox.enqueue_rusqlite(&tx, bench_message(i)).unwrap();
    committing();
    tx.commit().unwrap();
}

async fn commit_sqlx(
    pool: &sqlx::SqlitePool,
    outbox: &outbox_sqlite::SqliteOutbox,
    i: usize,
    committing: impl FnOnce(),
) {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::query("INSERT INTO orders (customer, total) VALUES ('alice', 4200)")
        .execute(&mut *tx)
        .await
        .unwrap();
    outbox.enqueue(&mut *tx, bench_message(i)).await.unwrap();
    committing();
    tx.commit().await.unwrap();
}

/// The producer: a thread of its own, so that its schedule is kept to the
/// tens of microseconds (tokio's timer has a 1 ms tick); sqlx transactions
/// run on the bench's runtime through its handle, as an application's
/// request handler would.
fn produce(driver: Driver, store: &SqliteStore, times: Arc<Times>, base: Instant) -> Producer {
    let path = store.path().to_owned();
    let outbox = store.outbox();
    let rt = tokio::runtime::Handle::current();
    std::thread::spawn(move || {
        let mut conn = (driver == Driver::Rusqlite).then(|| app_connection(&path));
        let pool = (driver == Driver::Sqlx).then(|| rt.block_on(sqlx_pool(&path)));
        keep_schedule(&times, base, |i, committing| match (&mut conn, &pool) {
            (Some(conn), _) => commit_rusqlite(conn, &outbox, i, committing),
            (None, Some(pool)) => rt.block_on(commit_sqlx(pool, &outbox, i, committing)),
            (None, None) => unreachable!("one driver"),
        });
        if let Some(pool) = pool {
            rt.block_on(pool.close());
        }
    })
}

type Producer = std::thread::JoinHandle<()>;

/// The open-loop schedule, on the calling thread: waits for each message's
/// scheduled time (never for the previous message's handling), stamps
/// `began`, runs `commit(i, committing)` — which calls `committing` just
/// before its COMMIT — and stamps `committed`. Every backend's producer.
pub fn keep_schedule(times: &Times, base: Instant, mut commit: impl FnMut(usize, &dyn Fn())) {
    for (i, scheduled) in times.scheduled.iter().enumerate() {
        let at = base + Duration::from_micros(*scheduled);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        Times::stamp(&times.began, i, base);
        commit(i, &|| Times::stamp(&times.committing, i, base));
        Times::stamp(&times.committed, i, base);
    }
}

/// Runs the producer at `rate` msg/s for `count` messages, with a relay
/// delivering to an in-process handler if `relay`; `round` names the trace.
pub async fn open_loop(driver: Driver, rate: u32, count: usize, relay: bool, round: usize) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    drop(app_connection(store.path()));
    let base = Instant::now();
    // The first message is scheduled 50 ms out, after the relay has started.
    let times = Arc::new(Times::new(count, 1e6 / f64::from(rate), 50_000));
    let relay = if relay {
        let relay = Relay::builder(store.clone())
            .dispatcher(times.recording_handlers(base))
            .spawn()
            .unwrap();
        relay.until_idle().await.unwrap();
        Some(relay)
    } else {
        None
    };
    let sampler = latency_trace::enabled().then(|| WalSampler::start(store.path(), base));
    let producer = produce(driver, &store, times.clone(), base);
    tokio::task::spawn_blocking(move || producer.join().unwrap())
        .await
        .unwrap();
    times.settle(relay).await;
    let wal = sampler.map(WalSampler::stop);
    let committing = times.committing_times();
    if let Some(wal) = wal {
        let name = format!(
            "latency-{}-{rate}-{}-{round}",
            driver.name(),
            if relay_ran(&times) {
                "relay"
            } else {
                "no-relay"
            }
        );
        let load = |v: &[AtomicU64]| v.iter().map(|t| t.load(Ordering::Acquire)).collect();
        Trace {
            scheduled: times.scheduled.clone(),
            began: load(&times.began),
            committing: committing.clone(),
            committed: load(&times.committed),
            handled: load(&times.handled),
            wal,
        }
        .write(&name);
    }
    times.run(&committing)
}

fn relay_ran(times: &Times) -> bool {
    times.handled.iter().any(|h| h.load(Ordering::Acquire) > 0)
}

/// Closed loop, for contrast: one message per transaction, the next
/// committed only after the previous was handled and `gap` passed; commit →
/// handled. A producer that waits never offers a message while the relay or
/// the database is stalled, so this hides the tail the open loop shows.
async fn closed_loop(samples: usize, gap: Duration) -> hdrhistogram::Histogram<u64> {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path()).await;
    let (tx_done, mut rx_done) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let handlers = Handlers::new().on_message("Bench", move |_m: &Message| {
        let _ = tx_done.send(Instant::now());
        async { Ok::<_, std::io::Error>(()) }
    });
    let relay = Relay::builder(store.clone())
        .dispatcher(handlers)
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let mut conn = app_connection(store.path());
    let outbox = store.outbox();
    let mut hist = histogram();
    for i in 0..samples {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        outbox.enqueue_rusqlite(&tx, bench_message(i)).unwrap();
        let committed = Instant::now();
        tx.commit().unwrap();
        let handled = rx_done.recv().await.unwrap();
        hist.record(handled.duration_since(committed).as_micros() as u64)
            .unwrap();
        tokio::time::sleep(gap).await;
    }
    relay.shutdown().await;
    hist
}

/// `rows` (p50, p99, max of one figure), each beside the same quantile of
/// `baseline`.
pub fn beside(rows: Vec<Figure>, name: &str, baseline: &Histogram<u64>) -> Vec<Figure> {
    let quantiles = [
        ("p50", baseline.value_at_quantile(0.5)),
        ("p99", baseline.value_at_quantile(0.99)),
        ("max", baseline.max()),
    ];
    rows.into_iter()
        .zip(quantiles)
        .map(|(f, (q, v))| f.beside(format!("{name}, {q}"), v as f64 / 1000.0))
        .collect()
}

/// The open-loop figures: at each rate and through each driver, scheduled
/// → handled beside the same producer's scheduled → commit with no relay
/// running. In full mode, two rounds of each, in alternating order, so that
/// figure and baseline see the same machine.
pub async fn figures(quick: bool) -> Vec<Figure> {
    let mut out = Vec::new();
    let rounds = if quick { 1 } else { 2 };
    for rate in [500u32, 1000] {
        // 5 s of load in full mode (2,500 messages at 500 msg/s).
        let count = if quick { 200 } else { rate as usize * 5 };
        for driver in [Driver::Sqlx, Driver::Rusqlite] {
            let (mut alone, mut with) = (Run::new(), Run::new());
            for round in 0..rounds {
                let order = if round % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                };
                for relay in order {
                    let run = open_loop(driver, rate, count / rounds, relay, round).await;
                    (if relay { &mut with } else { &mut alone }).add(&run);
                }
            }
            let handled = &with.handled;
            let (p50, p99) = if rate == 500 {
                ("≤ 0.5 ms", "≤ 2 ms, or ≤ 1.2 × baseline")
            } else {
                ("—", "—")
            };
            let d = driver.name();
            let rows = latency_rows(
                &format!("scheduled → handled, SQLite, {d}, open loop {rate} msg/s ({count} msgs)"),
                handled,
                p50,
                p99,
            );
            out.extend(beside(
                rows,
                "scheduled → commit returned, no relay",
                &alone.commit,
            ));
            out.push(
                Figure::new(
                    format!("… the producer's scheduled → commit returned with the relay running, {d}, {rate} msg/s, p99"),
                    with.commit.value_at_quantile(0.99) as f64 / 1000.0,
                    "ms",
                    "—",
                )
                .beside(
                    "no relay, p99",
                    alone.commit.value_at_quantile(0.99) as f64 / 1000.0,
                ),
            );
            let ms = |q: f64| with.commit_to_handled.value_at_quantile(q) as f64 / 1000.0;
            for (q, at) in [("p50", 0.5), ("p99", 0.99)] {
                out.push(Figure::new(
                    format!("… just before COMMIT → handled (the issue's measure), {d}, {rate} msg/s, {q}"),
                    ms(at),
                    "ms",
                    "—",
                ));
            }
        }
    }
    let hist = closed_loop(if quick { 300 } else { 3000 }, Duration::from_millis(2)).await;
    out.extend(latency_rows(
        "commit → handled, SQLite, rusqlite, closed loop (one message at a time, 2 ms apart)",
        &hist,
        "—",
        "—",
    ));
    out
}
