//! The inbox-aware `RabbitConsumer` against a real broker at
//! `OUTBOX_AMQP_URL` (the end-to-end tests with the relay are in the root
//! crate's `tests/rabbitmq_relay.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_api::testing::wait_until;
use outbox_api::{MessageId, TemporarilyUnavailable};
use outbox_rabbitmq::testing::{TcpProxy, amqp_url, broker_addr, url_via};
use outbox_rabbitmq::{HandlerFuture, RabbitConsumer, Received, handler_fn};
use outbox_sqlite::sqlx::{self, SqliteConnection};
use outbox_sqlite::testing::SqlxUnderTest;

const DEADLINE: Duration = Duration::from_secs(30);

mod support;
use support::Queue;

async fn database() -> SqlxUnderTest {
    let db = SqlxUnderTest::fresh(None).await;
    sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .execute(db.pool())
        .await
        .unwrap();
    db
}

async fn effects(db: &SqlxUnderTest) -> Vec<String> {
    sqlx::query_scalar("SELECT message_id FROM effects")
        .fetch_all(db.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closures_are_handlers_and_the_consumer_reconnects_after_a_cut() {
    let queue = Queue::new().await;
    let db = database().await;
    let url = amqp_url();
    let proxy = TcpProxy::start(broker_addr(&url).await).await;
    let calls = Arc::new(AtomicU64::new(0));
    let c = Arc::clone(&calls);
    let handler = handler_fn(
        move |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
            c.fetch_add(1, Ordering::SeqCst);
            let id = msg.id.to_string();
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        },
    );
    let consumer = RabbitConsumer::builder(url_via(&url, proxy.addr()), queue.name.as_str())
        .prefetch(8)
        .connect_timeout(Duration::from_secs(2))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .spawn(
            outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
            handler,
        )
        .await
        .expect("start the consumer");
    assert!(consumer.is_connected());

    let mut ids = Vec::new();
    for _ in 0..50 {
        let id = MessageId::new();
        queue.publish(id).await;
        ids.push(id);
    }
    wait_until("the first batch is handled", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n >= 50 }
    })
    .await;

    proxy.cut();
    wait_until("the consumer notices the cut", DEADLINE, || {
        let up = consumer.is_connected();
        async move { !up }
    })
    .await;
    for _ in 0..50 {
        let id = MessageId::new();
        queue.publish(id).await;
        ids.push(id);
    }
    proxy.heal();
    wait_until("everything is handled after the heal", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n >= 100 }
    })
    .await;
    let stats = consumer.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    let mut got = effects(&db).await;
    got.sort();
    let mut want: Vec<String> = ids.iter().map(ToString::to_string).collect();
    want.sort();
    assert_eq!(got, want, "each message's effect exactly once");
    consumer.shutdown().await;
    assert_eq!(queue.ready().await, 0);
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_delivery_in_flight_and_returns_the_rest() {
    let queue = Queue::new().await;
    let db = database().await;
    let started = Arc::new(tokio::sync::Notify::new());
    let s = Arc::clone(&started);
    let handler = handler_fn(
        move |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
            let id = msg.id.to_string();
            let s = Arc::clone(&s);
            Box::pin(async move {
                s.notify_one();
                tokio::time::sleep(Duration::from_millis(300)).await;
                sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        },
    );
    for _ in 0..5 {
        queue.publish(MessageId::new()).await;
    }
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .spawn(
            outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
            handler,
        )
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, started.notified())
        .await
        .expect("a handler started");
    consumer.shutdown().await;
    assert!(!consumer.is_running());
    let handled = consumer.stats().handled;
    assert_eq!(
        handled, 1,
        "the in-flight delivery finished, no new one started"
    );
    assert_eq!(effects(&db).await.len(), 1);
    // The rest (prefetched but not started) went back to the queue.
    wait_until("the rest is back in the queue", DEADLINE, || async {
        queue.ready().await == 4
    })
    .await;
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_entries_past_retention_are_purged_while_consuming() {
    let queue = Queue::new().await;
    let db = database().await;
    let outbox = db.sqlite().outbox();
    let inbox = outbox.inbox_table().to_owned();
    let handler = handler_fn(
        |_msg: &Received, _tx: &mut SqliteConnection| -> HandlerFuture<'_> {
            Box::pin(async { Ok(()) })
        },
    );
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .inbox_retention(Some(Duration::from_secs(2)))
        .inbox_purge_interval(Duration::from_millis(20))
        .spawn(
            outbox_sqlite::SqliteInbox::new(outbox, db.pool().clone()),
            handler,
        )
        .await
        .expect("start the consumer");
    let count = || {
        let (pool, inbox) = (db.pool().clone(), inbox.clone());
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM {inbox}"
            )))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    for _ in 0..3 {
        queue.publish(MessageId::new()).await;
    }
    wait_until("three handled", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 3 }
    })
    .await;
    assert!(count().await > 0, "entries are kept while within retention");
    wait_until("the inbox is purged past retention", DEADLINE, || {
        let c = count();
        async move { c.await == 0 }
    })
    .await;
    assert!(consumer.is_running(), "the purge runs beside the consumer");
    consumer.shutdown().await;
    queue.cleanup().await;
}

