//! `RabbitConsumer`'s metrics against a real broker (`OUTBOX_AMQP_URL`, else
//! the local default if it answers; otherwise the test fails saying how to
//! provide one), read back from a recorder installed for this test's
//! thread only (`outbox_api::testing::TestRecorder`).

use std::time::Duration;

use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_api::MessageId;
use outbox_api::testing::{TestRecorder, wait_until};
use outbox_rabbitmq::metrics as m;
use outbox_rabbitmq::testing::{amqp_url, unique_name};
use outbox_rabbitmq::{HandlerFuture, RabbitConsumer, Received, handler_fn};
use outbox_sqlite::sqlx::{self, SqliteConnection};
use outbox_sqlite::testing::SqlxUnderTest;

const DEADLINE: Duration = Duration::from_secs(30);

#[test]
fn the_consumer_records_received_handled_duplicates_and_dead_lettered() {
    let rec = TestRecorder::new();
    rec.block_on(async {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("test connection to OUTBOX_AMQP_URL");
        let channel = connection.create_channel().await.expect("channel");
        let queue = unique_name("consumer-metrics");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("declare queue");
        let publish = |id: Option<MessageId>, body: &'static str| {
            let channel = channel.clone();
            let queue = queue.clone();
            async move {
                let mut props = BasicProperties::default();
                if let Some(id) = id {
                    props = props.with_message_id(ShortString::from(id.to_string()));
                }
                channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        body.as_bytes(),
                        props,
                    )
                    .await
                    .expect("publish")
                    .await
                    .expect("confirm");
            }
        };

        let db = SqlxUnderTest::fresh(None).await;
        sqlx::query("CREATE TABLE effects (body TEXT NOT NULL)")
            .execute(db.pool())
            .await
            .unwrap();
        // A body `fail` always fails.
        let handler = handler_fn(
            |msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
                let body = String::from_utf8_lossy(&msg.payload).into_owned();
                Box::pin(async move {
                    if body == "fail" {
                        return Err("this one always fails".into());
                    }
                    sqlx::query("INSERT INTO effects (body) VALUES (?)")
                        .bind(body)
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                })
            },
        );
        let consumer = RabbitConsumer::builder(amqp_url(), queue.as_str())
            .consumer_name("billing")
            .max_attempts(2)
            .retry_delay(Duration::from_millis(50))
            .spawn(
                outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
                handler,
            )
            .await
            .expect("start the consumer");

        let first = MessageId::new();
        publish(Some(first), "a").await;
        publish(Some(MessageId::new()), "b").await;
        publish(Some(first), "a").await; // the same message again: a duplicate
        publish(Some(MessageId::new()), "fail").await;
        publish(None, "no message id").await; // cannot be handled
        wait_until("every delivery settled", DEADLINE, || {
            let s = consumer.stats();
            async move {
                s.handled == 2 && s.duplicates == 1 && s.dead_lettered == 1 && s.invalid == 1
            }
        })
        .await;
        consumer.shutdown().await;

        let base = [
            (m::SYSTEM, "rabbitmq"),
            (m::DESTINATION, queue.as_str()),
            (m::CONSUMER_GROUP, "billing"),
        ];
        let with = |k: &'static str, v: &'static str| {
            let mut l = base.to_vec();
            l.push((k, v));
            l
        };
        assert_eq!(
            rec.counter(m::RECEIVED, &with(m::OPERATION_NAME, "receive")),
            5
        );
        assert_eq!(rec.counter(m::HANDLED, &base), 2);
        assert_eq!(rec.counter(m::DUPLICATES, &base), 1);
        assert_eq!(
            rec.counter(
                m::DEAD_LETTERED,
                &with(m::DEAD_LETTER_REASON, "handler_failed")
            ),
            1
        );
        assert_eq!(
            rec.counter(m::DEAD_LETTERED, &with(m::DEAD_LETTER_REASON, "invalid")),
            1
        );
        // One try each for a, b and the duplicate, two for `fail`.
        let tries = rec.histogram(m::PROCESS_DURATION, &with(m::OPERATION_NAME, "process"));
        assert_eq!(tries.len(), 5, "{tries:?}");
        assert!(tries.iter().all(|s| (0.0..30.0).contains(s)), "{tries:?}");

        let _ = channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    });
}
