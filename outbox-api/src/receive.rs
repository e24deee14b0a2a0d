//! The receiving side every broker's consumer shares: the decoded message
//! ([`Received`]), the application's handler ([`InboxHandler`]), what to do
//! after one try ([`RetryRules::settle`]), and the deliveries held back per
//! ordering key while the first of them waits for its retry ([`Held`]).
//!
//! A consumer (RabbitMQ's, NATS's) decodes a delivery into a [`Received`],
//! runs it through an [`Inbox`](crate::Inbox) with the handler, and settles
//! it by [`Settle`]: acknowledge, dead-letter, or keep it in this process
//! and try it again in place after a delay, later deliveries of its key
//! queued behind it so that the key's order holds through retries.
//! Deliveries of other keys go on meanwhile.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::task::JoinSet;

use crate::{Error, HandlerError, InboxOutcome, MessageId, Result, Timestamp};

/// A message received from a broker, decoded from its delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Received {
    /// The sender's outbox id (AMQP `message_id`, NATS `Nats-Msg-Id`): the
    /// inbox key.
    pub id: MessageId,
    /// The outbox `message_type` (AMQP `type`, NATS `Outbox-Type`), if set.
    pub message_type: Option<String>,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// The W3C `traceparent` of the span that enqueued the message, if any.
    pub trace_parent: Option<String>,
    /// Every header carried as text (AMQP scalars as text), the ones above
    /// included.
    pub headers: BTreeMap<String, String>,
    /// The payload's MIME type, if set.
    pub content_type: Option<String>,
    /// The body, unchanged.
    pub payload: Vec<u8>,
    /// When it was sent or enqueued, if the broker says (AMQP `timestamp`,
    /// seconds; NATS `Outbox-Created-At`, milliseconds).
    pub timestamp: Option<Timestamp>,
    /// Where it was published: the AMQP exchange (`""`: the default
    /// exchange); on NATS, the JetStream stream it was stored in.
    pub exchange: String,
    /// How it was routed: the AMQP routing key; on NATS, the subject.
    pub routing_key: String,
    /// Whether the broker delivered it before (to this or another consumer).
    /// A retry in place is not a redelivery: it keeps the broker's flag.
    pub redelivered: bool,
    /// Which try of this consumer process this is (1 the first time; counts
    /// handler failures, not outages).
    pub attempt: u32,
}

impl Received {
    /// A received message with `id` and `payload`, everything else empty
    /// (for consumers' decoders and tests).
    pub fn new(id: MessageId, payload: Vec<u8>) -> Self {
        Received {
            id,
            message_type: None,
            key: None,
            trace_parent: None,
            headers: BTreeMap::new(),
            content_type: None,
            payload,
            timestamp: None,
            exchange: String::new(),
            routing_key: String::new(),
            redelivered: false,
            attempt: 1,
        }
    }

    /// Decodes the JSON payload.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload).map_err(|e| {
            Error::invalid_input(format!(
                "payload of received message {} (type `{}`) does not decode as {}: {e}",
                self.id,
                self.message_type.as_deref().unwrap_or(""),
                std::any::type_name::<T>()
            ))
        })
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// Handles received messages inside the inbox transaction.
///
/// `Conn` is the connection type of the store's [`Inbox`](crate::Inbox)
/// the consumer records in: `SqliteConnection` for `SqliteInbox`,
/// `PgConnection` for `PgInbox`, `MemoryTransaction` for `MemoryInbox`.
///
/// # Contract
///
/// `conn` is the open transaction in which the consumer has just recorded
/// the message in the inbox (`BEGIN IMMEDIATE` on SQLite, `BEGIN` on
/// PostgreSQL): do the message's effects with it, and enqueue any replies
/// with the store's outbox (`SqliteOutbox::enqueue(&mut *conn, …)`,
/// `PgOutbox::enqueue(conn, …)`) — everything commits together with the
/// inbox row, and the delivery is acknowledged only after that commit. A
/// message found in the inbox already never reaches the handler.
///
/// * `Err` (or a panic, or running past the handler timeout) rolls the
///   transaction back; the delivery is tried again a bounded number of
///   times, then dead-lettered.
/// * An error that is (or wraps)
///   [`TemporarilyUnavailable`](crate::TemporarilyUnavailable) — a
///   downstream of the handler is down — rolls back too, but the delivery is
///   tried again after a growing backoff without counting an attempt, for as
///   long as it takes. So does an error whose source chain holds a database
///   error meaning "unavailable or busy, try later" (connection lost, pool
///   timed out, SQLite busy, deadlock), on every store alike (see
///   [`classify_handler_error`](crate::classify_handler_error)).
///
/// Deliveries of one ordering key reach the handler in order, one at a
/// time, retries included.
///
/// Do not commit or roll back `conn` yourself. On PostgreSQL, return every
/// SQL error you meet: a statement that failed aborts the transaction, and
/// a handler that swallows it and returns `Ok` is treated as failed.
///
/// Closures work through [`handler_fn`].
#[async_trait]
pub trait InboxHandler<Conn: ?Sized + Send>: Send + Sync + 'static {
    /// Handles one message within the inbox transaction `conn`.
    async fn handle(&self, msg: &Received, conn: &mut Conn) -> Result<(), HandlerError>;
}

