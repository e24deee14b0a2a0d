//! `NatsConsumer` on every store's inbox through the `Inbox` contract: one
//! body per promise, run on the memory, SQLite and PostgreSQL inboxes (the
//! fixtures of the inbox conformance suite), against the local NATS server
//! (or `OUTBOX_NATS_URL`). Each test has its own streams and database.
//!
//! The handler's effect is a reply enqueued in the inbox transaction,
//! counted as the store's pending messages: one per committed message,
//! none from a rolled-back try.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use async_trait::async_trait;
use outbox_api::receive::{InboxHandler, Received};
use outbox_api::testing::{InboxUnderTest, TcpProxy, wait_until};
use outbox_api::{HandlerError, Inbox, MessageId, MessageKind, NewMessage, Timestamp, Transport};
use outbox_nats::testing::{nats_url, server_addr, unique_name};
use outbox_nats::{DEAD_REASON_HEADER, NatsConfig, NatsConsumer, NatsTransport, StreamSpec};

const DEADLINE: Duration = Duration::from_secs(30);

/// What the handler committed, per ordering key, in order.
type Order = Arc<Mutex<HashMap<String, Vec<String>>>>;

/// More outages than `max_attempts`: counted, they would dead-letter.
const OUTAGES: u64 = 4;

/// Replies to each message in its inbox transaction; the body decides how
/// the try ends: `fail` always fails, `flaky` fails on its first try,
/// `outage` meets the store's "database unavailable" error on its first
/// [`OUTAGES`] tries; anything else succeeds. Records the order per key.
struct Replier<S> {
    sut: Arc<S>,
    calls: Arc<AtomicU64>,
    flaky_tries: AtomicU64,
    outage_tries: AtomicU64,
    order: Order,
}

impl<S> Replier<S> {
    fn new(sut: &Arc<S>) -> (Self, Arc<AtomicU64>, Order) {
        let calls = Arc::new(AtomicU64::new(0));
        let order = Arc::new(Mutex::new(HashMap::new()));
        let replier = Replier {
            sut: Arc::clone(sut),
            calls: Arc::clone(&calls),
            flaky_tries: AtomicU64::new(0),
            outage_tries: AtomicU64::new(0),
            order: Arc::clone(&order),
        };
        (replier, calls, order)
    }
}

#[async_trait]
impl<S> InboxHandler<<S::Inbox as Inbox>::Conn> for Replier<S>
where
    S: InboxUnderTest + 'static,
{
    async fn handle(
        &self,
        msg: &Received,
        conn: &mut <S::Inbox as Inbox>::Conn,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let reply = NewMessage::new(
            MessageKind::Integration,
            "Done",
            msg.id.to_string().into_bytes(),
        );
        self.sut.enqueue_in(conn, reply).await?;
        let body = String::from_utf8_lossy(&msg.payload).into_owned();
        let outcome = match body.as_str() {
            "fail" => Err(format!("{} cannot be handled", msg.id).into()),
            "flaky" if self.flaky_tries.fetch_add(1, Ordering::SeqCst) == 0 => {
                Err("not yet".into())
            }
            "outage" if self.outage_tries.fetch_add(1, Ordering::SeqCst) < OUTAGES => {
                Err(self.sut.driver_unavailable_error())
            }
            _ => Ok(()),
        };
        if outcome.is_ok() {
            if let Some(key) = &msg.key {
                self.order
                    .lock()
                    .unwrap()
                    .entry(key.clone())
                    .or_default()
                    .push(body);
            }
        }
        outcome
    }
}

async fn replies<S: InboxUnderTest>(sut: &S) -> u64 {
    sut.store().stats().await.expect("stats").pending
}

/// The test's own stream (`{name}.>`) and dead-letter stream
/// (`{name}-dead.>`), and a transport that publishes to them as the relay
/// would.
struct Fixture {
    name: String,
    js: jetstream::Context,
    transport: NatsTransport,
}

impl Fixture {
    async fn new() -> Fixture {
        let name = unique_name("cons");
        let transport = NatsTransport::connect(NatsTransport::builder(nats_url()))
            .await
            .expect("connect to NATS");
        for (stream, subject) in [
            (name.clone(), format!("{name}.>")),
            (format!("{name}_DEAD"), format!("{name}-dead.>")),
        ] {
            transport
                .declare(&StreamSpec::new(stream, [subject]))
                .await
                .expect("declare the test's streams");
        }
        let js = transport.jetstream().clone();
        Fixture {
            name,
            js,
            transport,
        }
    }

    fn consumer(&self, url: String) -> outbox_nats::NatsConsumerBuilder {
        NatsConsumer::builder(NatsConfig::new(url), self.name.as_str(), "c1")
            .dead_letter_subject(format!("{}-dead.c1", self.name))
    }

