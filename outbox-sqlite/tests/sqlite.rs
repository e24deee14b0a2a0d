//! SQLite-specific behaviour: configuration errors, corrupt rows, migrations,
//! several stores on one file, wake-up latency, the inbox.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_api::{
    ClaimRequest, Enqueue, ErrorKind, MessageKind, MessageState, NewMessage, OperatorStore, Store,
    Timestamp,
};
use outbox_sqlite::SqliteStore;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

fn domain(n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Test", format!("{n}").into_bytes())
}

fn req(worker: &str, limit: usize) -> ClaimRequest {
    ClaimRequest::new(
        worker,
        limit,
        Duration::from_secs(30),
        Timestamp::now().saturating_add(Duration::from_secs(1)),
    )
}

async fn setup() -> (tempfile::TempDir, SqliteStore, SqlitePool) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(dir.path().join("app.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(SqliteConnectOptions::new().filename(store.path()))
        .await
        .unwrap();
    (dir, store, pool)
}

async fn enqueue_all(
    store: &SqliteStore,
    pool: &SqlitePool,
    messages: Vec<NewMessage>,
) -> Vec<outbox_api::MessageId> {
    let outbox = store.outbox();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let mut ids = Vec::new();
    for m in messages {
        ids.push(outbox.enqueue(&mut *tx, m).await.unwrap());
    }
    tx.commit().await.unwrap();
    ids
}

#[tokio::test]
async fn bad_table_name_is_a_config_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let err = SqliteStore::builder(dir.path().join("x.db"))
        .table("x; DROP TABLE y")
        .connect()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("x; DROP TABLE y"), "{err}");
    let err = SqliteStore::builder(dir.path().join("x.db"))
        .inbox_table("in-box")
        .connect()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(
        err.to_string().contains("inbox_table") && err.to_string().contains("in-box"),
        "{err}"
    );
    assert!(!dir.path().join("x.db").exists(), "nothing was created");
}

#[tokio::test]
async fn unopenable_database_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-such-dir").join("app.db");
    let err = SqliteStore::connect(&path).await.unwrap_err();
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::Unavailable);

    let garbage = dir.path().join("garbage.db");
    std::fs::write(&garbage, vec![0x42u8; 8192]).unwrap();
    let err = SqliteStore::connect(&garbage).await.unwrap_err();
    assert!(err.to_string().contains("garbage.db"), "{err}");
}

#[tokio::test]
async fn using_an_unmigrated_table_says_to_migrate() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(dir.path().join("a.db")).await.unwrap();
    let err = store.claim(&req("w", 1)).await.unwrap_err();
    assert!(err.to_string().contains("migrate"), "{err}");
}

#[tokio::test]
async fn migrate_is_idempotent_and_per_table() {
    let (_dir, store, pool) = setup().await;
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    // A second outbox in the same database, concurrently migrated twice.
    let other = SqliteStore::builder(store.path())
        .table("billing_outbox")
        .inbox_table("billing_inbox")
        .connect()
        .await
        .unwrap();
    let other2 = other.clone();
    let (a, b) = tokio::join!(other.migrate(), other2.migrate());
    a.unwrap();
    b.unwrap();
    let versions: Vec<(String, i64)> = sqlx::query_as(
        "SELECT table_name, version FROM outbox_schema_versions ORDER BY table_name",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        versions,
        [
            ("billing_inbox".into(), 1),
            ("billing_outbox".into(), 2),
            ("outbox".into(), 2),
            ("outbox_inbox".into(), 1)
        ],
        "each table at its last migration, once"
    );
    enqueue_all(&store, &pool, vec![domain(1)]).await;
    assert_eq!(
        other.stats().await.unwrap().pending,
        0,
        "the outboxes are separate"
    );
    assert_eq!(store.stats().await.unwrap().pending, 1);
}

#[tokio::test]
async fn corrupt_row_poisons_only_itself() {
    let (_dir, store, pool) = setup().await;
    let ids = enqueue_all(
        &store,
        &pool,
        vec![
            domain(1).key("k"),
            domain(2).key("k"),
            domain(3),
            domain(4).key("j"),
        ],
    )
    .await;
    sqlx::query("UPDATE outbox SET headers = 'not json' WHERE id = ?1")
        .bind(ids[0].to_string())
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE outbox SET kind = 'carrier pigeon' WHERE id = ?1")
        .bind(ids[3].to_string())
        .execute(&pool)
        .await
        .unwrap();
    let claimed = store.claim(&req("w", 10)).await.unwrap();
    let got: Vec<_> = claimed.iter().map(|m| m.id).collect();
    assert_eq!(
        got,
        [ids[2]],
        "the corrupt rows are poisoned and k's second message waits behind its first"
    );
    let bad = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(bad.state, MessageState::Poisoned);
    assert!(
        bad.last_error.as_deref().unwrap().contains("headers"),
        "{:?}",
        bad.last_error
    );
    let bad = store.get(ids[3]).await.unwrap().unwrap();
    assert_eq!(bad.state, MessageState::Poisoned);
    assert!(
        bad.last_error
            .as_deref()
            .unwrap()
            .contains("carrier pigeon"),
        "{:?}",
        bad.last_error
    );
    let waiting = store.get(ids[1]).await.unwrap().unwrap();
    assert_eq!(
        (waiting.state, waiting.locked_by),
        (MessageState::Pending, None)
    );
    // Operators still see the corrupt rows, and can discard them to unblock the key.
    let poisoned = store
        .list(&outbox_api::ListQuery::new().state(MessageState::Poisoned))
        .await
        .unwrap();
    assert_eq!(poisoned.len(), 2);
    store
        .discard(ids[0], "ops", Timestamp::now())
        .await
        .unwrap();
    let next = store.claim(&req("w2", 10)).await.unwrap();
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [ids[1]]);
}

