//! `RabbitConsumer` with the PostgreSQL inbox (feature `postgres-inbox`)
//! on a real broker and a real database: the SQLite inbox's promises,
//! checked again on PostgreSQL. Each test has its own queue and schema.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_api::testing::wait_until;
use outbox_api::{MessageId, MessageKind, NewMessage, Store};
use outbox_postgres::testing::PgUnderTest;
use outbox_rabbitmq::postgres::sqlx::{self, PgConnection};
use outbox_rabbitmq::testing::{TcpProxy, amqp_url, broker_addr, unique_name, url_via};
use outbox_rabbitmq::{
    ExchangeType, HandlerFuture, RabbitConsumer, Received, Topology, handler_fn,
};

mod support;
use support::Queue;

const DEADLINE: Duration = Duration::from_secs(30);

/// A fresh schema with an `effects` table beside the outbox and inbox.
async fn database() -> PgUnderTest {
    let db = PgUnderTest::fresh(None).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"CREATE TABLE "{}".effects (message_id UUID NOT NULL)"#,
        db.schema()
    )))
    .execute(db.pool())
    .await
    .unwrap();
    db
}

async fn effects(db: &PgUnderTest) -> Vec<String> {
    let mut ids: Vec<String> = sqlx::query_scalar::<_, uuid::Uuid>(sqlx::AssertSqlSafe(format!(
        r#"SELECT message_id FROM "{}".effects"#,
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .unwrap()
    .into_iter()
    .map(|u| u.to_string())
    .collect();
    ids.sort();
    ids
}

async fn inbox_rows(db: &PgUnderTest) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        r#"SELECT COUNT(*) FROM "{}"."{}""#,
        db.schema(),
        db.pg().inbox_table()
    )))
    .fetch_one(db.pool())
    .await
    .unwrap()
}

async fn effect(
    schema: &str,
    tx: &mut PgConnection,
    id: MessageId,
) -> Result<(), outbox_api::HandlerError> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"INSERT INTO "{schema}".effects (message_id) VALUES ($1)"#
    )))
    .bind(id.as_uuid())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