#[async_trait]
impl<Tx: ?Sized + Send, H: InboxHandler<Tx> + ?Sized> InboxHandler<Tx> for Arc<H> {
    async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError> {
        (**self).handle(msg, tx).await
    }
}

/// The future a closure given to [`handler_fn`] returns.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// An [`InboxHandler`] made of a closure; see [`handler_fn`].
pub struct FnHandler<F>(F);

impl<F> fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnHandler")
    }
}

/// Turns a closure returning a boxed future into an [`InboxHandler`] on the
/// connection type the closure takes (`SqliteConnection`, `PgConnection`,
/// `MemoryTransaction`):
///
/// ```
/// use outbox_api::receive::{HandlerFuture, InboxHandler, Received, handler_fn};
///
/// struct Conn; // the store's connection type, e.g. `MemoryTransaction`
/// let handler = handler_fn(|msg: &Received, conn: &mut Conn| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         let _ = (msg.id, conn);
///         Ok(())
///     })
/// });
/// fn takes(_: impl InboxHandler<Conn>) {}
/// takes(handler);
/// ```
pub fn handler_fn<Tx, F>(f: F) -> FnHandler<F>
where
    Tx: ?Sized + Send,
    F: for<'a> Fn(&'a Received, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    FnHandler(f)
}

#[async_trait]
impl<Tx, F> InboxHandler<Tx> for FnHandler<F>
where
    Tx: ?Sized + Send,
    F: for<'a> Fn(&'a Received, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    async fn handle(&self, msg: &Received, tx: &mut Tx) -> Result<(), HandlerError> {
        (self.0)(msg, tx).await
    }
}

/// Exponential backoff: `min` after the first failure, doubling per
/// failure up to `max`, ±20 % jitter (so that many waiting clients do not
/// all come back at once).
pub fn backoff(min: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(20);
    let base = min.saturating_mul(1 << exp).min(max);
    base.mul_f64(0.8 + 0.4 * fastrand::f64())
}

/// The lane of a delivery: its ordering key, or itself alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Deliveries with this ordering key.
    Key(String),
    /// A delivery without a key (its broker tag or sequence): orders
    /// nothing else.
    Alone(u64),
}

impl Lane {
    /// The lane of `received`; `tag` tells a keyless delivery apart (an
    /// AMQP delivery tag, a stream sequence).
    pub fn of(received: &Received, tag: u64) -> Lane {
        match &received.key {
            Some(key) => Lane::Key(key.clone()),
            None => Lane::Alone(tag),
        }
    }
}

/// A decoded delivery not settled yet; `D` is the broker's delivery (what
/// acknowledges it).
#[derive(Debug)]
pub struct Pending<D> {
    /// The broker's delivery.
    pub delivery: D,
    /// What it says.
    pub received: Received,
    /// Consecutive uncounted retries (handler unavailable, database
    /// failing): the exponent of the outage backoff.
    pub deferrals: u32,
}

impl<D> Pending<D> {
    /// A delivery not tried yet.
    pub fn new(delivery: D, received: Received) -> Self {
        Pending {
            delivery,
            received,
            deferrals: 0,
        }
    }
}

/// One held lane: the delivery waiting for its retry (`None` while it
/// runs) and the later ones of its key.
struct Queue<D> {
    head: Option<Pending<D>>,
    behind: VecDeque<Pending<D>>,
}

impl<D> Default for Queue<D> {
    fn default() -> Self {
        Queue {
            head: None,
            behind: VecDeque::new(),
        }
    }
}

