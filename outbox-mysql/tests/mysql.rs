//! MySQL/MariaDB specifics beyond the conformance suites: bad input,
//! passwords, concurrent claims of several stores, claims and enqueues
//! beside each other (no gap locks), per-key order when transactions
//! commit out of `AUTO_INCREMENT` order, wake-ups. Each test on fresh
//! tables of the test database.

use std::collections::HashSet;
use std::time::Duration;

use outbox_api::testing::{LogBuffer, wait_until};
use outbox_api::{ErrorKind, MessageId, MessageKind, NewMessage, Release, Store};
use outbox_mysql::MySqlStore;
use outbox_mysql::sqlx::{self, AssertSqlSafe, Connection, MySqlConnection};
use outbox_mysql::testing::{MySqlUnderTest, database_url, unique_prefix};

const DEADLINE: Duration = Duration::from_secs(20);

fn msg(n: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Test", n.to_string().into_bytes())
}

fn claim(worker: &str, limit: usize) -> outbox_api::ClaimRequest {
    outbox_api::ClaimRequest::new(
        worker,
        limit,
        Duration::from_secs(30),
        outbox_api::Timestamp::now().saturating_add(Duration::from_secs(1)),
    )
}

fn payloads(ms: &[outbox_api::Message]) -> Vec<String> {
    ms.iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

/// Whether some transaction of the server waits for a lock now.
///
/// InnoDB refreshes `information_schema.innodb_trx` only when it was not
/// read for 100 ms: reads any closer together keep showing the first
/// answer, so each read waits that long first.
async fn someone_waits(pool: sqlx::MySqlPool) -> bool {
    tokio::time::sleep(Duration::from_millis(150)).await;
    let n: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    n > 0
}

#[tokio::test]
async fn an_unreachable_server_and_a_missing_table_are_clear_errors() {
    let e = MySqlStore::builder("mysql://app:hunter2pw@127.0.0.1:1/shop")
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.to_string().contains("mysql://app@127.0.0.1:1/shop"),
        "{e}"
    );
    assert!(!format!("{e} {e:?}").contains("hunter2pw"), "{e:?}");

    let e = MySqlStore::builder("mariadb://nobody@127.0.0.1:3306")
        .table("Orders")
        .connect()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("`table`"), "{e}");

    let store = MySqlStore::builder(database_url())
        .table(format!("{}_never_migrated", unique_prefix("t")))
        .connect()
        .await
        .unwrap();
    let e = store.stats().await.unwrap_err();
    assert!(e.to_string().contains("run `MySqlStore::migrate()`"), "{e}");
}

