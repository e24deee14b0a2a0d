//! PostgreSQL specifics beyond the conformance suite: bad input, migrations,
//! per-key locks, batches, the inbox, wake-up. Each test on a fresh schema.

use std::time::Duration;

use outbox_api::testing::StoreUnderTest;
use outbox_api::testing::wait_until;
use outbox_api::{
    ErrorKind, MessageKind, MessageState, NewMessage, OperatorStore, Store, Timestamp,
};
use outbox_postgres::sqlx::{self, postgres::PgListener};
use outbox_postgres::testing::{
    PgUnderTest, claim_request as claim, database_url, listens, payloads, plan_buffers,
    test_message as msg, unique_schema,
};
use outbox_postgres::{PgStore, WakeUp};

#[tokio::test]
async fn bad_schema_or_table_name_is_a_config_error_naming_it() {
    // Nothing listens on port 1: the names are refused before connecting.
    let url = "postgres://u:s3cret@127.0.0.1:1/test";
    let cases = [
        (PgStore::builder(url).table("x; DROP TABLE y"), "`table`"),
        (PgStore::builder(url).table("Orders"), "`table`"),
        (PgStore::builder(url).table("a".repeat(49)), "`table`"),
        (PgStore::builder(url).inbox_table("in-box"), "`inbox_table`"),
        (PgStore::builder(url).schema("pg_catalog"), "`schema`"),
        (PgStore::builder(url).schema("my schema"), "`schema`"),
        (PgStore::builder(url).schema(""), "`schema`"),
    ];
    for (builder, field) in cases {
        let err = builder.connect().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(err.to_string().contains(field), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}

#[tokio::test]
async fn unreachable_database_names_it_and_hides_the_password() {
    let builder = PgStore::builder("postgres://outbox:s3cret@127.0.0.1:1/shop")
        .connect_timeout(Duration::from_secs(2));
    assert!(!format!("{builder:?}").contains("s3cret"), "{builder:?}");
    let err = builder.connect().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.is_retryable());
    let text = err.to_string();
    assert!(
        text.contains("postgres://outbox:***@127.0.0.1:1/shop"),
        "{text}"
    );
    assert!(
        !text.contains("s3cret") && !format!("{err:?}").contains("s3cret"),
        "{err:?}"
    );

    let err = PgStore::connect("postgres://outbox:s3cret@127.0.0.1:notaport/shop")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(!format!("{err} {err:?}").contains("s3cret"), "{err:?}");
}

#[tokio::test]
async fn the_password_is_never_in_debug_output() {
    // Trust authentication ignores the password, so the store connects.
    let url = database_url().replacen("postgres://postgres@", "postgres://postgres:s3cret@", 1);
    let store = PgStore::builder(url.clone())
        .schema(unique_schema("outbox_pw"))
        .connect()
        .await
        .unwrap();
    let text = format!("{store:?} {:?}", store.outbox());
    assert!(!text.contains("s3cret"), "{text}");
    assert!(text.contains("127.0.0.1"), "{text}");
}

#[tokio::test]
async fn using_an_unmigrated_table_says_to_migrate() {
    let schema = unique_schema("outbox_unmigrated");
    let store = PgStore::builder(database_url())
        .schema(schema.clone())
        .connect()
        .await
        .unwrap();
    let err = store.claim(&claim(10)).await.unwrap_err();
    assert!(err.to_string().contains("PgStore::migrate()"), "{err}");
    assert!(
        err.to_string().contains(&format!("{schema}.outbox")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_from_several_processes_at_once_apply_once() {
    let f = PgUnderTest::fresh(None).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let builder = PgStore::builder(f.url())
            .schema(f.schema())
            .table("other_outbox")
            .inbox_table("other_inbox");
        tasks.push(tokio::spawn(async move {
            let store = builder.connect().await?;
            store.migrate().await?;
            store.migrate().await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let versions: Vec<(String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        r#"SELECT table_name, version FROM "{}".outbox_schema_versions ORDER BY 1"#,
        f.schema()
    )))
    .fetch_all(f.pool())
    .await
    .unwrap();
    assert_eq!(
        versions,
        [
            ("other_inbox".into(), 1),
            ("other_outbox".into(), 4),
            ("test_inbox".into(), 1),
            ("test_outbox".into(), 4)
        ]
    );
    let options: Option<Vec<String>> = sqlx::query_scalar(
        "SELECT reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = 'other_outbox'",
    )
    .bind(f.schema())
    .fetch_one(f.pool())
    .await
    .unwrap();
    let options = options.unwrap_or_default();
    for setting in [
        "autovacuum_vacuum_scale_factor=0.01",
        "autovacuum_vacuum_cost_delay=0",
    ] {
        assert!(options.iter().any(|o| o == setting), "{options:?}");
    }
}

/// Waits until a connection of `f`'s waits on a lock (as PostgreSQL shows
/// it in `pg_stat_activity`), or fails saying `what` did not happen.
async fn waits_on_a_lock(f: &PgUnderTest, what: &str) {
    wait_until(what, Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
        )
        .bind(f.schema())
        .fetch_one(f.pool())
        .await
        .unwrap()
            >= 1
    })
    .await;
}

/// Two transactions enqueueing one key take turns: the second waits at its
/// enqueue until the first commits, so `seq` order is commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_enqueues_take_turns_so_its_order_is_commit_order() {
    let f = PgUnderTest::fresh(None).await;
    let outbox = f.pg().outbox();
    let mut first = f.pool().begin().await.unwrap();
    outbox.enqueue(&mut first, msg(1).key("k")).await.unwrap();

    // A keyless message and another key are not held up.
    let mut other = f.pool().begin().await.unwrap();
    outbox.enqueue(&mut other, msg(2)).await.unwrap();
    outbox.enqueue(&mut other, msg(3).key("j")).await.unwrap();
    other.commit().await.unwrap();

    let (pool, o) = (f.pool().clone(), outbox.clone());
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        o.enqueue(&mut tx, msg(4).key("k")).await.unwrap();
        tx.commit().await.unwrap();
    });
    waits_on_a_lock(
        &f,
        "the second enqueue of the key waits for the first transaction",
    )
    .await;
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    second.await.unwrap();
    let claimed = f.pg().claim(&claim(10)).await.unwrap();
    let keyed: Vec<String> = payloads(&claimed)
        .into_iter()
        .filter(|p| p == "1" || p == "4")
        .collect();
    assert_eq!(keyed, ["1", "4"], "the key's messages in commit order");
}