/// Every held lane and the timers of their heads. A lane is one ordering
/// key (or one keyless delivery): while its head waits for its retry, later
/// deliveries of the same key queue behind it in arrival order; other lanes
/// go on. When the head is settled, the ones behind it run in order.
/// Bounded by the broker's prefetch: each held delivery keeps its
/// unacknowledged slot.
pub struct Held<D> {
    lanes: HashMap<Lane, Queue<D>>,
    /// One timer per held head; each yields its lane when due.
    timers: JoinSet<Lane>,
}

impl<D> Default for Held<D> {
    fn default() -> Self {
        Held {
            lanes: HashMap::new(),
            timers: JoinSet::new(),
        }
    }
}

impl<D> fmt::Debug for Held<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("lanes", &self.lanes.len())
            .field("deliveries", &self.len())
            .finish()
    }
}

impl<D> Held<D> {
    /// Whether `lane` has a delivery waiting (later ones must queue behind).
    pub fn holds(&self, lane: &Lane) -> bool {
        self.lanes.contains_key(lane)
    }

    /// Queues `pending` behind the held deliveries of its lane.
    pub fn queue_behind(&mut self, lane: Lane, pending: Pending<D>) {
        self.lanes
            .entry(lane)
            .or_default()
            .behind
            .push_back(pending);
    }

    /// Holds `pending` at the head of its lane, due again after `delay`.
    ///
    /// # Panics
    /// Outside a tokio runtime (the timer is a task).
    pub fn hold(&mut self, lane: Lane, pending: Pending<D>, delay: Duration) {
        self.lanes.entry(lane.clone()).or_default().head = Some(pending);
        self.timers.spawn(async move {
            tokio::time::sleep(delay).await;
            lane
        });
    }

    /// The next lane whose head is due; `None` when no timer runs.
    pub async fn due(&mut self) -> Option<Lane> {
        loop {
            match self.timers.join_next().await? {
                Ok(lane) => return Some(lane),
                // Aborted or panicked timers (none are expected): skip.
                Err(_) => continue,
            }
        }
    }

    /// Takes the head of `lane` out to run it; the lane stays held.
    pub fn take_head(&mut self, lane: &Lane) -> Option<Pending<D>> {
        self.lanes.get_mut(lane)?.head.take()
    }

    /// The next delivery behind `lane`'s settled head, in arrival order;
    /// `None` (and the lane is released) when there is none.
    pub fn next_behind(&mut self, lane: &Lane) -> Option<Pending<D>> {
        let queue = self.lanes.get_mut(lane)?;
        let next = queue.behind.pop_front();
        if next.is_none() && queue.head.is_none() {
            self.lanes.remove(lane);
        }
        next
    }

    /// Deliveries held right now.
    pub fn len(&self) -> usize {
        self.lanes
            .values()
            .map(|q| q.behind.len() + usize::from(q.head.is_some()))
            .sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// Every held delivery, heads first, lane by lane.
    pub fn deliveries(&self) -> impl Iterator<Item = &Pending<D>> {
        self.lanes
            .values()
            .flat_map(|q| q.head.iter().chain(q.behind.iter()))
    }

    /// Forgets everything (the broker gives unacknowledged deliveries back
    /// by itself) and stops the timers.
    pub fn clear(&mut self) {
        self.lanes.clear();
        // Dropping a JoinSet aborts its tasks; a timer that finished before
        // could otherwise still yield its lane.
        self.timers = JoinSet::new();
    }
}

/// How a consumer retries: counted attempts before the dead letter, the
/// delay between them, and the backoff of uncounted retries (outages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryRules {
    /// Handler failures before the delivery is dead-lettered.
    pub max_attempts: u32,
    /// The delay before trying a failed delivery again.
    pub retry_delay: Duration,
    /// First and longest delay of the uncounted retries (handler
    /// temporarily unavailable, database failing), growing per consecutive
    /// deferral.
    pub unavailable_backoff: (Duration, Duration),
}