#[tokio::test]
async fn passwords_stay_out_of_debug_logs_and_errors() {
    let url = database_url();
    let mut admin = MySqlConnection::connect(&url).await.unwrap();
    let user = unique_prefix("pw");
    let password = "Pw-x7Kq9-secret";
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'; \
         CREATE USER '{user}'@'localhost' IDENTIFIED BY '{password}'; \
         GRANT ALL ON test.* TO '{user}'@'%'; GRANT ALL ON test.* TO '{user}'@'localhost'"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    // Everything the store logs from here on (the setup above spells the
    // password out in its own statement).
    let (logs, _guard) = LogBuffer::capture_all();
    let host = url.split('@').nth(1).unwrap();
    let good = format!("mysql://{user}:{password}@{host}");
    let table = format!("{}_outbox", unique_prefix("t"));
    let store = MySqlStore::builder(&good)
        .table(&table)
        .inbox_table(format!("{table}_in"))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    store.outbox().enqueue(&mut tx, msg(1)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.claim(&claim("w", 10)).await.unwrap().len(), 1);
    let wrong = format!("mysql://{user}:{password}-wrong@{host}");
    let e = MySqlStore::builder(&wrong).connect().await.unwrap_err();
    assert_eq!(
        e.kind(),
        ErrorKind::Config,
        "access denied is configuration: {e}"
    );
    let everything = format!(
        "{store:?} {:?} {:?} {e} {e:?} {}",
        MySqlStore::builder(&good),
        store.outbox(),
        logs.text()
    );
    assert!(!everything.contains(password), "{everything}");
    assert!(
        everything.contains(&user),
        "the user is named: {everything}"
    );
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE `{table}`, `{table}_keys`, `{table}_in`; \
         DROP USER '{user}'@'%'; DROP USER '{user}'@'localhost'"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_stores_claiming_at_once_never_hand_out_one_message_twice() {
    let f = MySqlUnderTest::fresh(None).await;
    let mut tx = f.pool().begin().await.unwrap();
    let keyed = (0..300).map(|n| msg(n).key(format!("k{}", n % 7)));
    let all: Vec<NewMessage> = (0..300).map(msg).chain(keyed).collect();
    f.mysql().outbox().enqueue_many(&mut tx, all).await.unwrap();
    tx.commit().await.unwrap();
    let clock = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..4 {
        let store = f.second_store(2).await;
        let clock = clock.clone();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let batch = store.claim(&claim(&format!("w{w}"), 13)).await.unwrap();
                if batch.is_empty() {
                    // Nothing claimable now is not the end: a key's next
                    // message waits while another store holds its previous
                    // one. Done once nothing is pending.
                    if store.stats().await.unwrap().pending == 0 {
                        return got;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                let ids: Vec<MessageId> = batch.iter().map(|m| m.id).collect();
                for m in batch {
                    got.push((clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst), m));
                }
                store
                    .complete(&ids, outbox_api::Timestamp::now())
                    .await
                    .unwrap();
            }
        }));
    }
    let mut seen = HashSet::new();
    let mut k0 = Vec::new();
    for t in tasks {
        for (tick, m) in t.await.unwrap() {
            assert!(seen.insert(m.id), "message {} claimed twice", m.id);
            if m.key.as_deref() == Some("k0") {
                k0.push((
                    tick,
                    String::from_utf8_lossy(&m.payload)
                        .parse::<usize>()
                        .unwrap(),
                ));
            }
        }
    }
    assert_eq!(seen.len(), 600);
    // A key's next message is claimable only once its previous one was
    // completed, after the claim that returned it: in claim order, k0's
    // messages are in enqueue order, whichever store took them.
    k0.sort();
    let order: Vec<usize> = k0.iter().map(|(_, n)| *n).collect();
    assert_eq!(order, (0..300).filter(|n| n % 7 == 0).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_enqueues_do_not_wait_for_each_other() {
    let f = MySqlUnderTest::fresh(None).await;
    let outbox = f.mysql().outbox();
    let mut tx = f.pool().begin().await.unwrap();
    outbox
        .enqueue_many(&mut tx, (0..20).map(msg).collect())
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // An application transaction (REPEATABLE READ, the default) holds an
    // uncommitted enqueue: claims go on and never see it.
    let mut open = f.pool().begin().await.unwrap();
    outbox.enqueue(&mut open, msg(99)).await.unwrap();
    for _ in 0..3 {
        let batch = tokio::time::timeout(DEADLINE, f.mysql().claim(&claim("w", 5)))
            .await
            .expect("a claim beside an open enqueue finishes")
            .unwrap();
        assert_eq!(batch.len(), 5);
        assert!(!payloads(&batch).contains(&"99".to_owned()));
    }

    // A claim's locking read over the pending range, held open at READ
    // COMMITTED as the claim runs it: an enqueue commits beside it.
    let table = f.mysql().table().to_owned();
    let scan = format!(
        "SELECT seq FROM `{table}` WHERE state = 'pending' ORDER BY seq FOR UPDATE SKIP LOCKED"
    );
    let mut claimer = MySqlConnection::connect(f.url()).await.unwrap();
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .execute(&mut claimer)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(scan.clone()))
        .fetch_all(&mut claimer)
        .await
        .unwrap();
    let mut writer = MySqlConnection::connect(f.url()).await.unwrap();
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 2")
        .execute(&mut writer)
        .await
        .unwrap();
    let mut w = writer.begin().await.unwrap();
    outbox
        .enqueue(&mut w, msg(100))
        .await
        .expect("an enqueue beside a READ COMMITTED claim does not wait");
    w.commit().await.unwrap();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut claimer)
        .await
        .unwrap();

    // The same read at REPEATABLE READ locks the gaps it scanned, and the
    // enqueue waits for it until its lock wait times out (1205): what the
    // claim's isolation level avoids.
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; START TRANSACTION")
        .execute(&mut claimer)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(scan))
        .fetch_all(&mut claimer)
        .await
        .unwrap();
    let mut w = writer.begin().await.unwrap();
    let e = outbox.enqueue(&mut w, msg(101)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "a lock wait timeout: {e}");
    assert!(format!("{e:?}").contains("1205"), "{e:?}");
    w.rollback().await.unwrap();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut claimer)
        .await
        .unwrap();
    open.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_second_enqueue_waits_for_the_first_so_seq_order_is_commit_order() {
    let f = MySqlUnderTest::fresh(None).await;
    let outbox = f.mysql().outbox();
    let mut first = f.pool().begin().await.unwrap();
    outbox.enqueue(&mut first, msg(1).key("k")).await.unwrap();

    // A second transaction enqueueing the same key waits at its enqueue.
    let (o2, pool) = (outbox.clone(), f.pool().clone());
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        o2.enqueue(&mut tx, msg(2).key("k")).await.unwrap();
        tx.commit().await.unwrap();
    });
    let watcher = f.mysql().pool().clone();
    wait_until(
        "the second enqueue waits for the key's lock",
        DEADLINE,
        || someone_waits(watcher.clone()),
    )
    .await;
    // Keyless enqueues and other keys go on meanwhile, and claims too.
    let mut other = f.pool().begin().await.unwrap();
    outbox.enqueue(&mut other, msg(3)).await.unwrap();
    outbox.enqueue(&mut other, msg(4).key("j")).await.unwrap();
    other.commit().await.unwrap();
    let early = f.mysql().claim(&claim("w", 10)).await.unwrap();
    assert_eq!(payloads(&early), ["3", "4"]);
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    second.await.unwrap();
    let batch = f.mysql().claim(&claim("w", 1)).await.unwrap();
    assert_eq!(payloads(&batch), ["1"]);
    assert!(
        f.mysql().claim(&claim("w2", 10)).await.unwrap().is_empty(),
        "k's second message waits for its first"
    );
    let now = outbox_api::Timestamp::now();
    f.mysql().complete(&[batch[0].id], now).await.unwrap();
    assert_eq!(
        payloads(&f.mysql().claim(&claim("w2", 10)).await.unwrap()),
        ["2"]
    );
}