#[tokio::test]
async fn enqueue_many_writes_a_batch_in_one_statement_in_order() {
    let f = PgUnderTest::fresh(None).await;
    let outbox = f.pg().outbox();
    let mut tx = f.pool().begin().await.unwrap();
    let ids = outbox
        .enqueue_many(
            &mut tx,
            vec![
                msg(1).key("b"),
                msg(2).key("a"),
                msg(3),
                msg(4).key("b"),
                NewMessage::new(MessageKind::Integration, "Out", b"5".to_vec())
                    .destination("shop", "out")
                    .header("x-h", "v"),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids.len(), 5);
    let claimed = f.pg().claim(&claim(10)).await.unwrap();
    assert_eq!(payloads(&claimed), ["1", "2", "3", "4", "5"]);
    assert_eq!(claimed.iter().map(|m| m.id).collect::<Vec<_>>(), ids);
    assert_eq!(claimed[4].headers.get("x-h").map(String::as_str), Some("v"));
    assert_eq!(claimed[4].destination.as_ref().unwrap().exchange, "shop");

    // One invalid message refuses the batch, naming it; nothing is written.
    let mut tx = f.pool().begin().await.unwrap();
    let err = outbox
        .enqueue_many(&mut tx, vec![msg(6), msg(7).key(" ")])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("message 1 of the batch"), "{err}");
    tx.commit().await.unwrap();
    assert_eq!(f.pg().stats().await.unwrap().pending, 5);

    // An id that exists already is a conflict naming it.
    let mut tx = f.pool().begin().await.unwrap();
    let err = outbox
        .enqueue_many(&mut tx, vec![msg(8), msg(9).with_id(ids[0])])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.to_string().contains(&ids[0].to_string()), "{err}");
    assert!(
        outbox
            .enqueue_many(&mut tx, vec![])
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_turns_duplicates_into_one_effect_and_is_purged_in_batches() {
    let f = PgUnderTest::fresh(None).await;
    let outbox = f.pg().outbox();
    let id = outbox_api::MessageId::new();
    let mut a = f.pool().begin().await.unwrap();
    assert!(outbox.try_receive(&mut a, "billing", id).await.unwrap());
    // A second receiver of the same message waits for the first's commit.
    let (pool, o) = (f.pool().clone(), outbox.clone());
    let b = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let fresh = o.try_receive(&mut tx, "billing", id).await.unwrap();
        tx.commit().await.unwrap();
        fresh
    });
    waits_on_a_lock(&f, "the second receiver waits for the first's commit").await;
    assert!(!b.is_finished());
    a.commit().await.unwrap();
    assert!(!b.await.unwrap(), "a duplicate once the first committed");
    let mut c = f.pool().begin().await.unwrap();
    assert!(
        outbox.try_receive(&mut c, "shipping", id).await.unwrap(),
        "another consumer"
    );
    c.commit().await.unwrap();

    let mut tx = f.pool().begin().await.unwrap();
    for _ in 0..7 {
        outbox
            .try_receive(&mut tx, "bulk", outbox_api::MessageId::new())
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let later = Timestamp::now().saturating_add(Duration::from_secs(1));
    let inbox = outbox_postgres::PgInbox::new(f.pg().outbox(), f.pool().clone());
    let purge = |limit| outbox_api::Inbox::purge(&inbox, later, limit);
    assert_eq!(purge(3).await.unwrap(), 3);
    let rest = outbox_api::backend::purge_in_batches(2, || false, purge).await;
    assert_eq!(rest.unwrap(), 6);
    assert_eq!(purge(10).await.unwrap(), 0);
}

