//! `Topology` on a real broker: quorum queues by default, classic on
//! request, the delivery limit, and the dead-letter path with both queue
//! types (through `RabbitConsumer` too). Every test declares names of its own.

use std::time::Duration;

use lapin::options::{BasicGetOptions, BasicNackOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use outbox_api::testing::wait_until;
use outbox_api::{ErrorKind, MessageId};
use outbox_rabbitmq::testing::{amqp_url, unique_name};
use outbox_rabbitmq::{
    ExchangeType, HandlerFuture, QueueType, RabbitConsumer, Received, Topology, handler_fn,
};
use outbox_sqlite::sqlx::SqliteConnection;
use outbox_sqlite::testing::SqlxUnderTest;

mod support;
use support::Queue;

const DEADLINE: Duration = Duration::from_secs(30);

/// A queue `q` dead-lettering into `dlq` through the fanout `dlx`; `q` of
/// `kind`, the dead-letter queue quorum.
struct DeadLettering {
    q: String,
    dlx: String,
    dlq: String,
    admin: Queue,
}

impl DeadLettering {
    async fn declare(kind: QueueType, adjust: impl FnOnce(Topology, &str) -> Topology) -> Self {
        let (q, dlx, dlq) = (unique_name("q"), unique_name("dlx"), unique_name("dlq"));
        let topology = Topology::new()
            .exchange(dlx.as_str(), ExchangeType::Fanout)
            .queue(dlq.as_str())
            .bind(dlq.as_str(), dlx.as_str(), "");
        let topology = match kind {
            QueueType::Quorum => topology.queue(q.as_str()),
            QueueType::Classic => topology.classic_queue(q.as_str()),
        }
        .dead_letter(q.as_str(), dlx.as_str());
        let topology = adjust(topology, &q);
        let admin = Queue::existing(&q).await;
        topology
            .declare_on(&admin.channel)
            .await
            .expect("declare the topology");
        topology
            .declare_on(&admin.channel)
            .await
            .expect("declaring twice is fine");
        DeadLettering { q, dlx, dlq, admin }
    }

    async fn get(&self, queue: &str) -> lapin::message::BasicGetMessage {
        for _ in 0..300 {
            if let Some(got) = self
                .admin
                .channel
                .basic_get(queue.into(), BasicGetOptions::default())
                .await
                .expect("basic.get")
            {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("nothing arrived in {queue}");
    }

    async fn cleanup(self) {
        for queue in [&self.q, &self.dlq] {
            let _ = self
                .admin
                .channel
                .queue_delete(queue.as_str().into(), Default::default())
                .await;
        }
        let _ = self
            .admin
            .channel
            .exchange_delete(self.dlx.as_str().into(), Default::default())
            .await;
    }
}

/// Whether the broker counts this message's deliveries (quorum queues do).
fn delivery_count(got: &lapin::message::BasicGetMessage) -> Option<i64> {
    let headers = got.delivery.properties.headers().as_ref()?;
    match headers.inner().get("x-delivery-count")? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        other => panic!("x-delivery-count of an unexpected type: {other:?}"),
    }
}

#[tokio::test]
async fn queues_are_quorum_by_default_classic_on_request_and_both_dead_letter() {
    for kind in [QueueType::Quorum, QueueType::Classic] {
        let t = DeadLettering::declare(kind, |t, _| t).await;
        let id = MessageId::new();
        t.admin.publish_with(id, None, b"x").await;
        // Returned once: only a quorum queue counts the redelivery.
        let first = t.get(&t.q).await;
        first
            .delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
        let again = t.get(&t.q).await;
        match kind {
            QueueType::Quorum => assert_eq!(delivery_count(&again), Some(1), "{kind:?}"),
            QueueType::Classic => assert_eq!(delivery_count(&again), None, "{kind:?}"),
        }
        // Rejected without requeue: to the dead-letter queue.
        again
            .delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
        let dead = t.get(&t.dlq).await;
        assert_eq!(
            dead.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string()),
            Some(id.to_string()),
            "{kind:?}"
        );
        dead.delivery.acker.ack(Default::default()).await.unwrap();

        // The type is fixed: declaring the other one fails, naming the queue
        // and what to do.
        let other = match kind {
            QueueType::Quorum => Topology::new().classic_queue(t.q.as_str()),
            QueueType::Classic => Topology::new().queue(t.q.as_str()),
        }
        .dead_letter(t.q.as_str(), t.dlx.as_str());
        let admin = Queue::existing(&t.q).await;
        let err = other.declare_on(&admin.channel).await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&t.q) && text.contains("x-queue-type"),
            "{text}"
        );
        assert!(
            text.contains("classic_queue"),
            "says how to keep it: {text}"
        );
        t.cleanup().await;
    }
}