#[tokio::test]
async fn a_row_committed_below_a_leased_message_of_its_key_waits_for_it() {
    // Raw SQL that bypasses the enqueue's key lock can still commit a
    // key's message with a lower seq after a later one was claimed: the
    // claim does not hand it out while the later one is leased.
    let f = MySqlUnderTest::fresh(None).await;
    let table = f.mysql().table().to_owned();
    let mut tx = f.pool().begin().await.unwrap();
    f.mysql()
        .outbox()
        .enqueue_many(&mut tx, vec![msg(0), msg(1).key("k")])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM `{table}` WHERE `key` IS NULL"
    )))
    .execute(f.pool())
    .await
    .unwrap();
    let leased = f.mysql().claim(&claim("w1", 10)).await.unwrap();
    assert_eq!(payloads(&leased), ["1"]);
    let min_seq: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT MIN(seq) FROM `{table}`")))
        .fetch_one(f.pool())
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO `{table}` (seq, id, kind, message_type, `key`, payload, content_type, \
         created_at, available_at) SELECT ? - 1, ?, 'domain', 'Test', 'k', 'late', 'text/plain', \
         created_at, available_at FROM `{table}` WHERE seq = ?"
    )))
    .bind(min_seq)
    .bind(MessageId::new().as_uuid())
    .bind(min_seq)
    .execute(f.pool())
    .await
    .unwrap();
    assert!(
        f.mysql().claim(&claim("w2", 10)).await.unwrap().is_empty(),
        "the late row waits while k's later message is leased"
    );
    f.mysql()
        .release(&Release::new(
            "w1",
            vec![leased[0].id],
            outbox_api::Timestamp::now(),
        ))
        .await
        .unwrap();
    assert_eq!(
        payloads(&f.mysql().claim(&claim("w2", 10)).await.unwrap()),
        ["late", "1"],
        "once released, the key goes in seq order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_wakes_this_process_at_once_and_another_by_its_poll() {
    // Polls too slow to matter: only the commit watcher can wake `local`.
    let f = MySqlUnderTest::fresh_with(None, |b| {
        b.poll_interval(Duration::from_secs(60), Duration::from_secs(60))
    })
    .await;
    let mut local = f.mysql().listen();
    while local.wait(Duration::from_millis(1)).await {}
    let other = MySqlStore::builder(f.url())
        .table(f.mysql().table())
        .inbox_table(f.mysql().inbox_table())
        .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let mut remote = other.listen();
    while remote.wait(Duration::from_millis(20)).await {}

    // The transaction stays open a while: the watcher waits for its commit.
    let mut tx = f.pool().begin().await.unwrap();
    f.mysql().outbox().enqueue(&mut tx, msg(1)).await.unwrap();
    assert!(
        !local.wait(Duration::from_millis(100)).await,
        "no wake-up before the commit"
    );
    tx.commit().await.unwrap();
    let started = tokio::time::Instant::now();
    assert!(
        local.wait(Duration::from_secs(30)).await,
        "the commit wakes"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "by the watcher, not the 60 s poll: {:?}",
        started.elapsed()
    );
    assert!(
        remote.wait(Duration::from_secs(30)).await,
        "another store's listener sees the commit by its poll"
    );
}

