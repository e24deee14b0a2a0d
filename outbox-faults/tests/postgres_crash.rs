//! PostgreSQL crashed under the relays: three relay processes share one
//! outbox while the application keeps enqueueing, and the test crashes the
//! server twice (`pg_ctl stop -m immediate`: every server process quits at
//! once, no checkpoint; the next start replays the WAL) and starts it
//! again. Afterwards:
//!
//! * nothing the application committed is lost: every message whose
//!   enqueue transaction's `COMMIT` returned `Ok` (and every uncertain one
//!   whose rows are there) took effect exactly once through the
//!   receiver's inbox;
//! * nothing is left unrecorded: every outbox row is `processed`, none
//!   pending or poisoned, no attempt counted for the outages;
//! * the redeliveries the crashes cause — the relays' own bookkeeping
//!   (claim, complete, fail, release) may commit without waiting for a WAL
//!   flush, and a crash takes back its last few hundred milliseconds — are
//!   turned away by the inbox (counted and printed), each is explained by
//!   a crash, and per-key order of effects holds.
//!
//! The application's enqueue transactions and the receiver's inbox
//! transactions commit synchronously (the server's default, which the test
//! checks and never relaxes): their `Ok` means the commit is on disk.
//!
//! The test crashes a server, so it runs a server of its own
//! ([`OwnPostgres`], in a temporary directory, on a free port), never the
//! shared one; it is alone in its file all the same.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outbox_api::Timestamp;
use outbox_faults::check::{self, Expected};
use outbox_faults::own_postgres::OwnPostgres;
use outbox_faults::postgres::{
    self as pg, Enqueued, in_state, lazy_pool, log_problems_beyond_outages, with_application_name,
};
use outbox_faults::{ChildArgs, RelayChild, assert_all_running};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::{self, AssertSqlSafe, Row};
use outbox_postgres::testing::unique_schema;

/// Relay processes.
const RELAYS: usize = 3;
/// Each relay's batch size.
const BATCH: usize = 50;
/// Each relay's handlers running at once.
const CONCURRENCY: usize = 8;
/// Each relay's lease.
const LEASE: Duration = Duration::from_secs(8);
/// Ordering keys (a third of the messages has one).
const KEYS: usize = 200;
/// The crashes, at these shares of the messages processed.
const CRASH_AT: [f64; 2] = [0.30, 0.65];
/// How long the server stays down after a crash before it is started
/// again: long enough that every client's connections fail and new ones
/// are refused (not a wait for a condition: the outage itself).
const DOWN: Duration = Duration::from_millis(700);
/// The application writes in chunks of this many messages...
const CHUNK: usize = 200;
/// ...and stays at most this many messages ahead of the relays, so that it
/// is still writing when the second crash comes.
const AHEAD: u64 = 5_000;