#[tokio::test]
async fn a_corrupt_row_poisons_only_itself() {
    let f = PgUnderTest::fresh(None).await;
    f.enqueue(vec![msg(1).key("k"), msg(2).key("k"), msg(3)])
        .await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"UPDATE "{}".test_outbox SET headers = '"not an object"' WHERE payload = '\x31'"#,
        f.schema()
    )))
    .execute(f.pool())
    .await
    .unwrap();
    let claimed = f.pg().claim(&claim(10)).await.unwrap();
    assert_eq!(
        payloads(&claimed),
        ["3"],
        "k's second message waits behind the corrupt first"
    );
    let poisoned = f
        .pg()
        .list(&outbox_api::ListQuery::new().state(MessageState::Poisoned))
        .await
        .unwrap();
    assert_eq!(payloads(&poisoned), ["1"]);
    let note = poisoned[0].last_error.clone().unwrap();
    assert!(note.contains("headers"), "{note}");
}

/// The fixture's store's listener, listening, with the change its first
/// connection reports (a catch-up claim) taken.
async fn quiet_listener(f: &PgUnderTest) -> Box<dyn outbox_api::WorkListener> {
    let mut listener = f.pg().listen();
    assert!(listener.wait(Duration::from_secs(10)).await);
    listens(f.pool(), f.schema()).await;
    while listener.wait(Duration::from_millis(50)).await {}
    listener
}

/// Counts, in `pg_locks`, the requests for the own lock of transaction
/// `xid` (see `own_lock::OWN_LOCK`): held exclusively, and waiting (shared).
async fn own_lock_requests(pool: &sqlx::PgPool, xid: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE granted AND mode = 'ExclusiveLock'), \
                count(*) FILTER (WHERE NOT granted AND mode = 'ShareLock') \
         FROM pg_locks WHERE locktype = 'advisory' AND classid = 1868723320 \
           AND objid::int8 = $1 AND objsubid = 2",
    )
    .bind(xid % (1 << 31))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A transaction on `pool` that has enqueued one message into `store`'s
/// outbox and stays open, and its id.
async fn enqueue_and_stay_open(
    pool: &sqlx::PgPool,
    store: &PgStore,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, i64) {
    let mut tx = pool.begin().await.unwrap();
    store.outbox().enqueue(&mut tx, msg(1)).await.unwrap();
    let xid = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    (tx, xid)
}

