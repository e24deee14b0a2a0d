//! Helpers shared by the consumer tests: a test's own queue on the real
//! broker, published to as the relay publishes.

#![allow(dead_code)] // each test file uses a part

use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use outbox_api::MessageId;
use outbox_rabbitmq::KEY_HEADER;
use outbox_rabbitmq::testing::{amqp_url, unique_name};

/// A durable queue of the test's own (unique name), deleted by
/// [`cleanup`](Queue::cleanup).
pub struct Queue {
    _connection: Connection,
    pub channel: Channel,
    pub name: String,
}

impl Queue {
    pub async fn new() -> Queue {
        let (connection, channel) = connect().await;
        let name = unique_name("consumer");
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare queue");
        Queue {
            _connection: connection,
            channel,
            name,
        }
    }

    /// A queue declared by someone else (e.g. through a `Topology`).
    pub async fn existing(name: &str) -> Queue {
        let (connection, channel) = connect().await;
        Queue {
            _connection: connection,
            channel,
            name: name.to_owned(),
        }
    }

    pub async fn publish(&self, id: MessageId) {
        self.publish_with(id, None, id.to_string().as_bytes()).await;
    }

    /// Publishes `body` with ordering key `key` (header `x-outbox-key`, as
    /// the relay sends it).
    pub async fn publish_keyed(&self, key: &str, body: &str) {
        self.publish_with(MessageId::new(), Some(key), body.as_bytes())
            .await;
    }

    pub async fn publish_with(&self, id: MessageId, key: Option<&str>, body: &[u8]) {
        let mut headers = FieldTable::default();
        if let Some(key) = key {
            headers.insert(
                ShortString::from(KEY_HEADER),
                AMQPValue::LongString(LongString::from(key)),
            );
        }
        self.channel
            .basic_publish(
                "".into(),
                self.name.as_str().into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default()
                    .with_message_id(ShortString::from(id.to_string()))
                    .with_headers(headers)
                    .with_delivery_mode(2),
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
    }

    /// `queue` as the broker sees it now (a passive declare).
    async fn declared(&self, queue: &str) -> lapin::Queue {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive declare")
    }

    /// Messages ready in `queue` (not delivered to a consumer).
    pub async fn ready_in(&self, queue: &str) -> u32 {
        self.declared(queue).await.message_count()
    }

    /// Consumers the broker counts on this queue.
    pub async fn consumers(&self) -> u32 {
        self.declared(&self.name).await.consumer_count()
    }

    pub async fn ready(&self) -> u32 {
        self.ready_in(&self.name).await
    }

    pub async fn cleanup(self) {
        let _ = self
            .channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

async fn connect() -> (Connection, Channel) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("test connection to the broker (OUTBOX_AMQP_URL or the local default)");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(Default::default())
        .await
        .expect("confirm mode");
    (connection, channel)
}