#[tokio::test]
async fn inbox_retention_settings_are_checked() {
    let zero = RabbitConsumer::builder("amqp://guest:secret@127.0.0.1:5672/%2f", "q")
        .inbox_retention(Some(Duration::ZERO))
        .validate()
        .unwrap_err();
    assert!(zero.to_string().contains("inbox_retention"), "{zero}");
    let interval = RabbitConsumer::builder("amqp://guest:secret@127.0.0.1:5672/%2f", "q")
        .inbox_purge_interval(Duration::ZERO)
        .validate()
        .unwrap_err();
    assert!(
        interval.to_string().contains("inbox_purge_interval"),
        "{interval}"
    );
    RabbitConsumer::builder("amqp://guest:secret@127.0.0.1:5672/%2f", "q")
        .inbox_retention(None)
        .validate()
        .expect("None keeps entries forever");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_handler_is_retried_uncounted_and_never_dead_lettered() {
    // Longer than max_attempts: counted, this would dead-letter the message.
    const OUTAGE: u64 = 6;
    let queue = Queue::new().await;
    let db = database().await;
    let tries = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let (t, a) = (Arc::clone(&tries), Arc::clone(&attempts));
    let handler = handler_fn(
        move |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
            let n = t.fetch_add(1, Ordering::SeqCst) + 1;
            a.lock().unwrap().push(msg.attempt);
            let id = msg.id.to_string();
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                if n <= OUTAGE {
                    // After a write: the rollback must undo it.
                    return Err(TemporarilyUnavailable::new("the warehouse is down").into());
                }
                Ok(())
            })
        },
    );
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .max_attempts(2)
        .unavailable_backoff(Duration::from_millis(5), Duration::from_millis(40))
        .spawn(
            outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
            handler,
        )
        .await
        .expect("start the consumer");
    let id = MessageId::new();
    queue.publish(id).await;
    wait_until("the message is handled after the outage", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 1 }
    })
    .await;
    assert_eq!(effects(&db).await, vec![id.to_string()], "handled once");
    assert_eq!(tries.load(Ordering::SeqCst), OUTAGE + 1);
    assert_eq!(
        *attempts.lock().unwrap(),
        vec![1; OUTAGE as usize + 1],
        "no try was counted as an attempt"
    );
    let stats = consumer.stats();
    assert_eq!(
        (
            stats.deferred,
            stats.retried,
            stats.dead_lettered,
            stats.handled
        ),
        (OUTAGE, 0, 0, 1),
        "{stats:?}"
    );
    consumer.shutdown().await;
    assert_eq!(queue.ready().await, 0);
    queue.cleanup().await;
}

/// The ordering test's database: `log` records each handled message's key
/// and sequence number in commit order.
async fn ordering_log() -> SqlxUnderTest {
    let db = database().await;
    sqlx::query(
        "CREATE TABLE log (n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, seq INTEGER NOT NULL)",
    )
    .execute(db.pool())
    .await
    .unwrap();
    db
}

async fn log(db: &SqlxUnderTest) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT key, seq FROM log ORDER BY n")
        .fetch_all(db.pool())
        .await
        .unwrap()
}