#[test]
fn two_stores_on_one_file_never_overlap() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (_dir, store, pool) = setup().await;
        for _ in 0..4 {
            enqueue_all(&store, &pool, (0..100).map(domain).collect()).await;
        }
        let mut tasks = Vec::new();
        for w in 0..6 {
            // Each worker has its own store: its own connection.
            let s = SqliteStore::connect(store.path()).await.unwrap();
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                loop {
                    let batch = s.claim(&req(&format!("w{w}"), 7)).await.unwrap();
                    if batch.is_empty() {
                        return got;
                    }
                    got.extend(batch.iter().map(|m| m.id));
                    s.complete(
                        &batch.iter().map(|m| m.id).collect::<Vec<_>>(),
                        Timestamp::now(),
                    )
                    .await
                    .unwrap();
                }
            }));
        }
        let mut seen = HashSet::new();
        for t in tasks {
            for id in t.await.unwrap() {
                assert!(seen.insert(id), "message {id} claimed twice");
            }
        }
        assert_eq!(seen.len(), 400);
        assert_eq!(store.stats().await.unwrap().processed, 400);
    });
}

/// Measures commit → listener wake `n` times, with the listener waiting in
/// its own task while the commit happens; returns the sorted latencies
/// (from the commit call returning; zero if the wake came first).
async fn wake_latencies(
    mut listener: Box<dyn outbox_api::WorkListener>,
    n: usize,
    mut commit: impl AsyncFnMut(usize),
) -> (Vec<Duration>, Box<dyn outbox_api::WorkListener>) {
    while listener.wait(Duration::from_millis(20)).await {}
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (go_tx, mut go_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let waiter = tokio::spawn(async move {
        for i in 0..n {
            go_rx.recv().await.unwrap();
            assert!(
                listener.wait(Duration::from_secs(5)).await,
                "commit {i} must wake the listener"
            );
            tx.send(Instant::now()).unwrap();
        }
        listener
    });
    let mut out = Vec::new();
    for i in 0..n {
        go_tx.send(()).unwrap();
        // Let the listener settle into its wait.
        tokio::time::sleep(Duration::from_millis(5)).await;
        commit(i).await;
        let committed = Instant::now();
        let woke = rx.recv().await.unwrap();
        out.push(woke.saturating_duration_since(committed));
    }
    out.sort();
    (out, waiter.await.unwrap())
}

#[test]
fn commits_wake_the_listener_quickly() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (_dir, store, pool) = setup().await;
        let listener = store.listen();

        // In-process sqlx commit through the outbox handle.
        let (lat, listener) = wake_latencies(listener, 30, async |i| {
            enqueue_all(&store, &pool, vec![domain(i)]).await;
        })
        .await;
        eprintln!("in-process (sqlx) commit -> wake: p50 {:?}, max {:?}", lat[lat.len() / 2], lat[lat.len() - 1]);
        assert!(lat[lat.len() / 2] < Duration::from_millis(50), "{lat:?}");

        // A commit the process was not told about (as by another process):
        // raw SQL on a plain rusqlite connection.
        let raw = std::sync::Mutex::new(rusqlite::Connection::open(store.path()).unwrap());
        let (lat, mut listener) = wake_latencies(listener, 20, async |i| {
            raw.lock()
                .unwrap()
                .execute(
                    "INSERT INTO outbox (id, kind, message_type, payload, content_type, created_at, available_at)
                     VALUES (?1, 'domain', 'Raw', x'00', 'application/octet-stream', 0, 0)",
                    [format!("00000000-0000-7000-8000-{i:012}")],
                )
                .unwrap();
        })
        .await;
        eprintln!("other-connection commit -> wake: p50 {:?}, max {:?}", lat[lat.len() / 2], lat[lat.len() - 1]);
        assert!(lat[lat.len() / 2] < Duration::from_millis(200), "{lat:?}");
        assert!(!listener.wait(Duration::from_millis(30)).await, "no change, no wake");
        // Commits to other tables move data_version but not the outbox: no wake.
        raw.lock()
            .unwrap()
            .execute_batch("CREATE TABLE unrelated (x); INSERT INTO unrelated VALUES (1);")
            .unwrap();
        assert!(!listener.wait(Duration::from_millis(30)).await, "other tables do not wake");
    });
}