    async fn publish(&self, id: MessageId, key: Option<&str>, body: &str) {
        let mut m = NewMessage::new(MessageKind::Integration, "T", body.as_bytes().to_vec())
            .destination(self.name.as_str(), "in")
            .with_id(id);
        if let Some(key) = key {
            m = m.key(key);
        }
        let m = m.into_message(Timestamp::now()).unwrap();
        let outcome = self.transport.send(std::slice::from_ref(&m)).await;
        assert_eq!(outcome, vec![outbox_api::Outcome::Delivered]);
    }

    async fn dead_letters(&self) -> Vec<async_nats::jetstream::message::StreamMessage> {
        let mut stream = self
            .js
            .get_stream(format!("{}_DEAD", self.name))
            .await
            .unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = stream.get_raw_message(seq).await {
                out.push(m);
            }
        }
        out
    }

    /// Messages the consumer has not acknowledged.
    async fn unacknowledged(&self) -> u64 {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut c: jetstream::consumer::PullConsumer = stream.get_consumer("c1").await.unwrap();
        let info = c.info().await.unwrap();
        info.num_ack_pending as u64 + info.num_pending
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.name).await;
        let _ = self.js.delete_stream(format!("{}_DEAD", self.name)).await;
    }
}

/// Duplicates are acknowledged without the handler, and each message's
/// effect happens once, across a cut of the connection.
async fn duplicates_skip_the_handler_and_effects_happen_once_across_a_cut<S>(sut: S)
where
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let fx = Fixture::new().await;
    let proxy = TcpProxy::start(server_addr(&nats_url())).await;
    let (handler, calls, _) = Replier::new(&sut);
    let consumer = fx
        .consumer(format!("nats://{}", proxy.addr()))
        .max_ack_pending(8)
        // What was on its way when the connection broke comes again after
        // `ack_wait`.
        .handler_timeout(Duration::from_secs(2))
        .ack_wait(Duration::from_secs(4))
        .spawn(sut.inbox().clone(), handler)
        .await
        .expect("start the consumer");

    let ids: Vec<MessageId> = (0..40).map(|_| MessageId::new()).collect();
    for id in &ids[..20] {
        fx.publish(*id, None, "ok").await;
    }
    let dup_ids: Vec<MessageId> = ids[..10].to_vec();
    // The relay sending the same ids again after its lease expired, past
    // the stream's duplicate window (shortened here): the server stores
    // them again, and the inbox must drop them.
    fx.js
        .update_stream(jetstream::stream::Config {
            name: fx.name.clone(),
            subjects: vec![format!("{}.>", fx.name)],
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .expect("shorten the duplicate window");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in &dup_ids {
        fx.publish(*id, None, "ok").await;
    }
    wait_until(
        "the first 20 and their 10 copies are settled",
        DEADLINE,
        || {
            let s = consumer.stats();
            async move { s.handled == 20 && s.duplicates == 10 }
        },
    )
    .await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        20,
        "copies never reach the handler"
    );

    assert!(consumer.is_connected());
    proxy.cut();
    wait_until("the consumer notices the cut", DEADLINE, || {
        let up = consumer.is_connected();
        async move { !up }
    })
    .await;
    for id in &ids[20..] {
        fx.publish(*id, None, "ok").await;
    }
    proxy.heal();
    wait_until("everything is handled after the heal", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n >= 40 }
    })
    .await;
    assert_eq!(
        replies(&*sut).await,
        40,
        "each message's effect exactly once"
    );
    wait_until("every message acknowledged", DEADLINE, || {
        let fx = &fx;
        async move { fx.unacknowledged().await == 0 }
    })
    .await;
    consumer.shutdown().await;
    fx.cleanup().await;
}

/// Replies commit with the inbox entry; a failing handler's try leaves
/// nothing, is retried in place holding only its key, and is dead-lettered
/// at `max_attempts` to a subject a human can read.
async fn a_failure_rolls_all_back_holds_only_its_key_then_dead_letters<S>(sut: S)
where
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let fx = Fixture::new().await;
    let (handler, _, order) = Replier::new(&sut);
    let consumer = fx
        .consumer(nats_url())
        .max_attempts(3)
        .retry_delay(Duration::from_millis(50))
        .spawn(sut.inbox().clone(), handler)
        .await
        .expect("start the consumer");
    let bad = MessageId::new();
    fx.publish(MessageId::new(), Some("A"), "a1").await;
    fx.publish(bad, Some("A"), "fail").await;
    fx.publish(MessageId::new(), Some("A"), "a3").await;
    fx.publish(MessageId::new(), Some("B"), "flaky").await;
    fx.publish(MessageId::new(), Some("B"), "b2").await;
    fx.publish(MessageId::new(), Some("C"), "c1").await;
    wait_until("five handled, one dead-lettered", DEADLINE, || {
        let s = consumer.stats();
        async move { s.handled == 5 && s.dead_lettered == 1 }
    })
    .await;
    assert_eq!(
        replies(&*sut).await,
        5,
        "one reply per committed message, none from rolled-back tries"
    );
    let stats = consumer.stats();
    assert_eq!((stats.retried, stats.dead_lettered), (3, 1), "{stats:?}");
    assert!(
        stats.held_back >= 2,
        "later messages of a failing key wait: {stats:?}"
    );
    let order = order.lock().unwrap().clone();
    assert_eq!(order["A"], vec!["a1", "a3"]);
    assert_eq!(
        order["B"],
        vec!["flaky", "b2"],
        "the retried message stays first"
    );
    assert_eq!(order["C"], vec!["c1"]);
    let dead = fx.dead_letters().await;
    assert_eq!(dead.len(), 1);
    let header = |name: &str| {
        let name: async_nats::HeaderName = name.parse().unwrap();
        dead[0].headers.get(name).map(|v| v.as_str().to_owned())
    };
    assert_eq!(header("Nats-Msg-Id"), Some(bad.to_string()));
    assert!(
        header(DEAD_REASON_HEADER)
            .unwrap()
            .contains("cannot be handled")
    );
    assert_eq!(dead[0].payload.as_ref(), b"fail");
    wait_until("every message acknowledged or terminated", DEADLINE, || {
        let fx = &fx;
        async move { fx.unacknowledged().await == 0 }
    })
    .await;
    consumer.shutdown().await;
    fx.cleanup().await;
}