fn sorted(ids: &[MessageId]) -> Vec<String> {
    let mut v: Vec<String> = ids.iter().map(ToString::to_string).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_are_acked_without_the_handler_and_effects_happen_once_across_a_cut() {
    let queue = Queue::new().await;
    let db = database().await;
    let url = amqp_url();
    let proxy = TcpProxy::start(broker_addr(&url).await).await;
    let calls = Arc::new(AtomicU64::new(0));
    let (c, schema) = (Arc::clone(&calls), db.schema().to_owned());
    let handler = handler_fn(
        move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
            c.fetch_add(1, Ordering::SeqCst);
            let (id, schema) = (msg.id, schema.clone());
            Box::pin(async move { effect(&schema, tx, id).await })
        },
    );
    let consumer = RabbitConsumer::builder(url_via(&url, proxy.addr()), queue.name.as_str())
        .prefetch(8)
        .connect_timeout(Duration::from_secs(2))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
        .spawn_postgres(db.pg().outbox(), db.pool().clone(), handler)
        .await
        .expect("start the consumer");
    assert!(consumer.is_connected());

    let ids: Vec<MessageId> = (0..60).map(|_| MessageId::new()).collect();
    for id in &ids[..30] {
        queue.publish(*id).await;
    }
    // The relay sending again after an outage: the same ids, twice.
    for id in &ids[..10] {
        queue.publish(*id).await;
    }
    wait_until(
        "the first 30 and their 10 duplicates are settled",
        DEADLINE,
        || {
            let s = consumer.stats();
            async move { s.handled == 30 && s.duplicates == 10 }
        },
    )
    .await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        30,
        "duplicates never reach the handler"
    );

    proxy.cut();
    wait_until("the consumer notices the cut", DEADLINE, || {
        let up = consumer.is_connected();
        async move { !up }
    })
    .await;
    for id in &ids[30..] {
        queue.publish(*id).await;
    }
    proxy.heal();
    wait_until("everything is handled after the heal", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n >= 60 }
    })
    .await;
    let stats = consumer.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(
        effects(&db).await,
        sorted(&ids),
        "each message's effect exactly once"
    );
    assert_eq!(inbox_rows(&db).await, 60);
    consumer.shutdown().await;
    assert_eq!(queue.ready().await, 0, "every delivery was acknowledged");
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_commit_with_the_inbox_row_and_a_failure_rolls_all_back_then_dead_letters() {
    let (dlx, dlq, q) = (
        unique_name("pg-dlx"),
        unique_name("pg-dead"),
        unique_name("pg-in"),
    );
    let declarer = Queue::existing(&q).await;
    Topology::new()
        .exchange(dlx.as_str(), ExchangeType::Fanout)
        .queue(dlq.as_str())
        .bind(dlq.as_str(), dlx.as_str(), "")
        .dead_letter(q.as_str(), dlx.as_str())
        .declare_on(&declarer.channel)
        .await
        .expect("declare the topology");
    let db = database().await;
    let outbox = db.pg().outbox();
    let tries = Arc::new(AtomicU64::new(0));
    let (t, schema, o) = (Arc::clone(&tries), db.schema().to_owned(), outbox.clone());
    // Body "fail": effect + reply written, then the handler fails — always.
    // Body "flaky": the same, failing on the first try only.
    let handler = handler_fn(
        move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
            let body = String::from_utf8(msg.payload.clone()).unwrap();
            let n = if body == "flaky" {
                t.fetch_add(1, Ordering::SeqCst)
            } else {
                0
            };
            let (id, schema, o) = (msg.id, schema.clone(), o.clone());
            Box::pin(async move {
                effect(&schema, tx, id).await?;
                let reply = NewMessage::new(
                    MessageKind::Integration,
                    "Done",
                    id.to_string().into_bytes(),
                );
                o.enqueue(tx, reply).await?;
                match body.as_str() {
                    "fail" => Err(format!("{id} cannot be handled").into()),
                    "flaky" if n == 0 => Err("not yet".into()),
                    _ => Ok(()),
                }
            })
        },
    );
    let consumer = RabbitConsumer::builder(amqp_url(), q.as_str())
        .max_attempts(3)
        .retry_delay(Duration::from_millis(20))
        .spawn_postgres(outbox, db.pool().clone(), handler)
        .await
        .expect("start the consumer");
    let (ok, fail, flaky) = (MessageId::new(), MessageId::new(), MessageId::new());
    declarer.publish_with(ok, None, b"ok").await;
    declarer.publish_with(fail, None, b"fail").await;
    declarer.publish_with(flaky, None, b"flaky").await;
    wait_until("two handled, one dead-lettered", DEADLINE, || {
        let s = consumer.stats();
        async move { s.handled == 2 && s.dead_lettered == 1 }
    })
    .await;
    assert_eq!(
        effects(&db).await,
        sorted(&[ok, flaky]),
        "the failing one left no effect"
    );
    assert_eq!(inbox_rows(&db).await, 2, "nor an inbox entry");
    // One reply per committed message, none from the rolled-back tries.
    let pending = db.pg().stats().await.unwrap().pending;
    assert_eq!(
        pending, 2,
        "replies commit with the inbox row, or not at all"
    );
    let stats = consumer.stats();
    assert_eq!((stats.retried, stats.dead_lettered), (3, 1), "{stats:?}");
    wait_until(
        "the dead letter is in the dead-letter queue",
        DEADLINE,
        || {
            let d = &declarer;
            let dlq = dlq.clone();
            async move { d.ready_in(&dlq).await == 1 }
        },
    )
    .await;
    consumer.shutdown().await;
    assert_eq!(declarer.ready().await, 0);
    for queue in [&dlq, &q] {
        let _ = declarer
            .channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await;
    }
    let _ = declarer
        .channel
        .exchange_delete(dlx.as_str().into(), Default::default())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_retried_uncounted_and_never_dead_lettered() {
    // More outages than max_attempts: counted, this would dead-letter it.
    const OUTAGES: u64 = 4;
    let queue = Queue::new().await;
    let db = database().await;
    let tries = Arc::new(AtomicU64::new(0));
    let (t, schema) = (Arc::clone(&tries), db.schema().to_owned());
    let handler = handler_fn(
        move |msg: &Received, tx: &mut PgConnection| -> HandlerFuture<'_> {
            let n = t.fetch_add(1, Ordering::SeqCst) + 1;
            let (id, schema) = (msg.id, schema.clone());
            Box::pin(async move {
                effect(&schema, tx, id).await?;
                if n <= OUTAGES {
                    // The database goes away under the handler's statement.
                    sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(())
            })
        },
    );
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .max_attempts(2)
        .unavailable_backoff(Duration::from_millis(5), Duration::from_millis(40))
        .spawn_postgres(db.pg().outbox(), db.pool().clone(), handler)
        .await
        .expect("start the consumer");
    let id = MessageId::new();
    queue.publish(id).await;
    wait_until("the message is handled after the outage", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 1 }
    })
    .await;
    assert_eq!(effects(&db).await, sorted(&[id]), "handled once");
    assert_eq!(tries.load(Ordering::SeqCst), OUTAGES + 1);
    let stats = consumer.stats();
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.handled),
        (0, 0, 1),
        "no outage counted: {stats:?}"
    );
    assert_eq!(stats.deferred + stats.store_errors, OUTAGES, "{stats:?}");
    consumer.shutdown().await;
    assert_eq!(queue.ready().await, 0);
    queue.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_entries_past_retention_are_purged_while_consuming() {
    let queue = Queue::new().await;
    let db = database().await;
    let handler = handler_fn(
        |_msg: &Received, _tx: &mut PgConnection| -> HandlerFuture<'_> {
            Box::pin(async { Ok(()) })
        },
    );
    let consumer = RabbitConsumer::builder(amqp_url(), queue.name.as_str())
        .inbox_retention(Some(Duration::from_secs(2)))
        .inbox_purge_interval(Duration::from_millis(20))
        .spawn_postgres(db.pg().outbox(), db.pool().clone(), handler)
        .await
        .expect("start the consumer");
    for _ in 0..3 {
        queue.publish(MessageId::new()).await;
    }
    wait_until("three handled", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 3 }
    })
    .await;
    assert!(
        inbox_rows(&db).await > 0,
        "entries are kept while within retention"
    );
    wait_until("the inbox is purged past retention", DEADLINE, || async {
        inbox_rows(&db).await == 0
    })
    .await;
    assert!(consumer.is_running(), "the purge runs beside the consumer");
    consumer.shutdown().await;
    queue.cleanup().await;
}