/// Waits for a notification on `listener`, or `None` after `within`.
async fn notified(listener: &mut PgListener, within: Duration) -> bool {
    tokio::time::timeout(within, listener.recv()).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_processes_hear_of_a_commit_after_it_never_from_inside_it() {
    let f = PgUnderTest::fresh(None).await;
    let mut raw = PgListener::connect(f.url()).await.unwrap();
    raw.listen(&f.pg().channel()).await.unwrap();
    let mut tx = f.pool().begin().await.unwrap();
    f.pg().outbox().enqueue(&mut tx, msg(1)).await.unwrap();
    assert!(
        !notified(&mut raw, Duration::from_millis(300)).await,
        "nothing is announced before the commit"
    );
    tx.commit().await.unwrap();
    assert!(
        notified(&mut raw, Duration::from_secs(5)).await,
        "the commit is announced"
    );
    // A rolled-back enqueue is never announced.
    let mut tx = f.pool().begin().await.unwrap();
    f.pg().outbox().enqueue(&mut tx, msg(2)).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(!notified(&mut raw, Duration::from_millis(300)).await);
}

/// An enqueuing transaction holds an advisory lock on its own id until it
/// ends, and the commit watcher waits for that lock instead of asking
/// after the transaction again and again: while the transaction is open,
/// `pg_locks` shows the lock held by it and the watcher's request for it
/// waiting; the commit is then announced. The watcher waits at most 100 ms
/// for one transaction, so each of up to five attempts (a transaction
/// each) looks for the waiting request for a second; one sighting passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_watcher_waits_for_the_enqueuing_transactions_own_lock() {
    let f = PgUnderTest::fresh(None).await;
    let mut raw = PgListener::connect(f.url()).await.unwrap();
    raw.listen(&f.pg().channel()).await.unwrap();
    let mut seen_waiting = false;
    for _attempt in 0..5 {
        let (tx, xid) = enqueue_and_stay_open(f.pool(), f.pg()).await;
        let started = tokio::time::Instant::now();
        while !seen_waiting && started.elapsed() < Duration::from_secs(1) {
            let (held, waiting) = own_lock_requests(f.pool(), xid).await;
            assert_eq!(held, 1, "the enqueuing transaction holds its own lock");
            seen_waiting = waiting == 1;
        }
        tx.commit().await.unwrap();
        assert!(
            notified(&mut raw, Duration::from_secs(5)).await,
            "the commit is announced"
        );
        if seen_waiting {
            break;
        }
    }
    assert!(
        seen_waiting,
        "the watcher's request for the transaction's lock was never seen waiting"
    );
}

/// A store whose pool has one connection (a fleet's pinned pool) never
/// holds it in a wait, which would stall its relays' claims behind an open
/// application transaction: the watcher only looks, and the commit is
/// still announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_one_connection_is_never_held_by_the_watchers_wait() {
    let f = PgUnderTest::fresh(None).await;
    let store = f.second_store(1).await;
    let mut raw = PgListener::connect(f.url()).await.unwrap();
    raw.listen(&store.channel()).await.unwrap();
    let (tx, xid) = enqueue_and_stay_open(f.pool(), &store).await;
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_millis(300) {
        let (_, waiting) = own_lock_requests(f.pool(), xid).await;
        assert_eq!(
            waiting, 0,
            "the store's only connection waits for the transaction"
        );
    }
    tx.commit().await.unwrap();
    assert!(
        notified(&mut raw, Duration::from_secs(5)).await,
        "the commit is announced"
    );
}

/// An application's writers may run on a runtime of their own that ends
/// right after their last commit: that commit still wakes the store's
/// relays (whose poll here is an hour), since the commit watcher runs on
/// the runtime the store was built on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_a_runtime_that_ends_right_after_it_wakes_the_relays() {
    let f = PgUnderTest::fresh_with(None, |b| b.poll_interval(Duration::from_secs(3600))).await;
    let mut listener = quiet_listener(&f).await;
    let (outbox, url) = (f.pg().outbox(), f.url().to_owned());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await
                .unwrap();
            let mut tx = pool.begin().await.unwrap();
            outbox.enqueue(&mut tx, msg(1)).await.unwrap();
            tx.commit().await.unwrap();
        });
        // The writers' runtime ends here.
    })
    .join()
    .unwrap();
    assert!(
        listener.wait(Duration::from_secs(10)).await,
        "the last commit of a runtime that has ended must wake the relays"
    );
}