/// One crash, as the test saw it.
#[derive(Debug)]
struct Crash {
    /// When it came, from the relays' start.
    after: Duration,
    /// Messages processed when it came.
    processed: u64,
    /// Wall-clock milliseconds (as the receiver's `at_ms`) when
    /// `pg_ctl stop -m immediate` was called and when it returned.
    from_ms: i64,
    to_ms: i64,
    /// From the crash until the server accepted connections again
    /// (down + start + WAL replay).
    away: Duration,
    /// Whether the application was still writing.
    writing: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_and_application_survive_two_server_crashes() {
    let seed = check::seed();
    eprintln!("postgres crash test seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let messages = if check::soak() { 100_000 } else { 20_000 };
    // Declared first, so dropped last: the relays are killed before the
    // server stops, also when the test panics.
    let mut server =
        tokio::task::block_in_place(OwnPostgres::new).unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let schema = unique_schema("faults_crash");
    let admin = lazy_pool(
        &with_application_name(&url, "outbox-faults-admin"),
        4,
        Duration::from_secs(5),
    )
    .unwrap();
    sqlx::query(AssertSqlSafe(format!(r#"CREATE SCHEMA "{schema}""#)))
        .execute(&admin)
        .await
        .unwrap();
    // The application's own pool, lazy (made and refilled whether or not
    // the server is up), with the server's durable commits: the test never
    // sets synchronous_commit = off for the application or the receiver.
    let app = lazy_pool(
        &with_application_name(&url, "outbox-faults-app"),
        4,
        Duration::from_secs(5),
    )
    .unwrap();
    for (who, pool) in [("application", &app), ("admin", &admin)] {
        let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(
            setting, "on",
            "the {who}'s commits must wait for the WAL flush"
        );
    }
    let store = PgStore::builder_with_pool(app.clone())
        .schema(&schema)
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    pg::prepare_receiver(&admin, &schema).await.unwrap();
    let outbox = store.outbox();

    // The application writes throughout: chunks of CHUNK messages, at most
    // AHEAD ahead of the relays. `enqueue_many` retries a transaction the
    // crash rolled back and keeps one whose COMMIT got no answer as
    // uncertain (settled below).
    let writer = {
        let (outbox, app, admin, schema) =
            (outbox.clone(), app.clone(), admin.clone(), schema.clone());
        let mut rng = fastrand::Rng::with_seed(seed);
        tokio::spawn(async move {
            let mut all = Enqueued::default();
            let mut seq = 0usize;
            while seq < messages {
                pg::wait_until(
                    "the relays to come within reach of the application",
                    Duration::from_secs(300),
                    || async {
                        in_state(&admin, &schema, "processed")
                            .await
                            .map(|p| seq as u64 <= p + AHEAD)
                    },
                )
                .await;
                let n = CHUNK.min(messages - seq);
                let e =
                    pg::enqueue_many(&outbox, &app, &mut rng, seq as i64, n, KEYS, "key-").await?;
                all.committed.extend(e.committed);
                all.uncertain.extend(e.uncertain);
                all.interrupted += e.interrupted;
                seq += n;
            }
            Ok::<_, String>(all)
        })
    };

    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let mut children: Vec<RelayChild> = (0..RELAYS)
        .map(|r| {
            let mut args = ChildArgs::postgres(&schema, format!("relay-{r}"));
            args.batch_size = BATCH;
            args.concurrency = CONCURRENCY;
            // A handler timeout counts an attempt, so it is far above what
            // a receiver transaction takes on a loaded 2-core machine; the
            // handler's pool gives up after half of it (an outage is then
            // `TemporarilyUnavailable`, uncounted).
            args.lease = LEASE;
            args.handler_timeout = Duration::from_secs(5);
            args.poll_interval = Duration::from_millis(200);
            let log = dir.path().join(format!("relay-{r}.log"));
            // The plain URL: the child's store and receiver add nothing to
            // it but an application_name.
            RelayChild::spawn_postgres(exe, &args, &url, &log).unwrap()
        })
        .collect();
    let logs: Vec<PathBuf> = children.iter().map(|c| c.log().to_owned()).collect();

    let mut crashes: Vec<Crash> = Vec::new();
    for share in CRASH_AT {
        let target = (messages as f64 * share) as u64;
        pg::wait_until(
            &format!("{target} messages processed before a crash"),
            Duration::from_secs(300),
            || async {
                in_state(&admin, &schema, "processed")
                    .await
                    .map(|n| n >= target)
            },
        )
        .await;
        assert_all_running(&mut children, &format!("seed {seed}"));
        let processed = in_state(&admin, &schema, "processed")
            .await
            .unwrap_or(target);
        let writing = !writer.is_finished();
        let at = Instant::now();
        let from_ms = Timestamp::now().as_millis();
        tokio::task::block_in_place(|| server.crash()).unwrap_or_else(|e| panic!("{e}"));
        let to_ms = Timestamp::now().as_millis();
        tokio::time::sleep(DOWN).await;
        tokio::task::block_in_place(|| server.start())
            .unwrap_or_else(|e| panic!("seed {seed}: starting the server after a crash: {e}"));
        crashes.push(Crash {
            after: at - started,
            processed,
            from_ms,
            to_ms,
            away: at.elapsed(),
            writing,
        });
    }

    let written: Enqueued = writer.await.unwrap().unwrap();
    let interrupted = written.interrupted;
    let uncertain = written.uncertain.len();
    let uncertain_messages: usize = written.uncertain.iter().map(Vec::len).sum();
    let committed_for_certain = written.committed.len();
    let expected: Vec<Expected> = written.settle(&admin, &schema).await.unwrap();
    let drained = pg::drain_and_stop(&admin, &schema, &mut children, &format!("seed {seed}")).await;
    let elapsed = started.elapsed();

    let report = pg::verify(&admin, &schema, &expected).await;
    let poisoned = in_state(&admin, &schema, "poisoned").await.unwrap();

    // Where the duplicates come from. A duplicate is a delivery of a
    // message whose previous delivery took effect but whose bookkeeping
    // did not stay: a completion (or a claim) the crash took back because
    // it had committed without a WAL flush, or one a relay could not make
    // while the server was down. So each duplicate's previous delivery
    // lies near a crash: at most a handler timeout before it (a delivery
    // takes effect, then its completion is recorded; the WAL writer
    // flushes an asynchronous commit within 3 × wal_writer_delay = 600 ms,
    // and a synchronous receiver commit flushes everything before it), or
    // up to a lease after it (a relay whose claim was taken back still
    // holds the messages and delivers them when the server is back, while
    // another relay claims them afresh).
    let near_crash = |at_ms: i64| {
        crashes.iter().any(|c| {
            at_ms >= c.from_ms - 5_000 && at_ms <= c.to_ms + LEASE.as_millis() as i64 + 2_000
        })
    };
    let previous: Vec<(String, i64)> = sqlx::query(AssertSqlSafe(format!(
        r#"SELECT message_id, previous FROM (
               SELECT message_id, duplicate,
                      lag(at_ms) OVER (PARTITION BY message_id ORDER BY id) AS previous
               FROM "{schema}".calls) c
           WHERE duplicate"#
    )))
    .fetch_all(&admin)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect();
    let unexplained: Vec<String> = previous
        .iter()
        .filter(|(_, at)| !near_crash(*at))
        .map(|(id, at)| format!("{id} (previous delivery at {at} ms)"))
        .collect();
    // Offsets of the duplicates' previous deliveries from the crash
    // before or after them, for the summary.
    let offsets: Vec<i64> = previous
        .iter()
        .filter_map(|(_, at)| {
            crashes
                .iter()
                .map(|c| at - c.from_ms)
                .min_by_key(|d| d.abs())
        })
        .collect();
    // The bound: per crash, what the relays had in hand (each relay's
    // running handlers, its claimed batch and the one claimed next), plus
    // every delivery recorded in the 2 s before it — more than three
    // times the 600 ms in which asynchronously committed bookkeeping can
    // be lost, for a loaded debug build's settle latency. Each such
    // delivery can be undone once by a crash, hence at most one duplicate.
    let mut bound = (crashes.len() * RELAYS * (2 * BATCH + CONCURRENCY)) as u64;
    for c in &crashes {
        bound += pg::count(
            &admin,
            &format!(
                r#"SELECT count(*) FROM "{schema}".calls WHERE at_ms BETWEEN {} AND {}"#,
                c.from_ms - 2_000,
                c.to_ms
            ),
        )
        .await
        .unwrap();
    }
    let recoveries = server
        .log_text()
        .matches("automatic recovery in progress")
        .count();

    let mut problems = Vec::new();
    let mut outage_lines = 0;
    for log in &logs {
        outage_lines += check::log_problems(log).len();
        problems.extend(log_problems_beyond_outages(log));
    }
    outage_lines -= problems.len();
    let crash_text: Vec<String> = crashes
        .iter()
        .map(|c| {
            format!(
                "after {:.2?} at {} processed: server away {:.2?}, application {}",
                c.after,
                c.processed,
                c.away,
                if c.writing { "writing" } else { "done" }
            )
        })
        .collect();
    eprintln!(
        "postgres crash test: messages={} relays={RELAYS} crashes=[{}] recoveries in the \
         server log={recoveries}; enqueue transactions interrupted={interrupted} (commit \
         uncertain: {uncertain} batches, {uncertain_messages} messages, of which committed: {}); \
         duplicates={} (bound {bound}; previous deliveries {} ms to {} ms from a crash) per \
         relay={:?} poisoned={poisoned}; relay log lines an outage explains={outage_lines}; drained {drained:.2?} after the application's last message, \
         elapsed={elapsed:.2?} seed={seed}",
        expected.len(),
        crash_text.join("; "),
        expected.len() - committed_for_certain,
        report.duplicates,
        offsets.iter().min().copied().unwrap_or(0),
        offsets.iter().max().copied().unwrap_or(0),
        report.per_worker
    );
    assert_eq!(
        committed_for_certain + uncertain_messages,
        messages,
        "seed {seed}: every message written is committed for certain or uncertain"
    );
    assert_eq!(
        recoveries,
        CRASH_AT.len(),
        "seed {seed}: the server log should show one crash recovery per crash; it ends:\n{}",
        server.log_tail(40)
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert_eq!(poisoned, 0, "seed {seed}: poisoned messages");
    assert!(
        unexplained.is_empty(),
        "seed {seed}: {} duplicate(s) whose previous delivery was near no crash, e.g. {}",
        unexplained.len(),
        unexplained
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(
        report.duplicates <= bound,
        "seed {seed}: {} duplicates exceed the bound {bound}",
        report.duplicates
    );
    assert!(
        problems.is_empty(),
        "seed {seed}: the relays reported problems that no outage explains:\n{}",
        problems.join("\n")
    );
    assert_eq!(
        pg::leased(&admin, &schema).await,
        Some(0),
        "seed {seed}: leases left after a graceful stop"
    );
    admin.close().await;
    app.close().await;
    drop(server);
}
