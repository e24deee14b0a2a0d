//! An attached application connection waits for the write lock in the
//! store's short steps, within its own busy timeout (`SqliteOutbox::attach`,
//! `attach_rusqlite`; `docs/latency.md`).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use outbox_sqlite::{SqliteOutbox, SqliteStore};
use rusqlite::TransactionBehavior;
use sqlx::Connection as _;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

/// A store on a fresh file, its outbox, and the file's path.
fn store(rt: &tokio::runtime::Runtime) -> (tempfile::TempDir, SqliteOutbox, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let outbox = rt.block_on(async {
        let store = SqliteStore::connect(&path).await.unwrap();
        store.migrate().await.unwrap();
        store.outbox()
    });
    (dir, outbox, path)
}

/// How long the other connection holds the lock. SQLite's own handler
/// tries again after sleeping 1, 2 and 5 ms, so it cannot take a lock held
/// this long before 8 ms; the store's steps (50 µs, growing by 50 µs up to
/// 1 ms) take it about half a millisecond after its release.
const HOLD: Duration = Duration::from_micros(3_500);

/// The median wait the store's steps stay under, with room for a loaded
/// machine's scheduling delays (in the earlier form of this test, a 300 µs
/// hold and a 0.9 ms bound, a loaded CI run measured 0.93 ms).
const BOUND: Duration = Duration::from_millis(6);

/// Another connection that takes the write lock, holds it for [`HOLD`] and
/// commits, each time it is asked; it says when it holds the lock.
fn holder(
    path: &std::path::Path,
) -> (
    mpsc::Sender<()>,
    mpsc::Receiver<()>,
    std::thread::JoinHandle<()>,
) {
    let mut other = rusqlite::Connection::open(path).unwrap();
    let (locked_tx, locked) = mpsc::channel();
    let (next_tx, next) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        while next.recv().is_ok() {
            let held = other
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .unwrap();
            locked_tx.send(()).unwrap();
            std::thread::sleep(HOLD);
            held.commit().unwrap();
        }
    });
    (next_tx, locked, thread)
}

/// Checks that the median of 20 waits of `begin` for a lock another
/// connection holds for [`HOLD`] is under [`BOUND`] (SQLite's own handler:
/// 8 ms at least).
fn assert_short_waits(path: &std::path::Path, mut begin: impl FnMut()) {
    let (next, locked, thread) = holder(path);
    let mut waits = Vec::new();
    for _ in 0..20 {
        next.send(()).unwrap();
        locked.recv().unwrap();
        let start = Instant::now();
        begin();
        waits.push(start.elapsed());
    }
    drop(next);
    thread.join().unwrap();
    waits.sort();
    let median = waits[waits.len() / 2];
    assert!(
        median < BOUND,
        "median wait for a lock held {HOLD:?}: {median:?} (all: {waits:?})"
    );
}

/// Checks that a connection with a `busy_timeout` of 40 ms gave up after
/// about that long.
fn assert_gave_up_after_40_ms(what: &str, waited: Duration) {
    assert!(
        waited >= Duration::from_millis(40) && waited < Duration::from_millis(1500),
        "{what}, busy_timeout 40 ms: gave up after {waited:?}"
    );
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn sqlx_connection(path: &std::path::Path, busy: Duration) -> SqliteConnection {
    SqliteConnection::connect_with(
        &SqliteConnectOptions::new()
            .filename(path)
            .busy_timeout(busy),
    )
    .await
    .unwrap()
}

#[test]
fn an_attached_sqlx_connection_takes_a_short_lock_soon_after_its_release() {
    let rt = runtime();
    let (_dir, outbox, path) = store(&rt);
    let mut conn = rt.block_on(sqlx_connection(&path, Duration::from_secs(5)));
    rt.block_on(outbox.attach(&mut conn)).unwrap();
    assert_short_waits(&path, || {
        rt.block_on(async {
            let tx = conn.begin_with("BEGIN IMMEDIATE").await.unwrap();
            tx.commit().await.unwrap();
        })
    });
}

#[test]
fn an_attached_rusqlite_connection_takes_a_short_lock_soon_after_its_release() {
    let rt = runtime();
    let (_dir, outbox, path) = store(&rt);
    let mut conn = rusqlite::Connection::open(&path).unwrap();
    outbox.attach_rusqlite(&conn).unwrap();
    assert_short_waits(&path, || {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        tx.commit().unwrap();
    });
}

/// The connection's own busy timeout still holds: a lock that is never
/// released is given up on after it (not after the store's default 5 s),
/// with "database is locked".
#[test]
fn an_attached_connection_keeps_its_own_busy_timeout() {
    let rt = runtime();
    let (_dir, outbox, path) = store(&rt);
    let mut other = rusqlite::Connection::open(&path).unwrap();
    let _held = other
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();

    let mut conn = rt.block_on(sqlx_connection(&path, Duration::from_millis(40)));
    rt.block_on(outbox.attach(&mut conn)).unwrap();
    let start = Instant::now();
    let err = rt
        .block_on(conn.begin_with("BEGIN IMMEDIATE"))
        .map(|_| ())
        .unwrap_err();
    let waited = start.elapsed();
    assert!(err.to_string().contains("database is locked"), "{err}");
    assert_gave_up_after_40_ms("sqlx", waited);

    let mut raw = rusqlite::Connection::open(&path).unwrap();
    raw.busy_timeout(Duration::from_millis(40)).unwrap();
    outbox.attach_rusqlite(&raw).unwrap();
    let start = Instant::now();
    let err = raw
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map(|_| ())
        .unwrap_err();
    let waited = start.elapsed();
    assert_eq!(
        err.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy),
        "{err}"
    );
    assert_gave_up_after_40_ms("rusqlite", waited);
}