/// What to do with a delivery after one try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// Committed: acknowledge it.
    Ack,
    /// Found in the inbox: acknowledge it, the handler did not run.
    AckDuplicate,
    /// The handler failed on its last attempt: dead-letter it.
    DeadLetter {
        /// The handler's error.
        error: String,
    },
    /// The handler failed, a counted attempt: try it again in place after
    /// `delay` (later deliveries of its key wait).
    Retry {
        /// The handler's error.
        error: String,
        /// When to try again.
        delay: Duration,
    },
    /// Not the message's fault (handler temporarily unavailable, database
    /// failing): try it again after `delay`, uncounted.
    Defer {
        /// Why.
        reason: String,
        /// When to try again.
        delay: Duration,
        /// Whether the database failed (else the handler said it is
        /// temporarily unavailable).
        store: bool,
    },
}

impl RetryRules {
    /// What to do after `pending`'s try ended in `outcome` (its
    /// `received.attempt` being the try's number). An uncounted retry
    /// raises `pending.deferrals` (the backoff's exponent); a counted one
    /// resets it.
    pub fn settle<D>(&self, pending: &mut Pending<D>, outcome: InboxOutcome) -> Settle {
        match outcome {
            InboxOutcome::Committed => Settle::Ack,
            InboxOutcome::Duplicate => Settle::AckDuplicate,
            InboxOutcome::HandlerFailed(error) if pending.received.attempt >= self.max_attempts => {
                Settle::DeadLetter { error }
            }
            InboxOutcome::HandlerFailed(error) => {
                pending.deferrals = 0;
                Settle::Retry {
                    error,
                    delay: self.retry_delay,
                }
            }
            InboxOutcome::HandlerUnavailable {
                reason,
                retry_after,
            } => Settle::Defer {
                reason,
                delay: self
                    .outage_delay(pending)
                    .max(retry_after.unwrap_or_default()),
                store: false,
            },
            InboxOutcome::StoreFailed(reason) => Settle::Defer {
                reason,
                delay: self.outage_delay(pending),
                store: true,
            },
        }
    }

    fn outage_delay<D>(&self, pending: &mut Pending<D>) -> Duration {
        pending.deferrals = pending.deferrals.saturating_add(1);
        let (first, max) = self.unavailable_backoff;
        backoff(first, max, pending.deferrals)
    }
}

/// Handler failures so far in this process, by message id, bounded: past
/// [`Attempts::MAX`] entries the oldest tenth is forgotten (a forgotten
/// message counts from 1 again).
#[derive(Debug, Default)]
pub struct Attempts {
    failures: HashMap<MessageId, (u32, Instant)>,
}

impl Attempts {
    /// Entries kept at most.
    pub const MAX: usize = 10_000;

    /// The number of the next try of `id` (1 if it never failed here).
    pub fn next_try(&self, id: MessageId) -> u32 {
        self.failures.get(&id).map_or(0, |a| a.0) + 1
    }

    /// Records that try `attempt` of `id` failed.
    pub fn failed(&mut self, id: MessageId, attempt: u32) {
        if self.failures.len() >= Self::MAX {
            let mut by_age: Vec<(Instant, MessageId)> = self
                .failures
                .iter()
                .map(|(id, (_, at))| (*at, *id))
                .collect();
            by_age.sort();
            for (_, old) in by_age.into_iter().take(Self::MAX / 10) {
                self.failures.remove(&old);
            }
        }
        self.failures.insert(id, (attempt, Instant::now()));
    }

    /// Forgets `id` (settled).
    pub fn settled(&mut self, id: MessageId) {
        self.failures.remove(&id);
    }
}

/// What a consumer did since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Deliveries handled and committed (then acknowledged).
    pub handled: u64,
    /// Deliveries found in the inbox already: acknowledged, handler not run.
    pub duplicates: u64,
    /// Handler failures (counted attempts) tried again in place after
    /// the retry delay.
    pub retried: u64,
    /// Deliveries dead-lettered after `max_attempts` handler failures.
    pub dead_lettered: u64,
    /// Deliveries dead-lettered because they carry no valid message id.
    pub invalid: u64,
    /// Database failures (not counted as attempts): the delivery was tried
    /// again after the outage backoff.
    pub store_errors: u64,
    /// Tries whose handler said
    /// [`TemporarilyUnavailable`](crate::TemporarilyUnavailable): the
    /// delivery was tried again after the outage backoff, not counted as
    /// an attempt.
    pub deferred: u64,
    /// Deliveries held back behind an earlier delivery of their ordering
    /// key that was waiting for its retry (per-key order).
    pub held_back: u64,
    /// Connections (or subscriptions) opened after the first one.
    pub reconnects: u64,
    /// Standby partitions this consumer took over because no other
    /// consumer was on them.
    pub takeovers: u64,
    /// Standby partitions it handed back because another consumer waited.
    pub handovers: u64,
}