#[tokio::test]
async fn rolled_back_enqueue_hint_is_not_a_missed_wakeup() {
    let (_dir, store, pool) = setup().await;
    let mut listener = store.listen();
    while listener.wait(Duration::from_millis(10)).await {}
    // An enqueue hints the listener, but its transaction stays open for a while.
    let outbox = store.outbox();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    outbox.enqueue(&mut *tx, domain(1)).await.unwrap();
    let woke_early = listener.wait(Duration::from_millis(20)).await;
    assert!(!woke_early, "nothing is visible before the commit");
    tx.commit().await.unwrap();
    assert!(
        listener.wait(Duration::from_secs(5)).await,
        "the late commit still wakes the listener"
    );
}

#[tokio::test]
async fn inbox_deduplicates_with_both_drivers() {
    let (_dir, store, pool) = setup().await;
    let outbox = store.outbox();
    let id = outbox_api::MessageId::new();

    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert!(outbox.try_receive(&mut *tx, "billing", id).await.unwrap());
    assert!(!outbox.try_receive(&mut *tx, "billing", id).await.unwrap());
    assert!(outbox.try_receive(&mut *tx, "shipping", id).await.unwrap());
    tx.commit().await.unwrap();

    let mut conn = rusqlite::Connection::open(store.path()).unwrap();
    let tx = conn.transaction().unwrap();
    assert!(!outbox.try_receive_rusqlite(&tx, "billing", id).unwrap());
    assert!(outbox.try_receive_rusqlite(&tx, "audit", id).unwrap());
    tx.rollback().unwrap();
    let tx = conn.transaction().unwrap();
    assert!(
        outbox.try_receive_rusqlite(&tx, "audit", id).unwrap(),
        "the rollback recorded nothing"
    );
    tx.commit().unwrap();

    // Entries recorded by either driver are one inbox, purged by its `purge`.
    let inbox = outbox_sqlite::SqliteInbox::new(outbox.clone(), pool.clone());
    let later = Timestamp::now().saturating_add(Duration::from_secs(1));
    assert_eq!(outbox_api::Inbox::purge(&inbox, later, 2).await.unwrap(), 2);
    assert_eq!(
        outbox_api::Inbox::purge(&inbox, later, 10).await.unwrap(),
        1
    );
    assert_eq!(
        outbox_api::Inbox::purge(&inbox, later, 10).await.unwrap(),
        0
    );
}

/// Application code generic over `Enqueue`, as it would be unit-tested on the memory backend.
async fn place_order(
    tx: &mut impl Enqueue,
    order: u64,
) -> outbox_api::Result<outbox_api::MessageId> {
    tx.enqueue(
        NewMessage::json(MessageKind::Domain, "OrderPlaced", &order)?.key(format!("order-{order}")),
    )
    .await
}

#[tokio::test]
async fn sqlx_transaction_as_enqueue() {
    let (_dir, store, pool) = setup().await;
    let outbox = store.outbox();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let id = place_order(&mut outbox.with_sqlx(&mut tx), 7)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let m = store.get(id).await.unwrap().unwrap();
    assert_eq!(m.json::<u64>().unwrap(), 7);
    let bad = NewMessage::new(MessageKind::Domain, "", b"x".to_vec());
    let mut conn = pool.acquire().await.unwrap();
    let err = outbox.enqueue(&mut *conn, bad).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
}

