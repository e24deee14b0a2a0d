//! Crash test: a child relay is killed with SIGKILL at random moments and
//! restarted, again and again; afterwards every message took effect exactly
//! once through the inbox, and the duplicates it turned away are bounded by
//! what the kills could have left half-done.

use std::path::Path;
use std::time::{Duration, Instant};

use outbox_api::Store;
use outbox_faults::check::{self, log_problems, pending, verify};
use outbox_faults::{ChildArgs, RelayChild, open_connection};
use outbox_sqlite::SqliteStore;

#[tokio::test(flavor = "current_thread")]
async fn sigkill_and_restart_loses_nothing_and_duplicates_nothing() {
    let seed = check::seed();
    eprintln!("crash test seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let mut rng = fastrand::Rng::with_seed(seed);
    let (messages, kills) = if check::soak() {
        (100_000, 100)
    } else {
        (10_000, 20)
    };
    let dir = tempfile::tempdir().unwrap();
    let outbox_db = dir.path().join("app.db");
    let receiver_db = dir.path().join("receiver.db");
    let log = dir.path().join("children.log");

    let store = SqliteStore::connect(&outbox_db).await.unwrap();
    store.migrate().await.unwrap();
    let mut conn = open_connection(&outbox_db).unwrap();
    let mut expected = check::enqueue_many(
        &store.outbox(),
        &mut conn,
        &mut rng,
        0,
        messages,
        64,
        "key-",
    )
    .unwrap();

    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let started = Instant::now();
    let mut args = ChildArgs::new(&outbox_db, &receiver_db, "");
    args.batch_size = 50;
    let mut kills_with_work_left = 0;
    for k in 0..kills {
        // Keep a backlog, so that every kill hits a relay with work to do
        // however fast this machine drains (the total grows past `messages`).
        if pending(&conn) < 3_000 {
            let next = expected.len() as i64;
            let more = check::enqueue_many(
                &store.outbox(),
                &mut conn,
                &mut rng,
                next,
                3_000,
                64,
                "key-",
            )
            .unwrap();
            expected.extend(more);
        }
        args.worker = format!("crash-{k}");
        let mut child = RelayChild::spawn(exe, &args, &log).unwrap();
        let delay = rng.u64(20..=300);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        assert!(
            child.is_running(),
            "seed {seed}: child {k} exited by itself; its log ends:\n{}",
            check::log_tail(&log, 20)
        );
        child.kill().unwrap();
        if pending(&conn) > 0 {
            kills_with_work_left += 1;
        }
    }
    let pending_after_kills = pending(&conn);
    args.worker = "crash-final".into();
    let mut last = RelayChild::spawn(exe, &args, &log).unwrap();
    check::wait_until("the outbox to drain", Duration::from_secs(180), || {
        pending(&conn) == 0
    })
    .await;
    let elapsed = started.elapsed();
    last.stop(Duration::from_secs(10)).unwrap();
    assert_eq!(store.stats().await.unwrap().pending, 0);

    let report = verify(&outbox_db, &receiver_db, &expected);
    let messages = expected.len();
    eprintln!(
        "crash test: messages={messages} kills={kills} (with work left: {kills_with_work_left}, \
         pending after the kills: {pending_after_kills}) duplicates={} (bound {}) elapsed={elapsed:.2?} \
         seed={seed}",
        report.duplicates,
        args.batch_size * kills
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert!(
        report.duplicates <= (args.batch_size * kills) as u64,
        "seed {seed}: {} duplicates exceed batch_size × kills = {}",
        report.duplicates,
        args.batch_size * kills
    );
    assert!(
        kills_with_work_left >= kills * 3 / 4,
        "seed {seed}: only {kills_with_work_left} of {kills} kills hit a relay with work left; \
         the experiment did not exercise crashes"
    );
    let problems = log_problems(&log);
    assert!(
        problems.is_empty(),
        "seed {seed}: the children reported problems:\n{}",
        problems.join("\n")
    );
}