/// The live counters behind [`ConsumerStats`], shared by a consumer's
/// tasks.
#[derive(Debug, Default)]
pub struct Counters {
    /// See [`ConsumerStats::handled`].
    pub handled: AtomicU64,
    /// See [`ConsumerStats::duplicates`].
    pub duplicates: AtomicU64,
    /// See [`ConsumerStats::retried`].
    pub retried: AtomicU64,
    /// See [`ConsumerStats::dead_lettered`].
    pub dead_lettered: AtomicU64,
    /// See [`ConsumerStats::invalid`].
    pub invalid: AtomicU64,
    /// See [`ConsumerStats::store_errors`].
    pub store_errors: AtomicU64,
    /// See [`ConsumerStats::deferred`].
    pub deferred: AtomicU64,
    /// See [`ConsumerStats::held_back`].
    pub held_back: AtomicU64,
    /// See [`ConsumerStats::reconnects`].
    pub reconnects: AtomicU64,
    /// See [`ConsumerStats::takeovers`].
    pub takeovers: AtomicU64,
    /// See [`ConsumerStats::handovers`].
    pub handovers: AtomicU64,
}

/// Adds one to `counter`.
pub fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// The counts now.
    pub fn stats(&self) -> ConsumerStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            handled: get(&self.handled),
            duplicates: get(&self.duplicates),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            invalid: get(&self.invalid),
            store_errors: get(&self.store_errors),
            deferred: get(&self.deferred),
            held_back: get(&self.held_back),
            reconnects: get(&self.reconnects),
            takeovers: get(&self.takeovers),
            handovers: get(&self.handovers),
        }
    }

    /// Counts what [`Settle`] decided.
    pub fn count(&self, settle: &Settle) {
        bump(match settle {
            Settle::Ack => &self.handled,
            Settle::AckDuplicate => &self.duplicates,
            Settle::DeadLetter { .. } => &self.dead_lettered,
            Settle::Retry { .. } => &self.retried,
            Settle::Defer { store: true, .. } => &self.store_errors,
            Settle::Defer { store: false, .. } => &self.deferred,
        });
    }
}

/// Rows an inbox purge deletes per batch.
pub const INBOX_PURGE_BATCH: usize = 500;