/// A handler logging bodies `KEY:SEQ`; `fails(key, seq)` says whether this
/// try fails.
fn logging_handler(
    fails: impl Fn(&str, i64) -> bool + Send + Sync + 'static,
) -> outbox_rabbitmq::FnHandler<
    impl for<'a> Fn(&'a Received, &'a mut SqliteConnection) -> HandlerFuture<'a> + Send + Sync,
> {
    handler_fn(
        move |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
            let body = String::from_utf8(msg.payload.clone()).unwrap();
            let (key, seq) = body.split_once(':').unwrap();
            let (key, seq) = (key.to_owned(), seq.parse::<i64>().unwrap());
            let fail = fails(&key, seq);
            Box::pin(async move {
                if fail {
                    return Err(format!("{key}:{seq} is not ready yet").into());
                }
                sqlx::query("INSERT INTO log (key, seq) VALUES (?, ?)")
                    .bind(key)
                    .bind(seq)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            })
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_holds_back_its_key_only_and_keeps_its_order() {
    let queue = Queue::new().await;
    let db = ordering_log().await;
    let k0_tries = Arc::new(AtomicU64::new(0));
    let k0 = Arc::clone(&k0_tries);
    // K:0 fails twice, then succeeds.
    let handler = logging_handler(move |key, seq| {
        key == "K" && seq == 0 && k0.fetch_add(1, Ordering::SeqCst) < 2
    });
    let retry_delay = Duration::from_millis(1500);
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .max_attempts(5)
        .retry_delay(retry_delay)
        .spawn(
            outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
            handler,
        )
        .await
        .expect("start the consumer");
    queue.publish_keyed("K", "K:0").await;
    for i in 1..=4 {
        queue.publish_keyed("K", &format!("K:{i}")).await;
        queue.publish_keyed("L", &format!("L:{}", i - 1)).await;
    }
    wait_until("all nine messages are handled", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 9 }
    })
    .await;
    let log = log(&db).await;
    let of = |k: &str| -> Vec<i64> {
        log.iter()
            .filter(|(key, _)| key == k)
            .map(|(_, seq)| *seq)
            .collect()
    };
    assert_eq!(of("K"), vec![0, 1, 2, 3, 4], "K in publish order: {log:?}");
    assert_eq!(of("L"), vec![0, 1, 2, 3], "L in publish order: {log:?}");
    // K:0 committed only after two retry delays (3 s); L did not wait.
    let k0_at = log.iter().position(|e| *e == ("K".to_owned(), 0)).unwrap();
    assert!(
        log[..k0_at].iter().filter(|(key, _)| key == "L").count() == 4,
        "L went on during K's retries: {log:?}"
    );
    assert_eq!(k0_tries.load(Ordering::SeqCst), 3);
    let stats = consumer.stats();
    assert_eq!(
        (stats.retried, stats.held_back, stats.dead_lettered),
        (2, 4, 0),
        "K:1..4 were held behind K:0: {stats:?}"
    );
    consumer.shutdown().await;
    assert_eq!(queue.ready().await, 0);
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_head_releases_the_rest_of_its_key_in_order() {
    let queue = Queue::new().await;
    let db = ordering_log().await;
    // J:0 always fails.
    let handler = logging_handler(|key, seq| key == "J" && seq == 0);
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .max_attempts(3)
        .retry_delay(Duration::from_millis(100))
        .spawn(
            outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
            handler,
        )
        .await
        .expect("start the consumer");
    for i in 0..4 {
        queue.publish_keyed("J", &format!("J:{i}")).await;
    }
    wait_until(
        "J:0 is dead-lettered and the rest handled",
        DEADLINE,
        || {
            let s = consumer.stats();
            async move { s.dead_lettered == 1 && s.handled == 3 }
        },
    )
    .await;
    assert_eq!(
        log(&db).await,
        vec![
            ("J".to_owned(), 1),
            ("J".to_owned(), 2),
            ("J".to_owned(), 3)
        ]
    );
    let stats = consumer.stats();
    assert_eq!((stats.retried, stats.held_back), (2, 3), "{stats:?}");
    consumer.shutdown().await;
    assert_eq!(queue.ready().await, 0);
    queue.cleanup().await;
}
