//! Conformance of broker consumers (RabbitMQ's, NATS's) on every store's
//! inbox: one body per promise, run by each broker's tests on the memory,
//! SQLite and PostgreSQL inboxes ([`InboxUnderTest`]).
//!
//! The handler ([`Replier`]) enqueues a reply in the inbox transaction,
//! counted as the store's pending messages: one per committed message,
//! none from a rolled-back try.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::receive::{ConsumerStats, InboxHandler, Received};
use crate::testing::{InboxUnderTest, wait_until};
use crate::{HandlerError, Inbox, MessageId, MessageKind, NewMessage};

const DEADLINE: Duration = Duration::from_secs(30);

/// More outages than `max_attempts`: counted, they would dead-letter.
pub const OUTAGES: u64 = 4;

/// What a promise asks of the consumer it spawns; `None` keeps the
/// consumer's default.
#[derive(Debug, Clone, Default)]
pub struct ConsumerSettings {
    /// Counted failures before the dead letter.
    pub max_attempts: Option<u32>,
    /// Delay before a counted retry.
    pub retry_delay: Option<Duration>,
    /// First and longest delay of uncounted retries.
    pub unavailable_backoff: Option<(Duration, Duration)>,
    /// Inbox retention and purge interval.
    pub inbox_retention: Option<(Duration, Duration)>,
    /// Deliveries fetched ahead.
    pub prefetch: Option<usize>,
    /// Connect through the fixture's TCP proxy, so that
    /// [`ConsumerUnderTest::break_connection`] can cut it.
    pub through_proxy: bool,
}

/// A broker with a consumer of its own destination (a queue, a stream),
/// as a broker's tests provide it.
#[async_trait]
pub trait ConsumerUnderTest: Send + Sync {
    /// Starts the consumer on `inbox` with `handler`; it must be connected
    /// when this returns.
    async fn spawn<I>(
        &self,
        inbox: I,
        handler: Arc<dyn InboxHandler<I::Conn>>,
        settings: ConsumerSettings,
    ) where
        I: Inbox + Clone;
    /// Publishes a message the way the relay does: `id`, ordering `key`,
    /// `body`.
    async fn publish(&self, id: MessageId, key: Option<&str>, body: &[u8]);
    /// Publishes an `id` published before again, as a relay does after its
    /// lease expired, past any deduplication of the broker's own.
    async fn publish_again(&self, id: MessageId, body: &[u8]);
    /// What the consumer did so far.
    fn stats(&self) -> ConsumerStats;
    /// Whether it is connected now.
    fn is_connected(&self) -> bool;
    /// Cuts the consumer's connection (through the proxy) and returns once
    /// the broker has noticed: what it had delivered on that connection
    /// and not seen acknowledged is due again (RabbitMQ: requeued) or will
    /// be after the broker's own acknowledgement timeout (NATS).
    async fn break_connection(&self);
    /// Lets it connect again.
    async fn heal_connection(&self);
    /// The dead letters so far: their ids (if they carry one) and bodies.
    async fn dead_letters(&self) -> Vec<(Option<MessageId>, Vec<u8>)>;
    /// Stops the consumer (gracefully) and returns how many messages the
    /// broker still holds for it once that settled: none if every one was
    /// acknowledged (or dead-lettered).
    async fn stop_and_count_left(&self) -> u64;
    /// Deletes what the fixture declared.
    async fn finish(&self);
}

/// What the handler committed, per ordering key, in order.
pub type Order = Arc<Mutex<HashMap<String, Vec<String>>>>;

/// Replies to each message in its inbox transaction; the body decides how
/// the try ends: `fail` always fails, `flaky` fails on its first try,
/// `outage` meets the store's "database unavailable" error on its first
/// [`OUTAGES`] tries; anything else succeeds.
pub struct Replier<S> {
    sut: Arc<S>,
    /// Handler runs.
    pub calls: Arc<AtomicU64>,
    flaky_tries: AtomicU64,
    outage_tries: AtomicU64,
    /// Bodies committed per key.
    pub order: Order,
}