/// The database being unavailable under the handler is retried without
/// counting an attempt, on every store: never dead-lettered.
async fn a_database_outage_is_retried_uncounted<S>(sut: S)
where
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let fx = Fixture::new().await;
    let (handler, calls, _) = Replier::new(&sut);
    let consumer = fx
        .consumer(nats_url())
        .max_attempts(2)
        .unavailable_backoff(Duration::from_millis(5), Duration::from_millis(40))
        .spawn(sut.inbox().clone(), handler)
        .await
        .expect("start the consumer");
    fx.publish(MessageId::new(), None, "outage").await;
    wait_until("the message is handled after the outage", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 1 }
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), OUTAGES + 1);
    assert_eq!(replies(&*sut).await, 1, "handled once");
    let stats = consumer.stats();
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.deferred),
        (0, 0, OUTAGES),
        "no outage counted: {stats:?}"
    );
    consumer.shutdown().await;
    fx.cleanup().await;
}

/// Entries past the retention are purged while consuming: the same id
/// received again afterwards is handled again, not a duplicate.
async fn inbox_entries_past_retention_are_purged_while_consuming<S>(sut: S)
where
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let fx = Fixture::new().await;
    // No server-side deduplication: the same id may be stored again.
    fx.js
        .update_stream(jetstream::stream::Config {
            name: fx.name.clone(),
            subjects: vec![format!("{}.>", fx.name)],
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .unwrap();
    let (handler, calls, _) = Replier::new(&sut);
    let consumer = fx
        .consumer(nats_url())
        .inbox_retention(Some(Duration::from_millis(300)))
        .inbox_purge_interval(Duration::from_millis(20))
        .spawn(sut.inbox().clone(), handler)
        .await
        .expect("start the consumer");
    let id = MessageId::new();
    fx.publish(id, None, "ok").await;
    wait_until("handled", DEADLINE, || {
        let n = consumer.stats().handled;
        async move { n == 1 }
    })
    .await;
    wait_until("the purged id is handled again", DEADLINE, || {
        let (fx, calls) = (&fx, &calls);
        async move {
            if calls.load(Ordering::SeqCst) >= 2 {
                return true;
            }
            fx.publish(id, None, "ok").await;
            tokio::time::sleep(Duration::from_millis(150)).await;
            false
        }
    })
    .await;
    assert!(consumer.stats().duplicates >= 1, "{:?}", consumer.stats());
    consumer.shutdown().await;
    fx.cleanup().await;
}

/// A consumer without a stream for its dead letters refuses to start,
/// saying what to declare; one on a missing stream says so.
#[tokio::test]
async fn a_consumer_refuses_to_start_without_somewhere_to_put_dead_letters() {
    let fx = Fixture::new().await;
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
    fx.cleanup().await;
}

/// One `#[tokio::test]` per promise above, for one store's fixture.
macro_rules! on_every_promise {
    ($fixture:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn duplicates_skip_the_handler_and_effects_happen_once_across_a_cut() {
            super::duplicates_skip_the_handler_and_effects_happen_once_across_a_cut($fixture).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_failure_rolls_all_back_holds_only_its_key_then_dead_letters() {
            super::a_failure_rolls_all_back_holds_only_its_key_then_dead_letters($fixture).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_database_outage_is_retried_uncounted() {
            super::a_database_outage_is_retried_uncounted($fixture).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn inbox_entries_past_retention_are_purged_while_consuming() {
            super::inbox_entries_past_retention_are_purged_while_consuming($fixture).await;
        }
    };
}

mod memory {
    on_every_promise!(outbox_memory::MemoryInbox::new(
        outbox_memory::MemoryStore::new()
    ));
}

mod sqlite {
    on_every_promise!(outbox_sqlite::testing::SqlxUnderTest::fresh(None).await);
}

mod postgres {
    on_every_promise!(outbox_postgres::testing::PgUnderTest::fresh(None).await);
}
