//! Takeover: of two relay processes, one is killed with SIGKILL while it
//! holds leases in the middle of a batch; the survivor delivers those
//! messages — only after their leases expired — and everything is
//! delivered, with any duplicate confined to the victim's batch.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use outbox_api::Timestamp;
use outbox_faults::check::{self, log_problems, pending, verify};
use outbox_faults::{ChildArgs, RelayChild, open_connection};
use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite::Connection;

/// Messages leased by `worker` and not processed: `(id, locked_until ms)`.
fn leased_by(conn: &Connection, worker: &str) -> HashMap<String, i64> {
    let mut stmt = conn
        .prepare(
            "SELECT id, locked_until FROM outbox
             WHERE state = 'pending' AND locked_by = ?1 AND locked_until > ?2",
        )
        .unwrap();
    stmt.query_map(
        outbox_sqlite::rusqlite::params![worker, Timestamp::now().as_millis()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn survivor_takes_over_a_killed_relays_leases_after_they_expire() {
    let seed = check::seed();
    eprintln!("takeover seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let mut rng = fastrand::Rng::with_seed(seed);
    let messages = if check::soak() { 20_000 } else { 2_000 };
    let dir = tempfile::tempdir().unwrap();
    let outbox_db = dir.path().join("app.db");
    let receiver_db = dir.path().join("receiver.db");
    let store = SqliteStore::connect(&outbox_db).await.unwrap();
    store.migrate().await.unwrap();
    let mut conn = open_connection(&outbox_db).unwrap();
    let expected = check::enqueue_many(
        &store.outbox(),
        &mut conn,
        &mut rng,
        0,
        messages,
        16,
        "key-",
    )
    .unwrap();

    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let lease = Duration::from_secs(2);
    // The victim's handler sleeps 1 s before its receiver transaction, so
    // it holds its batch's leases for at least that long, every batch.
    let mut victim_args = ChildArgs::new(&outbox_db, &receiver_db, "victim");
    victim_args.batch_size = 20;
    victim_args.concurrency = 20;
    victim_args.lease = lease;
    victim_args.handler_timeout = Duration::from_millis(1500);
    victim_args.handler_delay = Duration::from_millis(1000);
    let mut survivor_args = ChildArgs::new(&outbox_db, &receiver_db, "survivor");
    survivor_args.batch_size = 20;
    survivor_args.lease = lease;
    survivor_args.handler_timeout = Duration::from_millis(1500);
    survivor_args.poll_interval = Duration::from_millis(50);

    let started = Instant::now();
    let victim_log = dir.path().join("victim.log");
    let mut victim = RelayChild::spawn(exe, &victim_args, &victim_log).unwrap();
    // The survivor starts only once the victim holds leases: started
    // together, a survivor that is up first (a cold machine can take
    // seconds to start a process) may deliver everything before the victim
    // claims anything, and there is nothing to take over.
    check::wait_until("the victim to hold leases", Duration::from_secs(60), || {
        assert!(
            victim.is_running(),
            "seed {seed}: the victim exited before it held a lease; its log ends:\n{}",
            check::log_tail(&victim_log, 40)
        );
        !leased_by(&conn, "victim").is_empty()
    })
    .await;
    let survivor_log = dir.path().join("survivor.log");
    let mut survivor = RelayChild::spawn(exe, &survivor_args, &survivor_log).unwrap();

    // Kill the victim while it holds leases, a random moment into its batch.
    tokio::time::sleep(Duration::from_millis(rng.u64(0..=500))).await;
    victim.kill().unwrap();
    let killed_at = Timestamp::now().as_millis();
    let orphans = leased_by(&conn, "victim");
    assert!(
        !orphans.is_empty(),
        "seed {seed}: the victim held no lease when it was killed"
    );

    // Polled here rather than with `check::wait_until`, so that a timeout
    // shows what the survivor was doing (its log is gone with the test's
    // directory once the test has panicked).
    let deadline = Instant::now() + Duration::from_secs(60);
    while pending(&conn) > 0 {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: timed out after 60 s waiting for the survivor to deliver everything; \
             {} pending, survivor running: {}, leases held by the survivor: {}; its log ends:\n{}",
            pending(&conn),
            survivor.is_running(),
            leased_by(&conn, "survivor").len(),
            check::log_tail(&survivor_log, 40)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    survivor.stop(Duration::from_secs(10)).unwrap();

    let report = verify(&outbox_db, &receiver_db, &expected);
    // Each orphan went to the survivor, no earlier than its lease expired.
    let rx = open_connection(&receiver_db).unwrap();
    let mut early = Vec::new();
    let mut first_takeover = i64::MAX;
    for (id, until) in &orphans {
        let (worker, at): (String, i64) = rx
            .query_row(
                "SELECT worker, at_ms FROM calls WHERE message_id = ?1 ORDER BY rowid LIMIT 1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap_or_else(|e| panic!("seed {seed}: orphan {id} was never handled: {e}"));
        if worker == "survivor" {
            first_takeover = first_takeover.min(at);
            if at < *until {
                early.push(format!("{id}: handled at {at}, lease until {until}"));
            }
        }
    }
    let dup_ids: Vec<String> = {
        let mut stmt = rx
            .prepare("SELECT message_id FROM calls WHERE duplicate <> 0")
            .unwrap();
        stmt.query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    eprintln!(
        "takeover: messages={messages} kills=1 orphaned leases={} duplicates={} \
         takeover {} ms after the kill, per relay={:?} elapsed={elapsed:.2?} seed={seed}",
        orphans.len(),
        report.duplicates,
        first_takeover.saturating_sub(killed_at),
        report.per_worker
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert!(
        early.is_empty(),
        "seed {seed}: the survivor took messages while the victim's lease held: {early:?}"
    );
    assert!(
        dup_ids.iter().all(|id| orphans.contains_key(id)),
        "seed {seed}: duplicates outside the victim's batch: {dup_ids:?}"
    );
    assert!(report.duplicates <= victim_args.batch_size as u64);
    for log in [&victim_log, &survivor_log] {
        let problems = log_problems(log);
        assert!(
            problems.is_empty(),
            "seed {seed}: {} reported problems:\n{}",
            log.display(),
            problems.join("\n")
        );
    }
}
