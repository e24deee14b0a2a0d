//! `RabbitConsumer` through the consumer conformance suite
//! (`outbox_api::testing::consumer`) on the memory, SQLite and PostgreSQL
//! inboxes, on a real broker; each test has its own queues and database.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lapin::options::BasicGetOptions;
use outbox_api::receive::{ConsumerStats, InboxHandler};
use outbox_api::testing::{ConsumerSettings, ConsumerUnderTest, TcpProxy, wait_until};
use outbox_api::{Inbox, MessageId};
use outbox_rabbitmq::testing::{amqp_url, broker_addr, unique_name, url_via};
use outbox_rabbitmq::{ConsumerHandle, ExchangeType, RabbitConsumer, Topology, lapin};

mod support;
use support::Queue;

/// A queue of the test's own dead-lettering to a queue of its own, a proxy
/// in front of the broker, and the consumer under test.
struct Rabbit {
    queue: Queue,
    dlx: String,
    dlq: String,
    proxy: TcpProxy,
    consumer: Mutex<Option<Arc<ConsumerHandle>>>,
    dead: Mutex<Vec<(Option<MessageId>, Vec<u8>)>>,
}

impl Rabbit {
    async fn new() -> Rabbit {
        let (dlx, dlq, q) = (
            unique_name("inbox-dlx"),
            unique_name("inbox-dead"),
            unique_name("inbox-in"),
        );
        let queue = Queue::existing(&q).await;
        Topology::new()
            .exchange(dlx.as_str(), ExchangeType::Fanout)
            .queue(dlq.as_str())
            .queue(q.as_str())
            .bind(dlq.as_str(), dlx.as_str(), "")
            .dead_letter(q.as_str(), dlx.as_str())
            .declare_on(&queue.channel)
            .await
            .expect("declare the topology");
        let proxy = TcpProxy::start(broker_addr(&amqp_url()).await).await;
        Rabbit {
            queue,
            dlx,
            dlq,
            proxy,
            consumer: Mutex::new(None),
            dead: Mutex::new(Vec::new()),
        }
    }

    fn handle(&self) -> Arc<ConsumerHandle> {
        self.consumer
            .lock()
            .unwrap()
            .clone()
            .expect("the consumer was spawned")
    }
}

#[async_trait]
impl ConsumerUnderTest for Rabbit {
    async fn spawn<I>(
        &self,
        inbox: I,
        handler: Arc<dyn InboxHandler<I::Conn>>,
        settings: ConsumerSettings,
    ) where
        I: Inbox + Clone,
    {
        let url = if settings.through_proxy {
            url_via(&amqp_url(), self.proxy.addr())
        } else {
            amqp_url()
        };
        let mut b = RabbitConsumer::builder(url, self.queue.name.as_str())
            .connect_timeout(Duration::from_secs(2))
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
        if let Some(n) = settings.max_attempts {
            b = b.max_attempts(n);
        }
        if let Some(d) = settings.retry_delay {
            b = b.retry_delay(d);
        }
        if let Some((first, max)) = settings.unavailable_backoff {
            b = b.unavailable_backoff(first, max);
        }
        if let Some((retention, every)) = settings.inbox_retention {
            b = b
                .inbox_retention(Some(retention))
                .inbox_purge_interval(every);
        }
        if let Some(n) = settings.prefetch {
            b = b.prefetch(u16::try_from(n).expect("a prefetch that fits AMQP"));
        }
        let handle = b.spawn(inbox, handler).await.expect("start the consumer");
        *self.consumer.lock().unwrap() = Some(Arc::new(handle));
    }

    async fn publish(&self, id: MessageId, key: Option<&str>, body: &[u8]) {
        self.queue.publish_with(id, key, body).await;
    }

    async fn publish_again(&self, id: MessageId, body: &[u8]) {
        self.queue.publish_with(id, None, body).await;
    }

    fn stats(&self) -> ConsumerStats {
        self.handle().stats()
    }

    fn is_connected(&self) -> bool {
        self.handle().is_connected()
    }

    async fn break_connection(&self) {
        self.proxy.cut();
        // The broker takes back what the cut channel had not acknowledged
        // when it drops the channel's consumer: wait for that, so that the
        // copies it delivers again come before anything published later.
        wait_until(
            "the broker drops the cut connection's consumer",
            Duration::from_secs(30),
            || async { self.queue.consumers().await == 0 },
        )
        .await;
    }

    async fn heal_connection(&self) {
        self.proxy.heal();
    }

    async fn dead_letters(&self) -> Vec<(Option<MessageId>, Vec<u8>)> {
        // Taken off the queue once, kept here.
        while let Some(m) = self
            .queue
            .channel
            .basic_get(self.dlq.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            let id = m
                .delivery
                .properties
                .message_id()
                .as_ref()
                .and_then(|id| id.as_str().parse().ok());
            self.dead
                .lock()
                .unwrap()
                .push((id, m.delivery.data.clone()));
        }
        self.dead.lock().unwrap().clone()
    }

    async fn stop_and_count_left(&self) -> u64 {
        self.handle().shutdown().await;
        // Closing the channel returns what was not acknowledged.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = u64::from(self.queue.ready().await);
            if left == 0 || Instant::now() > deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn finish(&self) {
        for queue in [&self.dlq, &self.queue.name] {
            let _ = self
                .queue
                .channel
                .queue_delete(queue.as_str().into(), Default::default())
                .await;
        }
        let _ = self
            .queue
            .channel
            .exchange_delete(self.dlx.as_str().into(), Default::default())
            .await;
    }
}

mod memory {
    outbox_api::consumer_conformance_tests!(
        super::Rabbit::new().await,
        outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new())
    );
}

mod sqlite {
    outbox_api::consumer_conformance_tests!(
        super::Rabbit::new().await,
        outbox_sqlite::testing::SqlxUnderTest::fresh(None).await
    );
}

mod postgres {
    outbox_api::consumer_conformance_tests!(
        super::Rabbit::new().await,
        outbox_postgres::testing::PgUnderTest::fresh(None).await
    );
}
