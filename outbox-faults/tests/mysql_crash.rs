//! MySQL/MariaDB killed under the relays, and a relay killed: two relay
//! processes share one outbox while the application keeps enqueueing; the
//! test SIGKILLs the server mid-drain and starts it again (InnoDB recovers
//! from its redo log), then SIGKILLs one relay and starts a replacement.
//! Afterwards:
//!
//! * nothing the application committed is lost: every message whose
//!   enqueue transaction's `COMMIT` returned `Ok` (and every uncertain one
//!   whose rows are there) took effect exactly once through the receiver's
//!   inbox, in per-key order;
//! * nothing is left unrecorded: every outbox row is `processed`, none
//!   pending or poisoned, no attempt counted for the outage, no lease left;
//! * the redeliveries the kills cause (deliveries whose effect committed
//!   but whose completion did not) are turned away by the inbox, counted,
//!   and within what the relays had in hand at each kill.
//!
//! Every commit here is durable (`innodb_flush_log_at_trx_commit=1`, which
//! the test checks): the server's kill takes back only transactions that
//! had not committed.
//!
//! The test kills a server, so it runs one of its own ([`OwnMySql`]: a
//! data directory in a temporary directory on a free port, or a container
//! of its own), never the shared one.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outbox_faults::check::{self, Expected};
use outbox_faults::mysql::{self as my, in_state, lazy_pool};
use outbox_faults::own_mysql::OwnMySql;
use outbox_faults::postgres::wait_until;
use outbox_faults::{ChildArgs, Enqueued, RelayChild, assert_all_running};
use outbox_mysql::MySqlStore;
use outbox_mysql::sqlx;

/// Relay processes at any time.
const RELAYS: usize = 2;
/// Each relay's batch size.
const BATCH: usize = 50;
/// Each relay's handlers running at once.
const CONCURRENCY: usize = 8;
/// Each relay's lease: the killed relay's messages wait this long.
const LEASE: Duration = Duration::from_secs(4);
/// Ordering keys (a third of the messages has one).
const KEYS: usize = 100;
/// The table prefix.
const PREFIX: &str = "faults";
/// How long the server stays down after its kill (the outage itself, not
/// a wait for a condition).
const DOWN: Duration = Duration::from_millis(700);
/// The application writes in chunks of this many messages, at most
/// `AHEAD` ahead of the relays, so that it is still writing at the kills.
const CHUNK: usize = 200;
const AHEAD: u64 = 3_000;