/// An enqueue in a savepoint that is rolled back leaves the transaction
/// watched: its later enqueue and commit are announced, and the rolled-back
/// message is never seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_a_rolled_back_savepoint_is_announced() {
    let f = PgUnderTest::fresh(None).await;
    let mut raw = PgListener::connect(f.url()).await.unwrap();
    raw.listen(&f.pg().channel()).await.unwrap();
    let mut tx = f.pool().begin().await.unwrap();
    let mut savepoint = sqlx::Acquire::begin(&mut *tx).await.unwrap();
    f.pg()
        .outbox()
        .enqueue(&mut savepoint, msg(1))
        .await
        .unwrap();
    savepoint.rollback().await.unwrap();
    assert!(
        !notified(&mut raw, Duration::from_millis(300)).await,
        "nothing is announced while the transaction is open"
    );
    f.pg().outbox().enqueue(&mut tx, msg(2)).await.unwrap();
    assert!(!notified(&mut raw, Duration::from_millis(100)).await);
    tx.commit().await.unwrap();
    assert!(
        notified(&mut raw, Duration::from_secs(5)).await,
        "the commit is announced"
    );
    let pending = f
        .pg()
        .list(&outbox_api::ListQuery::new().state(MessageState::Pending))
        .await
        .unwrap();
    assert_eq!(payloads(&pending), ["2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_are_debounced() {
    let f = PgUnderTest::fresh_with(None, |b| b.notify_debounce(Duration::from_millis(200))).await;
    let mut raw = PgListener::connect(f.url()).await.unwrap();
    raw.listen(&f.pg().channel()).await.unwrap();
    let started = tokio::time::Instant::now();
    for n in 0..20 {
        f.enqueue(vec![msg(n)]).await;
    }
    // Twenty commits in well under a second, then the last one's notice.
    let mut heard = 0;
    while notified(&mut raw, Duration::from_millis(600)).await {
        heard += 1;
    }
    let allowed = started.elapsed().as_millis() / 200 + 1;
    assert!(
        (1..=allowed as usize).contains(&heard),
        "{heard} notifications in {:?}",
        started.elapsed()
    );
}

/// Another process's commit wakes a listener through `LISTEN`/`NOTIFY`:
/// the listener's poll is an hour, so nothing but a notification can wake
/// it within the deadline, and the commit comes from a second store on the
/// same table (its own pools and in-process signals, as another process
/// has). How long it took is printed (the bench measures it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_processs_commit_wakes_a_listener_through_notify_not_polling() {
    let f = PgUnderTest::fresh_with(None, |b| b.poll_interval(Duration::from_secs(3600))).await;
    let mut listener = quiet_listener(&f).await;
    let other = f.second_store(2).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(f.url())
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut tx = pool.begin().await.unwrap();
    other.outbox().enqueue(&mut tx, msg(1)).await.unwrap();
    tx.commit().await.unwrap();
    assert!(
        listener.wait(Duration::from_secs(10)).await,
        "another process's commit must wake the listener (its poll is an hour)"
    );
    eprintln!(
        "another process's commit → listener woken: {:?}",
        started.elapsed()
    );
    // A rolled-back enqueue wakes nobody.
    while listener.wait(Duration::from_millis(50)).await {}
    let mut tx = pool.begin().await.unwrap();
    other.outbox().enqueue(&mut tx, msg(2)).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(
        !listener.wait(Duration::from_millis(500)).await,
        "a rollback notifies nobody"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_reports_a_change_after_reconnecting_and_hears_other_processes() {
    // An hour's poll: only a notification (or a reconnect) wakes it.
    let f = PgUnderTest::fresh_with(None, |b| b.poll_interval(Duration::from_secs(3600))).await;
    let mut listener = f.pg().listen();
    // Its first connection reports a change (a catch-up claim).
    assert!(listener.wait(Duration::from_secs(10)).await);
    while listener.wait(Duration::from_millis(50)).await {}
    // Another process's NOTIFY wakes it.
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(f.pg().channel())
        .execute(f.pool())
        .await
        .unwrap();
    assert!(listener.wait(Duration::from_secs(10)).await);
    // Its connection is cut: it reports a change, reconnects, listens again.
    let cut: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(f.schema())
    .fetch_all(f.pool())
    .await
    .unwrap();
    assert_eq!(cut, [true], "one LISTEN connection");
    assert!(listener.wait(Duration::from_secs(10)).await);
    listens(f.pool(), f.schema()).await;
    while listener.wait(Duration::from_millis(50)).await {}
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(f.pg().channel())
        .execute(f.pool())
        .await
        .unwrap();
    assert!(listener.wait(Duration::from_secs(10)).await);
}

#[tokio::test]
async fn poll_only_reports_a_change_every_poll_interval_and_never_listens() {
    let f = PgUnderTest::fresh_with(None, |b| {
        b.wake_up(WakeUp::PollOnly)
            .poll_interval(Duration::from_millis(50))
    })
    .await;
    let mut listener = f.pg().listen();
    let started = tokio::time::Instant::now();
    assert!(listener.wait(Duration::from_secs(10)).await);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        !listener.wait(Duration::from_millis(10)).await,
        "a wait shorter than the poll interval times out"
    );
    // In-process commits still wake it at once.
    f.enqueue(vec![msg(1)]).await;
    let started = tokio::time::Instant::now();
    assert!(listener.wait(Duration::from_secs(10)).await);
    assert!(started.elapsed() < Duration::from_secs(5));
    let listening: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(f.schema())
    .fetch_one(f.pool())
    .await
    .unwrap();
    assert_eq!(listening, 0);
}

/// The claim walks the pending index in `seq` order and checks a key's other
/// messages through the key index: work in proportion to the batch, not to
/// the table (thousands of processed rows here).
#[tokio::test]
async fn the_claim_plan_uses_the_partial_indexes() {
    let f = PgUnderTest::fresh(None).await;
    let outbox = f.pg().outbox();
    for chunk in 0..10 {
        let mut tx = f.pool().begin().await.unwrap();
        outbox
            .enqueue_many(
                &mut tx,
                (0..500)
                    .map(|n| msg(chunk * 500 + n).key(format!("k{}", n % 50)))
                    .collect(),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    // Half processed, a quarter leased, a quarter waiting.
    for _ in 0..5 {
        let batch = f.pg().claim(&claim(500)).await.unwrap();
        let ids: Vec<_> = batch.iter().map(|m| m.id).collect();
        f.pg().complete(&ids, Timestamp::now()).await.unwrap();
    }
    assert_eq!(f.pg().claim(&claim(1250)).await.unwrap().len(), 1250);
    let mut conn = f.pool().acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"ANALYZE "{s}".test_outbox;
           PREPARE claim_plan(text, bigint, bigint, text, bigint, bigint, bigint) AS {claim}"#,
        s = f.schema(),
        claim = f.pg().claim_statement()
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let now = Timestamp::now()
        .saturating_add(Duration::from_secs(1))
        .as_millis();
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN EXECUTE claim_plan('w', {}, {now}, NULL, 20, 0, -1)",
        now + 30_000
    )))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("test_outbox_pending_idx"), "{plan}");
    assert!(plan.contains("test_outbox_key_idx"), "{plan}");
    // With no poisoned message the two poisoned indexes cost the same; with
    // many, the one by key is cheaper. Either walks poisoned messages only.
    assert!(
        plan.contains("test_outbox_poisoned_keys") || plan.contains("test_outbox_poisoned_idx"),
        "{plan}"
    );
    // The one sequential scan is of the one-row `_retries` sequence.
    assert!(!plan.contains("Seq Scan on test_outbox "), "{plan}");
}