#[tokio::test]
async fn claim_uses_indexes() {
    let (_dir, store, pool) = setup().await;
    let _ = store;
    let plan: Vec<(i64, i64, i64, String)> = sqlx::query_as(
        "EXPLAIN QUERY PLAN SELECT m.seq FROM outbox AS m
         WHERE m.state = 'pending' AND m.available_at <= 1
           AND (m.key IS NULL OR NOT EXISTS (
             SELECT 1 FROM outbox AS b WHERE b.key = m.key AND b.seq < m.seq AND b.state <> 'processed'))
         ORDER BY m.seq LIMIT 10",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let text: Vec<&str> = plan.iter().map(|r| r.3.as_str()).collect();
    assert!(
        text.iter().any(|t| t.contains("outbox_pending_idx")),
        "{text:?}"
    );
    assert!(
        text.iter().any(|t| t.contains("outbox_key_idx")),
        "{text:?}"
    );
    let _ = Arc::new(());
}

/// With polling effectively off, only the commit hooks can wake the
/// listener after a transaction that outlives the enqueue's hint window.
#[test]
fn attached_connections_wake_on_commit_of_long_transactions() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::builder(dir.path().join("a.db"))
            .change_poll_interval(Duration::from_secs(3600))
            .connect()
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let outbox = store.outbox();
        let hooked = outbox.clone();
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _meta| {
                let outbox = hooked.clone();
                Box::pin(async move {
                    outbox
                        .attach(conn)
                        .await
                        .map_err(|e| sqlx::Error::Configuration(Box::new(e)))
                })
            })
            .connect_with(SqliteConnectOptions::new().filename(store.path()))
            .await
            .unwrap();
        let mut listener = store.listen();
        while listener.wait(Duration::from_millis(10)).await {}

        // sqlx: enqueue, stay open past the hint window, commit.
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        outbox.enqueue(&mut *tx, domain(1)).await.unwrap();
        assert!(
            !listener.wait(Duration::from_millis(40)).await,
            "not visible before the commit"
        );
        let waiter = tokio::spawn(async move {
            let woke = listener.wait(Duration::from_secs(10)).await;
            (woke, Instant::now(), listener)
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        tx.commit().await.unwrap();
        let committed = Instant::now();
        let (woke, at, mut listener) = waiter.await.unwrap();
        assert!(woke);
        let lat = at.saturating_duration_since(committed);
        eprintln!("attached sqlx connection, long transaction: commit -> wake {lat:?}");
        assert!(lat < Duration::from_millis(500), "{lat:?}");

        // A commit that did not insert into the outbox does not wake.
        let mut conn = pool.acquire().await.unwrap();
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query("INSERT INTO orders (id) VALUES (1)")
            .execute(&mut *conn)
            .await
            .unwrap();
        drop(conn);
        assert!(
            !listener.wait(Duration::from_millis(50)).await,
            "other tables do not wake the relay"
        );

        // rusqlite, attached.
        let mut raw = rusqlite::Connection::open(store.path()).unwrap();
        raw.busy_timeout(Duration::from_secs(5)).unwrap();
        outbox.attach_rusqlite(&raw).unwrap();
        let tx = raw.transaction().unwrap();
        outbox.enqueue_rusqlite(&tx, domain(2)).unwrap();
        assert!(
            !listener.wait(Duration::from_millis(40)).await,
            "not visible before the commit"
        );
        tx.commit().unwrap();
        assert!(
            listener.wait(Duration::from_millis(500)).await,
            "the rusqlite commit hook wakes"
        );
        // A rolled-back insert does not leave the hook armed.
        let tx = raw.transaction().unwrap();
        outbox.enqueue_rusqlite(&tx, domain(3)).unwrap();
        tx.rollback().unwrap();
        raw.execute("INSERT INTO orders (id) VALUES (2)", [])
            .unwrap();
        assert!(!listener.wait(Duration::from_millis(50)).await);
    });
}

/// Pages of the WAL file at its largest: SQLite reuses the file after a
/// checkpoint, so its size is the WAL's high-water mark.
fn wal_high_water_pages(db: &std::path::Path, page_size: u64) -> u64 {
    let wal = std::path::PathBuf::from(format!("{}-wal", db.display()));
    let len = std::fs::metadata(wal).map_or(0, |m| m.len());
    len.saturating_sub(32) / (page_size + 24)
}

/// The store checkpoints the WAL in the background: while it records
/// deliveries beside an application writer, the WAL is checkpointed and
/// restarted long before SQLite's automatic checkpoint (1000 pages) would
/// run inside a commit — the application's (turned off here, so that only
/// the store can checkpoint) or the store's own. Without the background
/// checkpoint the store's own commit checkpoints at 1000 pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_is_checkpointed_in_the_background_below_sqlites_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(dir.path().join("wal.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let outbox = store.outbox();
    let mut app = rusqlite::Connection::open(store.path()).unwrap();
    app.busy_timeout(Duration::from_secs(5)).unwrap();
    app.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA wal_autocheckpoint = 0")
        .unwrap();
    let page_size: u64 = app
        .query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))
        .unwrap() as u64;
    // About 7 pages a round: the WAL passes 1000 pages four times over.
    for n in 0..600 {
        let tx = app
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .unwrap();
        outbox.enqueue_rusqlite(&tx, domain(n)).unwrap();
        tx.commit().unwrap();
        let claimed = store.claim(&req("w", 10)).await.unwrap();
        let ids: Vec<_> = claimed.iter().map(|m| m.id).collect();
        store.complete(&ids, Timestamp::now()).await.unwrap();
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    assert_eq!(store.stats().await.unwrap().processed, 600);
    let high = wal_high_water_pages(store.path(), page_size);
    assert!(
        high < 1_000,
        "the WAL reached {high} pages: it was not checkpointed in the background"
    );
}
