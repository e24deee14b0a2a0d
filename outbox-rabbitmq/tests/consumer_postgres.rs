//! `RabbitConsumer` with the PostgreSQL inbox where PostgreSQL itself is
//! the point: a real outage of the database under the handler. The
//! promises every inbox keeps run on PostgreSQL in `consumer_inboxes.rs`.
//! Each test has its own queue and schema.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_api::MessageId;
use outbox_api::testing::wait_until;
use outbox_postgres::sqlx::{self, PgConnection};
use outbox_postgres::testing::PgUnderTest;
use outbox_rabbitmq::testing::amqp_url;
use outbox_rabbitmq::{HandlerFuture, RabbitConsumer, Received, handler_fn};

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
        .spawn(
            outbox_postgres::PgInbox::new(db.pg().outbox(), db.pool().clone()),
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