/// Without statistics — a backlog that grew before autovacuum analysed the
/// table, or a generic plan cached while it was small — the planner would
/// fetch every pending row, test each one's key and sort them all (2 s a
/// claim at 100k pending, found by the fault test); the claim's
/// transaction rules that out, so it walks the pending index and stops at
/// its limit.
#[tokio::test]
async fn the_claim_walks_the_pending_index_even_without_statistics() {
    let f = PgUnderTest::fresh(None).await;
    let outbox = f.pg().outbox();
    for chunk in 0..20 {
        let mut tx = f.pool().begin().await.unwrap();
        outbox
            .enqueue_many(
                &mut tx,
                (0..1000)
                    .map(|n| {
                        let m = msg(chunk * 1000 + n);
                        if n % 3 == 0 {
                            m.key(format!("k{}", n % 200))
                        } else {
                            m
                        }
                    })
                    .collect(),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let plan = f.pg().explain_claim(50).await.unwrap();
    assert!(
        plan.contains("Index Scan using test_outbox_pending_idx"),
        "{plan}"
    );
    assert!(!plan.contains("Sort"), "{plan}");
    assert!(!plan.contains("Bitmap"), "{plan}");
    // The tests for an earlier message of the candidate's key look the key
    // up; walking the pending index from the floor to each candidate,
    // filtering by key, made claims quadratic in the backlog.
    for key in ["m.key", "u.key"] {
        assert!(
            plan.contains(&format!("Index Cond: ((key = {key}) AND (seq < ")),
            "earlier messages of {key} are looked up in the key index: {plan}"
        );
        assert!(
            !plan.contains(&format!("Filter: ((key = {key})")),
            "no index walk filters by {key}: {plan}"
        );
    }
    // EXPLAIN claimed nothing.
    assert_eq!(f.pg().stats().await.unwrap().pending, 20_000);
    assert_eq!(f.pg().claim(&claim(50)).await.unwrap().len(), 50);
}

/// The claim runs one generic plan per connection, made at its first
/// claim and kept: a plan made while the table was empty and never analysed
/// must still walk the pending index to its limit once the table holds a
/// backlog. Before, the `UPDATE` joined its rows with the picked ones, and
/// that plan walked every pending row for the join (20,000 here) on every
/// claim.
#[tokio::test]
async fn a_claim_plan_made_on_an_empty_table_stays_cheap_when_it_fills() {
    let f = PgUnderTest::fresh(None).await;
    let table = format!(r#""{}".test_outbox"#, f.schema());
    let mut conn = f.pool().acquire().await.unwrap();
    // No analyse may come between the plan and its use.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"ALTER TABLE {table} SET (autovacuum_enabled = false);
           PREPARE claim_plan(text, bigint, bigint, text, bigint, bigint, bigint) AS {claim}"#,
        claim = f.pg().claim_statement()
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let now = Timestamp::now().as_millis();
    let execute = format!(
        "EXECUTE claim_plan('w', {}, {now}, NULL, 20, 0, -1)",
        now + 30_000
    );
    // The first claim, on the empty table, makes the plan.
    let (begin, rollback) = (f.pg().begin_claim_statement(), "ROLLBACK");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{begin}; {execute}; {rollback}"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO {table} (id, kind, message_type, payload, content_type,
             created_at, available_at)
           SELECT gen_random_uuid(), 'domain', 'Test', '\x00', 'text/plain', 0, 0
           FROM generate_series(1, 20000)"#
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(begin))
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS) {execute}"
    )))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql(rollback).execute(&mut *conn).await.unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("rows=20 "), "the claim took 20: {plan}");
    let buffers = plan_buffers(&plan);
    // About 100 for a walk of 20 from the index's start; the join walked
    // every pending row (about 700 buffers, 80 ms).
    assert!(
        !plan.contains("rows=20000 "),
        "no node walks the backlog: {plan}"
    );
    assert!(
        buffers < 300,
        "a claim of 20 touched {buffers} buffers: {plan}"
    );
}

