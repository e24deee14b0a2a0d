//! Contention: application writers (sqlx and rusqlite, each in its own
//! transactions with business rows) and two relays (one in this process,
//! one a child process) hammer one SQLite file at once. No "database is
//! locked" (SQLITE_BUSY) or any other error may reach the application, the
//! relays' store calls or the handlers, and everything is delivered.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{Relay, RelayConfig};
use outbox_faults::check::{self, Expected, log_problems, pending, verify};
use outbox_faults::{ChildArgs, CountingStore, Receiver, RelayChild, open_connection};
use outbox_sqlite::SqliteStore;
use outbox_sqlite::rusqlite::{TransactionBehavior, params};
use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

/// Errors seen by the application, each naming the writer and the call.
type Errors = Arc<Mutex<Vec<String>>>;

fn note(errors: &Errors, text: String) {
    eprintln!("APP_ERROR {text}");
    errors.lock().unwrap().push(text);
}

/// One sqlx writer: `BEGIN IMMEDIATE`, a business row, 1–5 messages
/// (keys of its own, so its sequence numbers give each key's commit order),
/// `COMMIT`; until `stop`.
async fn sqlx_writer(
    name: String,
    db: std::path::PathBuf,
    store: SqliteStore,
    stop: Arc<AtomicBool>,
    errors: Errors,
    seed: u64,
) -> Vec<Expected> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(SqliteConnectOptions::new().filename(&db))
        .await
        .expect("sqlx pool");
    let outbox = store.outbox();
    let mut committed = Vec::new();
    let mut seq = 0i64;
    while !stop.load(Ordering::Relaxed) {
        let mut tx = match pool.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => tx,
            Err(e) => {
                note(&errors, format!("{name} BEGIN IMMEDIATE: {e}"));
                continue;
            }
        };
        if let Err(e) = outbox_sqlite::sqlx::query(
            "INSERT INTO orders (writer, n, note) VALUES (?1, ?2, 'placed')",
        )
        .bind(&name)
        .bind(seq)
        .execute(&mut *tx)
        .await
        {
            note(&errors, format!("{name} INSERT INTO orders: {e}"));
            continue;
        }
        let mut batch = Vec::new();
        let mut failed = false;
        for _ in 0..rng.usize(1..=5) {
            let key = (rng.u8(..2) == 0).then(|| format!("{name}-{}", rng.usize(..8)));
            match outbox
                .enqueue(&mut *tx, check::message(seq, key.as_deref()))
                .await
            {
                Ok(id) => batch.push(Expected { id, seq, key }),
                Err(e) => {
                    note(&errors, format!("{name} enqueue: {e}"));
                    failed = true;
                    break;
                }
            }
            seq += 1;
        }
        if failed {
            continue; // dropping `tx` rolls back
        }
        match tx.commit().await {
            Ok(()) => committed.extend(batch),
            Err(e) => note(&errors, format!("{name} COMMIT: {e}")),
        }
        tokio::task::yield_now().await;
    }
    pool.close().await;
    committed
}