impl<S> Replier<S> {
    /// A replier enqueueing its replies in `sut`'s store.
    pub fn new(sut: &Arc<S>) -> Self {
        Replier {
            sut: Arc::clone(sut),
            calls: Arc::default(),
            flaky_tries: AtomicU64::new(0),
            outage_tries: AtomicU64::new(0),
            order: Order::default(),
        }
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
                let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
                order.entry(key.clone()).or_default().push(body);
            }
        }
        outcome
    }
}

async fn replies<S: InboxUnderTest>(sut: &S) -> u64 {
    sut.store().stats().await.expect("stats").pending
}

async fn spawn_replier<C, S>(c: &C, sut: &Arc<S>, settings: ConsumerSettings) -> Arc<Replier<S>>
where
    C: ConsumerUnderTest,
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let replier = Arc::new(Replier::new(sut));
    c.spawn(sut.inbox().clone(), replier.clone(), settings)
        .await;
    replier
}

async fn all_acknowledged<C: ConsumerUnderTest>(c: &C) {
    assert_eq!(
        c.stop_and_count_left().await,
        0,
        "every message acknowledged"
    );
}

/// Duplicates are acknowledged without the handler, and each message's
/// effect happens once, across a cut of the connection.
pub async fn duplicates_skip_the_handler_and_effects_happen_once_across_a_cut<C, S>(c: C, sut: S)
where
    C: ConsumerUnderTest,
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let settings = ConsumerSettings {
        prefetch: Some(8),
        through_proxy: true,
        ..Default::default()
    };
    let replier = spawn_replier(&c, &sut, settings).await;
    assert!(c.is_connected());
    let ids: Vec<MessageId> = (0..40).map(|_| MessageId::new()).collect();
    for id in &ids[..20] {
        c.publish(*id, None, b"ok").await;
    }
    for id in &ids[..10] {
        c.publish_again(*id, b"ok").await;
    }
    wait_until(
        "the first 20 and their 10 copies are settled",
        DEADLINE,
        || {
            let s = c.stats();
            async move { s.handled == 20 && s.duplicates == 10 }
        },
    )
    .await;
    assert_eq!(
        replier.calls.load(Ordering::SeqCst),
        20,
        "copies never reach the handler"
    );
    c.break_connection().await;
    wait_until("the consumer notices the cut", DEADLINE, || {
        let up = c.is_connected();
        async move { !up }
    })
    .await;
    for id in &ids[20..] {
        c.publish(*id, None, b"ok").await;
    }
    c.heal_connection().await;
    wait_until("everything is handled after the heal", DEADLINE, || {
        let n = c.stats().handled;
        async move { n >= 40 }
    })
    .await;
    wait_until("the reconnect is counted", DEADLINE, || {
        let n = c.stats().reconnects;
        async move { n >= 1 }
    })
    .await;
    assert_eq!(
        replies(&*sut).await,
        40,
        "each message's effect exactly once"
    );
    all_acknowledged(&c).await;
    c.finish().await;
}

/// Replies commit with the inbox entry; a failing handler's try leaves
/// nothing, is retried in place holding only its key (later messages of
/// that key wait, other keys go on), and is dead-lettered at
/// `max_attempts`.
pub async fn a_failure_rolls_all_back_holds_only_its_key_then_dead_letters<C, S>(c: C, sut: S)
where
    C: ConsumerUnderTest,
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let settings = ConsumerSettings {
        max_attempts: Some(3),
        retry_delay: Some(Duration::from_millis(50)),
        ..Default::default()
    };
    let replier = spawn_replier(&c, &sut, settings).await;
    let bad = MessageId::new();
    c.publish(MessageId::new(), Some("A"), b"a1").await;
    c.publish(bad, Some("A"), b"fail").await;
    c.publish(MessageId::new(), Some("A"), b"a3").await;
    c.publish(MessageId::new(), Some("B"), b"flaky").await;
    c.publish(MessageId::new(), Some("B"), b"b2").await;
    c.publish(MessageId::new(), Some("C"), b"c1").await;
    wait_until("five handled, one dead-lettered", DEADLINE, || {
        let s = c.stats();
        async move { s.handled == 5 && s.dead_lettered == 1 }
    })
    .await;
    assert_eq!(
        replies(&*sut).await,
        5,
        "one reply per committed message, none from rolled-back tries"
    );
    let stats = c.stats();
    assert_eq!((stats.retried, stats.dead_lettered), (3, 1), "{stats:?}");
    assert!(
        stats.held_back >= 2,
        "later messages of a failing key wait: {stats:?}"
    );
    let order = replier
        .order
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    assert_eq!(order["A"], vec!["a1", "a3"]);
    assert_eq!(
        order["B"],
        vec!["flaky", "b2"],
        "the retried message stays first"
    );
    assert_eq!(order["C"], vec!["c1"]);
    wait_until("the dead letter is kept", DEADLINE, || async {
        c.dead_letters().await.len() == 1
    })
    .await;
    let dead = c.dead_letters().await;
    assert_eq!(dead[0].1, b"fail");
    if let Some(id) = dead[0].0 {
        assert_eq!(id, bad);
    }
    all_acknowledged(&c).await;
    c.finish().await;
}