fn spawn(exe: &Path, url: &str, dir: &Path, name: &str) -> RelayChild {
    let mut args = ChildArgs::mysql(PREFIX, name);
    args.batch_size = BATCH;
    args.concurrency = CONCURRENCY;
    args.lease = LEASE;
    // A handler timeout counts an attempt, so it is far above a receiver
    // transaction on a loaded 2-core machine; the handler's pool gives up
    // after half of it (an outage is then uncounted).
    args.handler_timeout = Duration::from_secs(3);
    args.poll_interval = Duration::from_millis(200);
    RelayChild::spawn_mysql(exe, &args, url, &dir.join(format!("{name}.log"))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_and_application_survive_a_killed_server_and_a_killed_relay() {
    let seed = check::seed();
    eprintln!("mysql crash test seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let messages = if check::soak() { 50_000 } else { 8_000 };
    // Declared first, so dropped last: the relays are killed before the
    // server stops, also when the test panics.
    let mut server = tokio::task::block_in_place(OwnMySql::new).unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let admin = lazy_pool(&url, 4, Duration::from_secs(5)).unwrap();
    let app = lazy_pool(&url, 4, Duration::from_secs(5)).unwrap();
    let flush: i64 = sqlx::query_scalar("SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(flush, 1, "every commit must be flushed to the redo log");
    let store = MySqlStore::builder(&url)
        .table(my::outbox_table(PREFIX))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    my::prepare_receiver(&admin, &url, PREFIX).await.unwrap();
    let outbox = store.outbox();

    // The application writes throughout; `enqueue_many` retries a
    // transaction the kill rolled back and keeps one whose COMMIT got no
    // answer as uncertain (settled below).
    let writer = {
        let (outbox, app, admin) = (outbox.clone(), app.clone(), admin.clone());
        let mut rng = fastrand::Rng::with_seed(seed);
        tokio::spawn(async move {
            let mut all = Enqueued::default();
            let mut seq = 0usize;
            while seq < messages {
                wait_until(
                    "the relays to come within reach of the application",
                    Duration::from_secs(300),
                    || async {
                        in_state(&admin, PREFIX, "processed")
                            .await
                            .map(|p| seq as u64 <= p + AHEAD)
                    },
                )
                .await;
                let n = CHUNK.min(messages - seq);
                let e =
                    my::enqueue_many(&outbox, &app, &mut rng, seq as i64, n, KEYS, "key-").await?;
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
        .map(|r| spawn(exe, &url, dir.path(), &format!("relay-{r}")))
        .collect();
    let wait_processed = |share: f64| {
        let target = (messages as f64 * share) as u64;
        let admin = admin.clone();
        async move {
            wait_until(
                &format!("{target} messages processed"),
                Duration::from_secs(300),
                || async {
                    in_state(&admin, PREFIX, "processed")
                        .await
                        .map(|n| n >= target)
                },
            )
            .await;
        }
    };

    // The server, mid-drain.
    wait_processed(0.3).await;
    assert_all_running(&mut children, &format!("seed {seed}"));
    let server_writing = !writer.is_finished();
    let killed_at = Instant::now();
    tokio::task::block_in_place(|| server.crash()).unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(DOWN).await;
    tokio::task::block_in_place(|| server.start())
        .unwrap_or_else(|e| panic!("seed {seed}: starting the server after its kill: {e}"));
    let away = killed_at.elapsed();

    // A relay, once the relays are past the outage, and its replacement.
    wait_processed(0.6).await;
    assert_all_running(&mut children, &format!("seed {seed}"));
    let relay_writing = !writer.is_finished();
    children[0].kill().unwrap();
    children.push(spawn(exe, &url, dir.path(), &format!("relay-{RELAYS}")));
    let logs: Vec<PathBuf> = children.iter().map(|c| c.log().to_owned()).collect();

    let written: Enqueued = writer.await.unwrap().unwrap();
    let interrupted = written.interrupted;
    let uncertain_messages: usize = written.uncertain.iter().map(Vec::len).sum();
    let committed_for_certain = written.committed.len();
    let expected: Vec<Expected> = my::settle(written, &admin, PREFIX).await.unwrap();
    // Messages whose handler was unavailable during the outage wait out the
    // relay's growing backoff for their type (`unavailable_max`, 60 s) even
    // once the server is back: the drain may take that long.
    let drained = wait_until("the outbox to drain", Duration::from_secs(300), || async {
        in_state(&admin, PREFIX, "pending").await.map(|n| n == 0)
    })
    .await;
    let mut running: Vec<RelayChild> = children.drain(1..).collect();
    outbox_faults::stop_all(
        &mut running,
        Duration::from_secs(20),
        &format!("seed {seed}"),
    );
    let elapsed = started.elapsed();

    let report = my::verify(&admin, PREFIX, &expected).await;
    let poisoned = in_state(&admin, PREFIX, "poisoned").await.unwrap();
    // At each kill, at most what every relay had in hand — its running
    // handlers, its claimed batch and the one claimed next — can have taken
    // effect without its completion committing.
    let bound = (2 * RELAYS * (2 * BATCH + CONCURRENCY)) as u64;
    let recoveries = server.log_text().matches("crash recovery").count();
    let problems: Vec<String> = logs
        .iter()
        .flat_map(|l| my::log_problems_beyond_outages(l))
        .collect();
    eprintln!(
        "mysql crash test: messages={} relays={RELAYS}; server killed (application {}) and \
         away {away:.2?}, crash recoveries in its log={recoveries}; relay-0 killed \
         (application {}); enqueue transactions interrupted={interrupted} (uncertain messages \
         {uncertain_messages}, of which committed {}); duplicates={} (bound {bound}) per \
         relay={:?} poisoned={poisoned}; drained {drained:.2?} after the application's last \
         message, elapsed={elapsed:.2?} seed={seed}",
        expected.len(),
        if server_writing { "writing" } else { "done" },
        if relay_writing { "writing" } else { "done" },
        expected.len() - committed_for_certain,
        report.duplicates,
        report.per_worker
    );
    assert_eq!(
        committed_for_certain + uncertain_messages,
        messages,
        "seed {seed}: every message written is committed for certain or uncertain"
    );
    assert!(
        recoveries >= 1,
        "seed {seed}: the server log should show InnoDB's crash recovery; it ends:\n{}",
        server.log_tail(40)
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert_eq!(poisoned, 0, "seed {seed}: poisoned messages");
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
        my::leased(&admin, PREFIX).await,
        Some(0),
        "seed {seed}: leases left after a graceful stop"
    );
    admin.close().await;
    app.close().await;
    drop(server);
}