#[tokio::test]
async fn a_classic_queue_declared_without_arguments_is_kept_by_classic_queue() {
    let q = Queue::new().await; // declared classic, with no arguments at all
    Topology::new()
        .classic_queue(q.name.as_str())
        .declare_on(&q.channel)
        .await
        .expect("an existing classic queue is declared as it is");
    let fresh = Queue::existing(&q.name).await;
    let err = Topology::new()
        .queue(q.name.as_str())
        .declare_on(&fresh.channel)
        .await
        .expect_err("it cannot become a quorum queue");
    assert!(err.to_string().contains("x-queue-type"), "{err}");
    let q = Queue::existing(&q.name).await;
    q.cleanup().await;
}

#[tokio::test]
async fn the_delivery_limit_dead_letters_a_message_delivered_too_often() {
    const LIMIT: u32 = 2;
    let t =
        DeadLettering::declare(QueueType::Quorum, |t, q| t.delivery_limit(q, Some(LIMIT))).await;
    let id = MessageId::new();
    t.admin
        .publish_with(id, None, b"crashes its consumer")
        .await;
    // A consumer that dies holding it returns it, again and again.
    let mut deliveries = 0;
    loop {
        let got = t
            .admin
            .channel
            .basic_get(t.q.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap();
        let Some(got) = got else {
            if t.admin.ready_in(&t.dlq).await == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        deliveries += 1;
        assert!(deliveries <= LIMIT + 1, "delivered past the limit");
        got.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(deliveries >= LIMIT, "delivered {deliveries} times");
    let dead = t.get(&t.dlq).await;
    assert_eq!(
        dead.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(id.to_string())
    );
    dead.delivery.acker.ack(Default::default()).await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn bad_queue_settings_are_refused_naming_the_queue() {
    let admin = Queue::existing("unused").await;
    let q = unique_name("bad");
    let err = Topology::new()
        .classic_queue(q.as_str())
        .delivery_limit(q.as_str(), Some(3))
        .declare_on(&admin.channel)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(
        err.to_string().contains(&q) && err.to_string().contains("quorum"),
        "{err}"
    );
    let err = Topology::new()
        .delivery_limit(q.as_str(), Some(0))
        .declare_on(&admin.channel)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&q) && err.to_string().contains("at least 1"),
        "{err}"
    );
    // Nothing was declared.
    let exists = admin
        .channel
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(exists.is_err(), "no queue `{q}` was declared");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_dead_letters_a_failing_message_on_quorum_and_classic_queues() {
    for kind in [QueueType::Quorum, QueueType::Classic] {
        let t = DeadLettering::declare(kind, |t, _| t).await;
        let db = SqlxUnderTest::fresh(None).await;
        let handler = handler_fn(
            |msg: &Received, _tx: &mut SqliteConnection| -> HandlerFuture<'_> {
                let body = String::from_utf8_lossy(&msg.payload).into_owned();
                Box::pin(async move {
                    if body == "bad" {
                        return Err("this message cannot be handled".into());
                    }
                    Ok(())
                })
            },
        );
        let consumer = RabbitConsumer::builder(amqp_url(), t.q.as_str())
            .max_attempts(2)
            .retry_delay(Duration::from_millis(10))
            .spawn(
                outbox_sqlite::SqliteInbox::new(db.sqlite().outbox(), db.pool().clone()),
                handler,
            )
            .await
            .expect("start the consumer");
        let bad = MessageId::new();
        t.admin.publish_with(bad, None, b"bad").await;
        t.admin.publish_with(MessageId::new(), None, b"good").await;
        wait_until("one handled, one dead-lettered", DEADLINE, || {
            let s = consumer.stats();
            async move { s.handled == 1 && s.dead_lettered == 1 }
        })
        .await;
        let dead = t.get(&t.dlq).await;
        assert_eq!(
            dead.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string()),
            Some(bad.to_string()),
            "{kind:?}"
        );
        dead.delivery.acker.ack(Default::default()).await.unwrap();
        consumer.shutdown().await;
        assert_eq!(t.admin.ready_in(&t.q).await, 0, "{kind:?}");
        t.cleanup().await;
    }
}