/// The rusqlite writer: the same, on a plain rusqlite connection; one
/// transaction in 40 holds the write lock for 20–80 ms before committing.
fn rusqlite_writer(
    name: String,
    db: std::path::PathBuf,
    store: SqliteStore,
    stop: Arc<AtomicBool>,
    errors: Errors,
    seed: u64,
) -> Vec<Expected> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut conn = open_connection(&db).expect("rusqlite connection");
    let outbox = store.outbox();
    let mut committed = Vec::new();
    let mut seq = 0i64;
    while !stop.load(Ordering::Relaxed) {
        let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
            Ok(tx) => tx,
            Err(e) => {
                note(&errors, format!("{name} BEGIN IMMEDIATE: {e}"));
                continue;
            }
        };
        if let Err(e) = tx.execute(
            "INSERT INTO orders (writer, n, note) VALUES (?1, ?2, 'placed')",
            params![name, seq],
        ) {
            note(&errors, format!("{name} INSERT INTO orders: {e}"));
            continue;
        }
        let mut batch = Vec::new();
        let mut failed = false;
        for _ in 0..rng.usize(1..=5) {
            let key = (rng.u8(..2) == 0).then(|| format!("{name}-{}", rng.usize(..8)));
            match outbox.enqueue_rusqlite(&tx, check::message(seq, key.as_deref())) {
                Ok(id) => batch.push(Expected { id, seq, key }),
                Err(e) => {
                    note(&errors, format!("{name} enqueue_rusqlite: {e}"));
                    failed = true;
                    break;
                }
            }
            seq += 1;
        }
        if failed {
            continue;
        }
        // Now and then a slow business transaction holds the write lock for
        // a while, as real applications do; everyone else must wait, not fail.
        if rng.u8(..40) == 0 {
            std::thread::sleep(Duration::from_millis(rng.u64(20..=80)));
        }
        match tx.commit() {
            Ok(()) => committed.extend(batch),
            Err(e) => note(&errors, format!("{name} COMMIT: {e}")),
        }
    }
    committed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_and_relays_on_one_file_see_no_busy_errors() {
    let seed = check::seed();
    eprintln!("contention seed: {seed} (rerun with OUTBOX_FAULTS_SEED={seed})");
    let run_for = if check::soak() {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(4)
    };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let store = SqliteStore::connect(&db).await.unwrap();
    store.migrate().await.unwrap();
    open_connection(&db)
        .unwrap()
        .execute_batch(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, writer TEXT NOT NULL,
                                  n INTEGER NOT NULL, note TEXT NOT NULL)",
        )
        .unwrap();

    // Relay 1: in this process, its store wrapped to count errors; its
    // handler writes into the same file.
    let counted = CountingStore::new(store.clone(), "in-process");
    let receiver = Receiver::open(&db, "faults", "in-process", Duration::ZERO)
        .await
        .unwrap();
    let mut config = RelayConfig::default();
    config.worker_id = "in-process".into();
    config.batch_size = 50;
    config.lease = Duration::from_secs(60);
    config.handler_timeout = Duration::from_secs(30);
    config.poll_interval = Duration::from_millis(100);
    config.concurrency = 16;
    let relay = Relay::builder_shared(Arc::new(counted.clone()))
        .dispatcher(receiver.clone())
        .config(config)
        .spawn()
        .unwrap();
    // Relay 2: a child process.
    let mut args = ChildArgs::new(&db, &db, "child");
    args.lease = Duration::from_secs(60);
    args.handler_timeout = Duration::from_secs(30);
    args.poll_interval = Duration::from_millis(100);
    let log = dir.path().join("child.log");
    let exe = Path::new(env!("CARGO_BIN_EXE_relay-child"));
    let mut child = RelayChild::spawn(exe, &args, &log).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let errors: Errors = Arc::default();
    let started = Instant::now();
    let w1 = tokio::spawn(sqlx_writer(
        "sqlx-a".into(),
        db.clone(),
        store.clone(),
        stop.clone(),
        errors.clone(),
        seed,
    ));
    let w2 = tokio::spawn(sqlx_writer(
        "sqlx-b".into(),
        db.clone(),
        store.clone(),
        stop.clone(),
        errors.clone(),
        seed ^ 1,
    ));
    let w3 = {
        let (db, store, stop, errors) = (db.clone(), store.clone(), stop.clone(), errors.clone());
        std::thread::spawn(move || {
            rusqlite_writer("rusqlite".into(), db, store, stop, errors, seed ^ 2)
        })
    };
    tokio::time::sleep(run_for).await;
    stop.store(true, Ordering::Relaxed);
    let mut expected = w1.await.unwrap();
    expected.extend(w2.await.unwrap());
    expected.extend(w3.join().unwrap());
    let writing = started.elapsed();

    let conn = open_connection(&db).unwrap();
    check::wait_until("the outbox to drain", Duration::from_secs(120), || {
        pending(&conn) == 0
    })
    .await;
    let elapsed = started.elapsed();
    relay.until_idle().await.unwrap();
    relay.shutdown().await;
    child.stop(Duration::from_secs(10)).unwrap();

    let orders: i64 = conn
        .query_row("SELECT COUNT(*) FROM orders", [], |r| r.get(0))
        .unwrap();
    let report = verify(&db, &db, &expected);
    let app_errors = errors.lock().unwrap().clone();
    let store_errors = counted.errors();
    let handler_errors = receiver.errors();
    let child_problems = log_problems(&log);
    eprintln!(
        "contention: writing {writing:.2?} ({} orders, {} messages at {:.0} msg/s), \
         drained after {elapsed:.2?}; per relay={:?} duplicates={}; errors: app={} \
         relay store={} handler={} child={} seed={seed}",
        orders,
        expected.len(),
        expected.len() as f64 / writing.as_secs_f64(),
        report.per_worker,
        report.duplicates,
        app_errors.len(),
        store_errors.len(),
        handler_errors.len(),
        child_problems.len()
    );
    assert!(
        app_errors.is_empty(),
        "seed {seed}: errors reached the application:\n{}",
        app_errors.join("\n")
    );
    assert!(
        store_errors.is_empty(),
        "seed {seed}: errors reached the in-process relay from its store:\n{}",
        store_errors.join("\n")
    );
    assert!(
        handler_errors.is_empty(),
        "seed {seed}: the in-process handler failed:\n{}",
        handler_errors.join("\n")
    );
    assert!(
        child_problems.is_empty(),
        "seed {seed}: the child relay reported problems:\n{}",
        child_problems.join("\n")
    );
    report.assert_exactly_once(&format!("seed {seed}"));
    assert_eq!(
        report.duplicates, 0,
        "seed {seed}: delivered twice while leases held"
    );
    assert!(
        expected.len() > 100,
        "seed {seed}: the writers barely wrote"
    );
}