/// Deletes inbox entries older than `retention` every `interval`, in
/// batches of [`INBOX_PURGE_BATCH`] that rest between them, until
/// `shutdown` turns true or its sender is gone. `purge(before, limit)` is
/// the inbox's [`purge`](crate::Inbox::purge); `table` names it in logs.
pub async fn purge_inbox_loop<F, Fut>(
    table: String,
    mut purge: F,
    retention: Duration,
    interval: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) where
    F: FnMut(Timestamp, usize) -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    while !*shutdown.borrow() {
        let before = Timestamp::now().saturating_sub(retention);
        let stop = shutdown.clone();
        let purged = crate::backend::purge_in_batches(
            INBOX_PURGE_BATCH,
            || *stop.borrow(),
            |limit| purge(before, limit),
        )
        .await;
        match purged {
            Ok(0) => {}
            Ok(n) => tracing::info!(purged = n, %table, "purged inbox entries past retention"),
            Err(e) => tracing::warn!(error = %e, %table, "inbox purge failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            // The handle is gone (dropped without shutdown): stop too.
            changed = shutdown.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(tag: u64, key: Option<&str>) -> Pending<u64> {
        let mut received = Received::new(MessageId::new(), Vec::new());
        received.key = key.map(str::to_owned);
        Pending::new(tag, received)
    }

    #[test]
    fn a_delivery_without_a_key_is_its_own_lane() {
        let p = pending(7, Some("K"));
        assert_eq!(Lane::of(&p.received, 7), Lane::Key("K".into()));
        let p = pending(7, None);
        assert_eq!(Lane::of(&p.received, 7), Lane::Alone(7));
    }

    #[tokio::test]
    async fn a_held_lane_releases_its_deliveries_in_arrival_order() {
        let mut held = Held::default();
        let k = Lane::Key("K".into());
        held.hold(k.clone(), pending(1, Some("K")), Duration::from_millis(1));
        assert!(held.holds(&k));
        assert!(!held.holds(&Lane::Key("L".into())), "other keys go on");
        held.queue_behind(k.clone(), pending(2, Some("K")));
        held.queue_behind(k.clone(), pending(3, Some("K")));
        assert_eq!(held.len(), 3);
        assert_eq!(held.deliveries().count(), 3);

        assert_eq!(held.due().await, Some(k.clone()));
        let head = held.take_head(&k).unwrap();
        assert_eq!(head.delivery, 1);
        assert!(held.holds(&k), "still held while its head runs");
        let tags: Vec<u64> = std::iter::from_fn(|| held.next_behind(&k))
            .map(|p| p.delivery)
            .collect();
        assert_eq!(tags, vec![2, 3]);
        assert!(!held.holds(&k), "released once empty");
        assert!(held.is_empty());
        assert_eq!(held.due().await, None, "no timer left");
    }

    #[tokio::test]
    async fn clearing_forgets_deliveries_and_timers() {
        let mut held = Held::default();
        let k = Lane::Key("K".into());
        held.hold(k.clone(), pending(1, Some("K")), Duration::ZERO);
        held.queue_behind(k.clone(), pending(2, Some("K")));
        tokio::task::yield_now().await;
        held.clear();
        assert_eq!(held.len(), 0);
        assert!(!held.holds(&k));
        assert_eq!(held.due().await, None);
    }

    #[test]
    fn settling_follows_the_outcome_and_the_attempt() {
        let rules = RetryRules {
            max_attempts: 3,
            retry_delay: Duration::from_millis(40),
            unavailable_backoff: (Duration::from_millis(100), Duration::from_secs(1)),
        };
        let mut p = pending(1, None);
        assert_eq!(rules.settle(&mut p, InboxOutcome::Committed), Settle::Ack);
        assert_eq!(
            rules.settle(&mut p, InboxOutcome::Duplicate),
            Settle::AckDuplicate
        );
        p.received.attempt = 2;
        assert_eq!(
            rules.settle(&mut p, InboxOutcome::HandlerFailed("no".into())),
            Settle::Retry {
                error: "no".into(),
                delay: Duration::from_millis(40)
            }
        );
        p.received.attempt = 3;
        assert_eq!(
            rules.settle(&mut p, InboxOutcome::HandlerFailed("no".into())),
            Settle::DeadLetter { error: "no".into() }
        );
        // Uncounted retries back off, growing per deferral; a handler's own
        // delay wins when longer.
        let first = rules.settle(&mut p, InboxOutcome::StoreFailed("down".into()));
        assert!(
            matches!(first, Settle::Defer { store: true, delay, .. } if delay <= Duration::from_millis(120)),
            "{first:?}"
        );
        let second = rules.settle(
            &mut p,
            InboxOutcome::HandlerUnavailable {
                reason: "later".into(),
                retry_after: Some(Duration::from_secs(5)),
            },
        );
        assert_eq!(p.deferrals, 2);
        assert!(
            matches!(second, Settle::Defer { store: false, delay, .. } if delay == Duration::from_secs(5)),
            "{second:?}"
        );
        p.received.attempt = 1;
        rules.settle(&mut p, InboxOutcome::HandlerFailed("x".into()));
        assert_eq!(
            p.deferrals, 0,
            "a counted failure resets the outage backoff"
        );
    }

    #[test]
    fn attempts_count_per_message_and_stay_bounded() {
        let mut a = Attempts::default();
        let id = MessageId::new();
        assert_eq!(a.next_try(id), 1);
        a.failed(id, 1);
        assert_eq!(a.next_try(id), 2);
        a.settled(id);
        assert_eq!(a.next_try(id), 1);
        for _ in 0..Attempts::MAX + 5 {
            a.failed(MessageId::new(), 1);
        }
        assert!(a.failures.len() <= Attempts::MAX);
    }

    #[test]
    fn backoff_grows_and_caps() {
        let min = Duration::from_millis(100);
        let max = Duration::from_secs(30);
        let first = backoff(min, max, 1);
        assert!(first >= Duration::from_millis(80) && first <= Duration::from_millis(120));
        let later = backoff(min, max, 4);
        assert!(later >= Duration::from_millis(640) && later <= Duration::from_millis(960));
        assert!(backoff(min, max, 1000) <= Duration::from_secs(36));
    }
}