/// A completion looks its messages up by id, even in a generic plan whose
/// statistics say few messages are pending: with `state = 'pending'` in its
/// condition the plan walked the whole pending index instead (700 ms a
/// completion under a long transaction, in the bench).
#[tokio::test]
async fn a_completion_looks_its_messages_up_by_id_in_a_generic_plan() {
    let f = PgUnderTest::fresh(None).await;
    // 100,000 processed messages (written directly, so that the pending
    // index never held them) and 200 pending ones.
    let mut conn = f.pool().acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "{}".test_outbox (id, kind, message_type, payload, content_type,
             created_at, available_at, state, processed_at)
           SELECT gen_random_uuid(), 'domain', 'Test', '\x00', 'text/plain', 0, 0, 'processed', 1
           FROM generate_series(1, 100000)"#,
        f.schema()
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    f.enqueue((0..200).map(msg).collect()).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"ANALYZE "{}".test_outbox;
           SET plan_cache_mode = force_generic_plan;
           PREPARE complete_plan(bigint, uuid[]) AS {}"#,
        f.schema(),
        f.pg().complete_statement()
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN EXECUTE complete_plan(1, ARRAY['00000000-0000-0000-0000-000000000000'::uuid])",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("test_outbox_id_key"), "{plan}");
    assert!(!plan.contains("pending_idx"), "{plan}");
}

/// With `announce_commits(false)` an enqueue is neither watched nor
/// notified: relays find it by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_announcements_a_commit_wakes_nobody() {
    let f = PgUnderTest::fresh_with(None, |b| b.announce_commits(false)).await;
    let mut raw = PgListener::connect(f.url()).await.unwrap();
    raw.listen(&f.pg().channel()).await.unwrap();
    let mut listener = f.pg().listen();
    // Its LISTEN connection reports a change once it is up.
    while listener.wait(Duration::from_millis(300)).await {}
    f.enqueue(vec![msg(1)]).await;
    assert!(!listener.wait(Duration::from_millis(300)).await);
    assert!(!notified(&mut raw, Duration::from_millis(100)).await);
    assert_eq!(f.pg().claim(&claim(10)).await.unwrap().len(), 1);
}