/// The database being unavailable under the handler is retried without
/// counting an attempt, on every store: never dead-lettered.
pub async fn a_database_outage_is_retried_uncounted<C, S>(c: C, sut: S)
where
    C: ConsumerUnderTest,
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let settings = ConsumerSettings {
        max_attempts: Some(2),
        unavailable_backoff: Some((Duration::from_millis(5), Duration::from_millis(40))),
        ..Default::default()
    };
    let replier = spawn_replier(&c, &sut, settings).await;
    c.publish(MessageId::new(), None, b"outage").await;
    wait_until("the message is handled after the outage", DEADLINE, || {
        let n = c.stats().handled;
        async move { n == 1 }
    })
    .await;
    assert_eq!(replier.calls.load(Ordering::SeqCst), OUTAGES + 1);
    assert_eq!(replies(&*sut).await, 1, "handled once");
    let stats = c.stats();
    assert_eq!(
        (stats.retried, stats.dead_lettered, stats.deferred),
        (0, 0, OUTAGES),
        "no outage counted: {stats:?}"
    );
    all_acknowledged(&c).await;
    c.finish().await;
}

/// Entries past the retention are purged while consuming: the same id
/// received again afterwards is handled again, not a duplicate.
pub async fn inbox_entries_past_retention_are_purged_while_consuming<C, S>(c: C, sut: S)
where
    C: ConsumerUnderTest,
    S: InboxUnderTest + 'static,
    S::Inbox: Clone,
{
    let sut = Arc::new(sut);
    let settings = ConsumerSettings {
        // Long enough for a copy sent right after the first delivery to
        // find the entry (a broker may make it wait past its own
        // deduplication first).
        inbox_retention: Some((Duration::from_secs(1), Duration::from_millis(20))),
        ..Default::default()
    };
    let replier = spawn_replier(&c, &sut, settings).await;
    let id = MessageId::new();
    c.publish(id, None, b"ok").await;
    wait_until("handled", DEADLINE, || {
        let n = c.stats().handled;
        async move { n == 1 }
    })
    .await;
    // Past the retention and a purge, the entry is gone: the same id is
    // handled again. Before that it is a duplicate, so keep sending until
    // the handler runs a second time.
    wait_until("the purged id is handled again", DEADLINE, || async {
        if replier.calls.load(Ordering::SeqCst) >= 2 {
            return true;
        }
        c.publish_again(id, b"ok").await;
        tokio::time::sleep(Duration::from_millis(150)).await;
        false
    })
    .await;
    assert!(c.stats().duplicates >= 1, "{:?}", c.stats());
    c.stop_and_count_left().await;
    c.finish().await;
}

/// One `#[tokio::test]` per consumer promise, for one broker fixture
/// (`$consumer`: an expression giving a fresh [`ConsumerUnderTest`]) and
/// one store's inbox fixture (`$inbox`: a fresh [`InboxUnderTest`]).
#[macro_export]
macro_rules! consumer_conformance_tests {
    ($consumer:expr, $inbox:expr) => {
        $crate::consumer_conformance_tests!(@each $consumer, $inbox;
            duplicates_skip_the_handler_and_effects_happen_once_across_a_cut,
            a_failure_rolls_all_back_holds_only_its_key_then_dead_letters,
            a_database_outage_is_retried_uncounted,
            inbox_entries_past_retention_are_purged_while_consuming);
    };
    (@each $consumer:expr, $inbox:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::testing::consumer::$name($consumer, $inbox).await;
            }
        )*
    };
}
