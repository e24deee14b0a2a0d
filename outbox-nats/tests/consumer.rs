//! `NatsConsumer` through the consumer conformance suite
//! (`outbox_api::testing::consumer`) on the memory, SQLite and PostgreSQL
//! inboxes, against the local NATS server (or `OUTBOX_NATS_URL`); each test
//! has its own streams and database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_trait::async_trait;
use outbox_api::receive::{ConsumerStats, InboxHandler, Received};
use outbox_api::testing::{ConsumerSettings, ConsumerUnderTest, TcpProxy};
use outbox_api::{Inbox, MessageId, MessageKind, NewMessage, Outcome, Timestamp, Transport};
use outbox_nats::testing::{declare_consumer_streams, nats_url, server_addr, unique_name};
use outbox_nats::{NatsConfig, NatsConsumer, NatsConsumerHandle, NatsTransport};

/// The stream's duplicate window: short, so that a message can be sent
/// again past it, as a relay does after its lease expired.
const WINDOW: Duration = Duration::from_millis(100);

/// The test's own stream (`{name}.>`) and dead-letter stream
/// (`{name}-dead.>`), a transport publishing to them as the relay would,
/// a proxy in front of the server, and the consumer under test.
struct Nats {
    name: String,
    js: jetstream::Context,
    transport: NatsTransport,
    proxy: TcpProxy,
    consumer: Mutex<Option<Arc<NatsConsumerHandle>>>,
    published: Mutex<HashMap<MessageId, Instant>>,
}

impl Nats {
    async fn new() -> Nats {
        let name = unique_name("cons");
        let transport = NatsTransport::connect(NatsTransport::builder(nats_url()))
            .await
            .expect("connect to NATS");
        declare_consumer_streams(&transport, &name, |s| s.duplicate_window(WINDOW)).await;
        let js = transport.jetstream().clone();
        let proxy = TcpProxy::start(server_addr(&nats_url())).await;
        Nats {
            name,
            js,
            transport,
            proxy,
            consumer: Mutex::new(None),
            published: Mutex::new(HashMap::new()),
        }
    }

    fn handle(&self) -> Arc<NatsConsumerHandle> {
        self.consumer
            .lock()
            .unwrap()
            .clone()
            .expect("the consumer was spawned")
    }

    async fn send(&self, id: MessageId, key: Option<&str>, body: &[u8]) {
        let mut m = NewMessage::new(MessageKind::Integration, "T", body.to_vec())
            .destination(self.name.as_str(), "in")
            .with_id(id);
        if let Some(key) = key {
            m = m.key(key);
        }
        let m = m.into_message(Timestamp::now()).unwrap();
        let outcome = self.transport.send(std::slice::from_ref(&m)).await;
        assert_eq!(outcome, vec![Outcome::Delivered]);
        self.published.lock().unwrap().insert(id, Instant::now());
    }
}

/// The consumer's `ack_wait` in these tests.
const ACK_WAIT: Duration = Duration::from_secs(4);