/// `synchronous_commit` as the connection sees it now.
async fn synchronous_commit(conn: &mut sqlx::PgConnection) -> String {
    sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The relay's claims and completions commit without waiting for a WAL
/// flush (docs/rules.md, "Server crash"), the setting ends with their
/// transaction (the pool's connections serve the application too), and
/// `durable_bookkeeping(true)` leaves them durable.
#[tokio::test]
async fn bookkeeping_commits_do_not_wait_for_a_flush() {
    let f = PgUnderTest::fresh(None).await;
    let durable = PgStore::builder_with_pool(f.pool().clone())
        .schema(f.schema())
        .table(f.pg().table())
        .inbox_table(f.pg().inbox_table())
        .durable_bookkeeping(true)
        .connect()
        .await
        .unwrap();
    let no_ids: Vec<outbox_postgres::sqlx::types::Uuid> = Vec::new();
    // The completion statement, completing nothing.
    let complete = async |store: &PgStore, conn: &mut sqlx::PgConnection| {
        sqlx::query(sqlx::AssertSqlSafe(store.complete_statement()))
            .bind(0_i64)
            .bind(&no_ids)
            .execute(conn)
            .await
            .unwrap();
    };
    for (store, expected) in [(f.pg(), "off"), (&durable, "on")] {
        let mut conn = f.pool().acquire().await.unwrap();
        assert_eq!(
            synchronous_commit(&mut conn).await,
            "on",
            "the session's own"
        );
        // The claim's transaction.
        sqlx::raw_sql(sqlx::AssertSqlSafe(store.begin_claim_statement()))
            .execute(&mut *conn)
            .await
            .unwrap();
        assert_eq!(synchronous_commit(&mut conn).await, expected, "claim");
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        // The completion, seen from inside a transaction.
        sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
        complete(store, &mut conn).await;
        assert_eq!(synchronous_commit(&mut conn).await, expected, "completion");
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        // Alone, in its own transaction (as the store runs it): nothing
        // stays set afterwards.
        complete(store, &mut conn).await;
        assert_eq!(
            synchronous_commit(&mut conn).await,
            "on",
            "after a completion"
        );
    }
    // And the store's own calls leave the pool's connections as they were.
    f.enqueue(vec![msg(1)]).await;
    let claimed = f.pg().claim(&claim(10)).await.unwrap();
    f.pg()
        .complete(&[claimed[0].id], Timestamp::now())
        .await
        .unwrap();
    let mut conn = f.pool().acquire().await.unwrap();
    assert_eq!(synchronous_commit(&mut conn).await, "on");
}

/// Two claims side by side: claim A has locked a key's first message and
/// not yet committed its lease; claim B, whose snapshot shows that message
/// pending and unleased, skips it — and must then take none of the key's
/// later messages (docs/decisions.md, "PostgreSQL: claims run side by
/// side"). Without the claim's last rule B took the second message while A
/// held the first.
#[tokio::test]
async fn a_claim_beside_another_never_splits_a_key() {
    let f = PgUnderTest::fresh(None).await;
    f.enqueue(vec![msg(1).key("k"), msg(2).key("k"), msg(3)])
        .await;
    let store = f.pg();
    let request = claim(1);
    let (floor, generation) = store.claim_floor();
    let mut a = f.pool().acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(store.begin_claim_statement()))
        .execute(&mut *a)
        .await
        .unwrap();
    let taken = sqlx::query(sqlx::AssertSqlSafe(store.claim_statement()))
        .bind("a")
        .bind(request.now.saturating_add(request.lease).as_millis())
        .bind(request.now.as_millis())
        .bind(None::<&str>)
        .bind(1_i64)
        .bind(floor)
        .bind(generation)
        .fetch_all(&mut *a)
        .await
        .unwrap();
    assert_eq!(taken.len(), 1, "claim A leases k's first message");
    // Claim B while A's lease is not yet committed.
    let beside = store.claim(&claim(10)).await.unwrap();
    assert_eq!(
        payloads(&beside),
        ["3"],
        "B skips k's first message (locked by A), so it leaves k's second too"
    );
    sqlx::raw_sql("COMMIT").execute(&mut *a).await.unwrap();
    // A's lease is committed now: B still takes nothing of k.
    assert!(store.claim(&claim(10)).await.unwrap().is_empty());
    let first = store
        .list(&outbox_api::ListQuery::new().state(MessageState::Pending))
        .await
        .unwrap()
        .into_iter()
        .find(|m| m.payload == b"1")
        .unwrap();
    store.complete(&[first.id], Timestamp::now()).await.unwrap();
    assert_eq!(payloads(&store.claim(&claim(10)).await.unwrap()), ["2"]);
}