#[tokio::test]
async fn a_claim_beside_one_holding_a_keys_first_message_does_not_take_its_second() {
    let f = MySqlUnderTest::fresh(None).await;
    let table = f.mysql().table().to_owned();
    let mut tx = f.pool().begin().await.unwrap();
    f.mysql()
        .outbox()
        .enqueue_many(&mut tx, vec![msg(1).key("k"), msg(2).key("k"), msg(3)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Another relay's claim, half-way: it has locked k's first message
    // (as its locking read does) and not yet written the lease.
    let mut other = MySqlConnection::connect(f.url()).await.unwrap();
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .execute(&mut other)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT seq FROM `{table}` WHERE `key` = 'k' ORDER BY seq LIMIT 1 FOR UPDATE"
    )))
    .fetch_all(&mut other)
    .await
    .unwrap();
    let batch = f.mysql().claim(&claim("w", 10)).await.unwrap();
    assert_eq!(
        payloads(&batch),
        ["3"],
        "k's second message is not leased while its first is held by another claim"
    );
    sqlx::raw_sql("ROLLBACK").execute(&mut other).await.unwrap();
    assert_eq!(
        payloads(&f.mysql().claim(&claim("w", 10)).await.unwrap()),
        ["1", "2"]
    );
}

#[tokio::test]
async fn connecting_to_an_existing_outbox_creates_nothing_and_names_what_is_wrong() {
    let sut = MySqlUnderTest::fresh(None).await;
    let url = database_url();
    let table = sut.mysql().table().to_owned();

    let store = MySqlStore::builder(&url)
        .table(&table)
        .connect_existing()
        .await
        .unwrap();
    assert_eq!(store.stats().await.unwrap().pending, 0);

    let missing = format!("{}_typo", sut.prefix());
    let e = MySqlStore::builder(&url)
        .table(&missing)
        .connect_existing()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.to_string()
            .contains(&format!("no outbox table `{missing}`")),
        "{e}"
    );
    assert!(
        e.to_string().contains(&table),
        "names the outboxes there are: {e}"
    );
    let exists: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE ?",
    )
    .bind(format!("{missing}%"))
    .fetch_one(sut.pool())
    .await
    .unwrap();
    assert_eq!(exists, 0, "connect_existing created nothing");

    let other = format!("{}_plain", sut.prefix());
    let view = format!("{}_view", sut.prefix());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE `{other}` (id INT PRIMARY KEY, payload BLOB); \
         CREATE VIEW `{view}` AS SELECT * FROM `{table}`"
    )))
    .execute(sut.pool())
    .await
    .unwrap();
    let e = MySqlStore::builder(&url)
        .table(&other)
        .connect_existing()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is not an outbox table"), "{e}");
    assert!(
        e.to_string().contains("message_type"),
        "names a missing column: {e}"
    );
    let e = MySqlStore::builder(&url)
        .table(&view)
        .connect_existing()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is not a table (a view)"), "{e}");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP VIEW `{view}`; DROP TABLE `{other}`"
    )))
    .execute(sut.pool())
    .await
    .unwrap();

    let no_database = url.rsplit_once('/').unwrap().0.to_owned();
    let e = MySqlStore::builder(&no_database)
        .table(&table)
        .connect_existing()
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("names no database"), "{e}");
}