impl Nats {
    /// Messages of consumer `c1` not acknowledged yet: as soon as none is
    /// left, or what is left after `within`.
    async fn left_after(&self, within: Duration) -> u64 {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut c: jetstream::consumer::PullConsumer = stream.get_consumer("c1").await.unwrap();
        let deadline = Instant::now() + within;
        loop {
            let info = c.info().await.unwrap();
            let left = info.num_ack_pending as u64 + info.num_pending;
            if left == 0 || Instant::now() > deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[async_trait]
impl ConsumerUnderTest for Nats {
    async fn spawn<I>(
        &self,
        inbox: I,
        handler: Arc<dyn InboxHandler<I::Conn>>,
        settings: ConsumerSettings,
    ) where
        I: Inbox + Clone,
    {
        let url = if settings.through_proxy {
            format!("nats://{}", self.proxy.addr())
        } else {
            nats_url()
        };
        let mut b = NatsConsumer::builder(NatsConfig::new(url), self.name.as_str(), "c1")
            .dead_letter_subject(format!("{}-dead.c1", self.name))
            // What was on its way when a connection broke comes again
            // after `ack_wait`.
            .handler_timeout(Duration::from_secs(2))
            .ack_wait(ACK_WAIT);
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
            b = b.max_ack_pending(n);
        }
        let handle = b.spawn(inbox, handler).await.expect("start the consumer");
        *self.consumer.lock().unwrap() = Some(Arc::new(handle));
    }

    async fn publish(&self, id: MessageId, key: Option<&str>, body: &[u8]) {
        self.send(id, key, body).await;
    }

    async fn publish_again(&self, id: MessageId, body: &[u8]) {
        // Past the stream's duplicate window, the server stores it again.
        let first = self.published.lock().unwrap().get(&id).copied();
        if let Some(at) = first {
            let past = at + WINDOW * 3;
            tokio::time::sleep_until(past.into()).await;
        }
        self.send(id, None, body).await;
    }

    fn stats(&self) -> ConsumerStats {
        self.handle().stats()
    }

    fn is_connected(&self) -> bool {
        self.handle().is_connected()
    }

    async fn break_connection(&self) {
        self.proxy.cut();
    }

    async fn heal_connection(&self) {
        self.proxy.heal();
    }

    async fn dead_letters(&self) -> Vec<(Option<MessageId>, Vec<u8>)> {
        let mut stream = self
            .js
            .get_stream(format!("{}_DEAD", self.name))
            .await
            .unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = stream.get_raw_message(seq).await {
                let id: async_nats::HeaderName = "Nats-Msg-Id".parse().unwrap();
                let id = m.headers.get(id).and_then(|v| v.as_str().parse().ok());
                out.push((id, m.payload.to_vec()));
            }
        }
        out
    }

    async fn stop_and_count_left(&self) -> u64 {
        // While the consumer runs: an acknowledgement lost with a cut
        // connection makes the server deliver the message again after
        // `ack_wait`, and the running consumer settles that copy.
        self.left_after(ACK_WAIT * 3).await;
        self.handle().shutdown().await;
        // Acknowledgements are messages too: give the last ones a moment.
        self.left_after(Duration::from_secs(5)).await
    }

    async fn finish(&self) {
        let _ = self.js.delete_stream(&self.name).await;
        let _ = self.js.delete_stream(format!("{}_DEAD", self.name)).await;
    }
}

/// A consumer without a stream for its dead letters refuses to start,
/// saying what to declare; one on a missing stream says so.
#[tokio::test]
async fn a_consumer_refuses_to_start_without_somewhere_to_put_dead_letters() {
    let fx = Nats::new().await;
    let inbox = outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new());
    let handler = outbox_api::receive::handler_fn(
        |_: &Received,
         _: &mut outbox_memory::MemoryTransaction|
         -> outbox_api::receive::HandlerFuture<'_> { Box::pin(async { Ok(()) }) },
    );
    let e = NatsConsumer::builder(NatsConfig::new(nats_url()), fx.name.as_str(), "c1")
        .dead_letter_subject("nowhere-captured.c1")
        .spawn(inbox.clone(), handler)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), outbox_api::ErrorKind::Config, "{e}");
    assert!(e.to_string().contains("no stream captures"), "{e}");
    let handler = outbox_api::receive::handler_fn(
        |_: &Received,
         _: &mut outbox_memory::MemoryTransaction|
         -> outbox_api::receive::HandlerFuture<'_> { Box::pin(async { Ok(()) }) },
    );
    let e = NatsConsumer::builder(NatsConfig::new(nats_url()), "NO_SUCH_STREAM_X", "c1")
        .spawn(inbox, handler)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), outbox_api::ErrorKind::NotFound, "{e}");
    fx.finish().await;
}

mod memory {
    outbox_api::consumer_conformance_tests!(
        super::Nats::new().await,
        outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new())
    );
}

mod sqlite {
    outbox_api::consumer_conformance_tests!(
        super::Nats::new().await,
        outbox_sqlite::testing::SqlxUnderTest::fresh(None).await
    );
}

mod postgres {
    outbox_api::consumer_conformance_tests!(
        super::Nats::new().await,
        outbox_postgres::testing::PgUnderTest::fresh(None).await
    );
}
