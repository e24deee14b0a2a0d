//! Several relays in separate processes on one SQLite file: every message
//! is delivered exactly once — not merely taking effect once thanks to the
//! inbox, but handed to a handler once (leases hold, claims never overlap)
//! — and per-key order holds across processes.

use std::path::Path;
use std::time::{Duration, Instant};

use outbox_faults::check::{self, log_problems, pending, verify};
use outbox_faults::{ChildArgs, RelayChild, open_connection, stop_all};
use outbox_sqlite::SqliteStore;

#[tokio::test(flavor = "current_thread")]
async fn four_relay_processes_deliver_each_message_once_in_key_order() {
    let seed = check::seed();
    eprintln!("multi-relay seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let mut rng = fastrand::Rng::with_seed(seed);
    let messages = if check::soak() { 200_000 } else { 20_000 };
    let relays = 4;
    let dir = tempfile::tempdir().unwrap();
    // Outbox and receiver tables in one file: the relays' claims, completes
    // and receiver transactions all contend for its write lock.
    let db = dir.path().join("app.db");

    let store = SqliteStore::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    let outbox = store.outbox();
    let mut conn = open_connection(&db).unwrap();
    let half = messages / 2;
    let mut expected =
        check::enqueue_many(&outbox, &mut conn, &mut rng, 0, half, 32, "key-").unwrap();

    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let started = Instant::now();
    let mut children = Vec::new();
    for r in 0..relays {
        let mut args = ChildArgs::new(&db, &db, format!("relay-{r}"));
        args.batch_size = 50;
        // Long enough never to expire during the run: no takeovers, so any
        // second delivery would be a bug.
        args.lease = Duration::from_secs(60);
        args.handler_timeout = Duration::from_secs(30);
        args.poll_interval = Duration::from_millis(100);
        let log = dir.path().join(format!("relay-{r}.log"));
        children.push(RelayChild::spawn(exe, &args, &log).unwrap());
    }
    // The other half while the relays run (their wake-up is cross-process).
    expected.extend(
        check::enqueue_many(
            &outbox,
            &mut conn,
            &mut rng,
            half as i64,
            messages - half,
            32,
            "key-",
        )
        .unwrap(),
    );
    check::wait_until("the outbox to drain", Duration::from_secs(150), || {
        pending(&conn) == 0
    })
    .await;
    let elapsed = started.elapsed();
    stop_all(
        &mut children,
        Duration::from_secs(10),
        &format!("seed {seed}"),
    );

    let report = verify(&db, &db, &expected);
    eprintln!(
        "multi-relay: messages={messages} relays={relays} duplicates={} calls={} \
         per relay={:?} elapsed={elapsed:.2?} seed={seed}",
        report.duplicates, report.calls, report.per_worker
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert_eq!(
        report.duplicates, 0,
        "seed {seed}: a message was handed to a handler twice while leases held"
    );
    assert_eq!(report.calls, messages as u64, "seed {seed}: handler calls");
    assert!(
        report.per_worker.len() >= 2,
        "seed {seed}: only {:?} delivered anything; the relays did not run side by side",
        report.per_worker
    );
    for c in &children {
        let problems = log_problems(c.log());
        assert!(
            problems.is_empty(),
            "seed {seed}: relay {} reported problems:\n{}",
            c.worker(),
            problems.join("\n")
        );
    }
}
