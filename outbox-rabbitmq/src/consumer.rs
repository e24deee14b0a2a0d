//! [`RabbitConsumer`]: consumes a queue into a SQLite inbox (feature
//! `sqlite-inbox`), so that at-least-once delivery gives exactly-once
//! effects.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties};
use outbox_api::{Error, HandlerError, MessageId, Result, Timestamp};
use outbox_sqlite::sqlx::{SqliteConnection, SqlitePool};
use outbox_sqlite::{InboxOutcome, SqliteOutbox};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};
use tracing::Instrument;

use crate::config::{MAX_SHORT_STRING, RabbitConfig};
use crate::transport::{KEY_HEADER, TRACEPARENT_HEADER, backoff, connect_error};

/// A message received from RabbitMQ, decoded from the AMQP delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Received {
    /// The AMQP `message_id`, parsed: the sender's outbox id and the inbox key.
    pub id: MessageId,
    /// The AMQP `type` (the outbox `message_type`), if set.
    pub message_type: Option<String>,
    /// The ordering key (header `x-outbox-key`), if any.
    pub key: Option<String>,
    /// The W3C `traceparent` header of the span that enqueued the message, if any.
    pub trace_parent: Option<String>,
    /// Every header whose value is a string or a scalar (numbers and booleans
    /// as text), including `traceparent` and `x-outbox-key`.
    pub headers: BTreeMap<String, String>,
    /// The AMQP `content_type`, if set.
    pub content_type: Option<String>,
    /// The body, unchanged.
    pub payload: Vec<u8>,
    /// The AMQP `timestamp` (seconds precision), if set.
    pub timestamp: Option<Timestamp>,
    /// The exchange it was published to (`""`: the default exchange).
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Whether the broker delivered it before (to this or another consumer).
    pub redelivered: bool,
    /// Which try of this consumer process this is (1 the first time; counts
    /// handler failures, see [`RabbitConsumerBuilder::max_attempts`]).
    pub attempt: u32,
}

impl Received {
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

    /// Decodes an AMQP delivery; `Err` says why it cannot be handled.
    fn decode(d: &Delivery) -> std::result::Result<Received, String> {
        let p = &d.properties;
        let raw_id = p
            .message_id()
            .as_ref()
            .ok_or_else(|| "the delivery has no message_id".to_owned())?;
        let id: MessageId = raw_id.as_str().parse().map_err(|_| {
            format!(
                "message_id `{}` is not a message id (UUID)",
                raw_id.as_str().chars().take(80).collect::<String>()
            )
        })?;
        let mut headers = BTreeMap::new();
        if let Some(table) = p.headers() {
            for (name, value) in table.inner() {
                if let Some(text) = header_text(value) {
                    headers.insert(name.as_str().to_owned(), text);
                }
            }
        }
        Ok(Received {
            id,
            message_type: p.kind().as_ref().map(|s| s.as_str().to_owned()),
            key: headers.get(KEY_HEADER).cloned(),
            trace_parent: headers.get(TRACEPARENT_HEADER).cloned(),
            headers,
            content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
            payload: d.data.clone(),
            timestamp: p
                .timestamp()
                .and_then(|t| i64::try_from(t).ok())
                .map(|secs| Timestamp::from_millis(secs.saturating_mul(1000))),
            exchange: d.exchange.as_str().to_owned(),
            routing_key: d.routing_key.as_str().to_owned(),
            redelivered: d.redelivered,
            attempt: 1,
        })
    }
}

fn header_text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        _ => return None,
    })
}

/// Handles received messages inside the inbox transaction.
///
/// `tx` is the open SQLite transaction (`BEGIN IMMEDIATE`) in which the
/// consumer has just recorded the message in the inbox: do the message's
/// effects with it, and enqueue any replies with
/// [`SqliteOutbox::enqueue`]`(&mut *tx, …)` — everything commits together
/// with the inbox row, and the delivery is acknowledged only after that
/// commit. Returning `Err` (or panicking, or exceeding the handler timeout)
/// rolls the transaction back; the delivery is retried a bounded number of
/// times, then dead-lettered.
///
/// Do not commit or roll back `tx` yourself.
///
/// Closures work through [`handler_fn`].
#[async_trait]
pub trait InboxHandler: Send + Sync + 'static {
    /// Handles one message within the inbox transaction `tx`.
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError>;
}

#[async_trait]
impl<H: InboxHandler + ?Sized> InboxHandler for Arc<H> {
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
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

/// Turns a closure returning a boxed future into an [`InboxHandler`]:
///
/// ```no_run
/// use outbox_rabbitmq::{HandlerFuture, Received, handler_fn};
/// use outbox_rabbitmq::sqlite::sqlx::SqliteConnection;
///
/// let handler = handler_fn(|msg: &Received, tx: &mut SqliteConnection| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         outbox_rabbitmq::sqlite::sqlx::query("INSERT INTO seen (id) VALUES (?)")
///             .bind(msg.id.to_string())
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     })
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F>(f: F) -> FnHandler<F>
where
    F: for<'a> Fn(&'a Received, &'a mut SqliteConnection) -> HandlerFuture<'a>
        + Send
        + Sync
        + 'static,
{
    FnHandler(f)
}

#[async_trait]
impl<F> InboxHandler for FnHandler<F>
where
    F: for<'a> Fn(&'a Received, &'a mut SqliteConnection) -> HandlerFuture<'a>
        + Send
        + Sync
        + 'static,
{
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        (self.0)(msg, tx).await
    }
}

/// Consumes a RabbitMQ queue into a SQLite inbox. Start one with
/// [`RabbitConsumer::builder`].
///
/// For each delivery, in order (one at a time; up to `prefetch` are
/// buffered):
///
/// 1. Decode it into a [`Received`]. No `message_id`, or one that is not a
///    UUID: rejected without requeue (the queue's dead-letter exchange gets
///    it, if it has one), with a warning.
/// 2. `BEGIN IMMEDIATE` on the pool; record `(consumer, message_id)` in the
///    inbox with [`SqliteOutbox::try_receive`]. Recorded before (a
///    duplicate): roll back and acknowledge — the handler does not run.
/// 3. Run the [`InboxHandler`] with the message and the transaction; on
///    `Ok`, commit, **then** acknowledge.
/// 4. Handler error, panic or timeout: roll back and requeue the delivery
///    (`basic.nack`, requeue, after `retry_delay`), counting the attempt in
///    this process by message id; at `max_attempts`, reject it without
///    requeue so that the queue's dead-letter exchange gets it.
/// 5. The database failing (begin, inbox insert, commit): roll back and
///    requeue after `retry_delay`, **not** counted (an outage must not
///    dead-letter good messages).
///
/// When the connection is lost it reconnects with exponential backoff and
/// consumes again; deliveries that were not acknowledged come back from the
/// broker (redelivered) and the inbox turns them into no-ops if they had
/// been committed.
#[derive(Debug)]
pub struct RabbitConsumer {
    _private: (),
}

impl RabbitConsumer {
    /// A consumer of `queue` on the broker at `url`
    /// (`amqp://user:password@host:port/vhost`).
    pub fn builder(url: impl Into<String>, queue: impl Into<String>) -> RabbitConsumerBuilder {
        Self::with_config(
            RabbitConfig::new(url).with_connection_name("outbox-rs consumer"),
            queue,
        )
    }

    /// A consumer of `queue` using the URL, connect timeout, reconnect
    /// backoff and connection name of `config` (its publishing settings are
    /// not used).
    pub fn with_config(config: RabbitConfig, queue: impl Into<String>) -> RabbitConsumerBuilder {
        let queue = queue.into();
        RabbitConsumerBuilder {
            config,
            consumer_name: queue.clone(),
            queue,
            prefetch: RabbitConsumerBuilder::DEFAULT_PREFETCH,
            max_attempts: RabbitConsumerBuilder::DEFAULT_MAX_ATTEMPTS,
            retry_delay: RabbitConsumerBuilder::DEFAULT_RETRY_DELAY,
            handler_timeout: RabbitConsumerBuilder::DEFAULT_HANDLER_TIMEOUT,
            inbox_retention: Some(RabbitConsumerBuilder::DEFAULT_INBOX_RETENTION),
            inbox_purge_interval: RabbitConsumerBuilder::DEFAULT_INBOX_PURGE_INTERVAL,
        }
    }
}

/// Configures a [`RabbitConsumer`]; finish with
/// [`spawn`](RabbitConsumerBuilder::spawn).
#[derive(Debug, Clone)]
pub struct RabbitConsumerBuilder {
    config: RabbitConfig,
    queue: String,
    consumer_name: String,
    prefetch: u16,
    max_attempts: u32,
    retry_delay: Duration,
    handler_timeout: Duration,
    inbox_retention: Option<Duration>,
    inbox_purge_interval: Duration,
}

impl RabbitConsumerBuilder {
    /// Default [`inbox_retention`](Self::inbox_retention): 7 days.
    pub const DEFAULT_INBOX_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Default [`inbox_purge_interval`](Self::inbox_purge_interval): 1 min.
    pub const DEFAULT_INBOX_PURGE_INTERVAL: Duration = Duration::from_secs(60);
    /// Inbox entries deleted per purge statement.
    pub const INBOX_PURGE_BATCH: usize = 500;

    /// Default [`prefetch`](Self::prefetch): 32.
    pub const DEFAULT_PREFETCH: u16 = 32;
    /// Default [`max_attempts`](Self::max_attempts): 3.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
    /// Default [`retry_delay`](Self::retry_delay): 200 ms.
    pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(200);
    /// Default [`handler_timeout`](Self::handler_timeout): 30 s.
    pub const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);

    /// The name recorded in the inbox with each message id (default: the
    /// queue name). Two consumers with the same name share deduplication.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer_name = name.into();
        self
    }

    /// How many unacknowledged deliveries the broker sends ahead (default 32).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How many times a delivery whose handler fails is tried before it is
    /// rejected to the dead-letter exchange (default 3). Counted in this
    /// process by message id: a restart starts counting again.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// How long a failed delivery waits before it is requeued (default
    /// 200 ms); other deliveries go on meanwhile.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Longest a handler may run before it counts as failed (default 30 s).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long inbox entries are kept (default 7 days; `None` keeps them
    /// forever). An entry must outlive every redelivery of its message —
    /// the sender's lease and retries, and an operator's retry of a
    /// poisoned message — or a late duplicate runs the handler again. The
    /// consumer purges older entries every
    /// [`inbox_purge_interval`](Self::inbox_purge_interval), in batches of
    /// [`INBOX_PURGE_BATCH`](Self::INBOX_PURGE_BATCH) that rest between
    /// them, beside its deliveries.
    pub fn inbox_retention(mut self, retention: Option<Duration>) -> Self {
        self.inbox_retention = retention;
        self
    }

    /// How often the inbox purge runs (default 1 min).
    pub fn inbox_purge_interval(mut self, interval: Duration) -> Self {
        self.inbox_purge_interval = interval;
        self
    }

    /// How long one connection attempt may take (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config = self.config.with_connect_timeout(timeout);
        self
    }

    /// First and longest delay between reconnect attempts (defaults 100 ms
    /// and 30 s, doubling, ±20 % jitter).
    pub fn reconnect_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config = self.config.with_reconnect_backoff(first, max);
        self
    }

    /// The connection name shown in the RabbitMQ management UI (default
    /// `outbox-rs consumer`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.config = self.config.with_connection_name(name);
        self
    }

    /// Checks every setting; the error names the field (and never contains
    /// the password).
    pub fn validate(&self) -> Result<()> {
        self.config.validate()?;
        if self.queue.is_empty() || self.queue.len() > MAX_SHORT_STRING {
            return Err(Error::config(
                "queue",
                format!("must be 1 to {MAX_SHORT_STRING} bytes long"),
            ));
        }
        if self.consumer_name.trim().is_empty() {
            return Err(Error::config("consumer_name", "must not be empty"));
        }
        if self.prefetch == 0 {
            return Err(Error::config(
                "prefetch",
                "must be at least 1 (0 would mean unlimited)",
            ));
        }
        if self.max_attempts == 0 {
            return Err(Error::config("max_attempts", "must be at least 1"));
        }
        if self.handler_timeout.is_zero() {
            return Err(Error::config(
                "handler_timeout",
                "must be greater than zero",
            ));
        }
        if self.inbox_retention.is_some_and(|r| r.is_zero()) {
            return Err(Error::config(
                "inbox_retention",
                "must be greater than zero (None keeps entries forever)",
            ));
        }
        if self.inbox_purge_interval.is_zero() {
            return Err(Error::config(
                "inbox_purge_interval",
                "must be greater than zero",
            ));
        }
        Ok(())
    }

    /// Checks the settings, connects, starts consuming and returns the
    /// handle of the running consumer (on the current tokio runtime).
    ///
    /// `outbox` gives the inbox table (and is how the handler enqueues
    /// replies); `pool` is the application's sqlx pool on the same database
    /// file. Fails with a clear error (password redacted) when a setting is
    /// invalid or the credentials are refused (`ErrorKind::Config`), the
    /// queue does not exist (`ErrorKind::NotFound`), or the broker cannot be
    /// reached (`ErrorKind::Unavailable`).
    pub async fn spawn(
        self,
        outbox: SqliteOutbox,
        pool: SqlitePool,
        handler: impl InboxHandler,
    ) -> Result<ConsumerHandle> {
        self.validate()?;
        let uri = self.config.parse_url()?;
        let shared = Arc::new(Shared {
            queue: self.queue.clone(),
            consumer_name: self.consumer_name.clone(),
            connected: AtomicBool::new(false),
            running: AtomicBool::new(true),
            counters: Counters::default(),
        });
        let worker = Worker {
            settings: self,
            uri,
            outbox,
            pool,
            handler: Arc::new(handler),
            attempts: HashMap::new(),
            shared: Arc::clone(&shared),
            delayed: JoinSet::new(),
        };
        let session = worker.open_session().await?;
        // Connected from here on: callers may check right after `spawn`.
        shared.connected.store(true, Ordering::SeqCst);
        tracing::info!(
            queue = %shared.queue,
            consumer = %shared.consumer_name,
            url = %worker.settings.config.redacted_url(),
            "consuming from RabbitMQ"
        );
        let (tx, rx) = watch::channel(false);
        let purger = worker.settings.inbox_retention.map(|retention| {
            tokio::spawn(purge_inbox_loop(
                worker.outbox.clone(),
                worker.pool.clone(),
                retention,
                worker.settings.inbox_purge_interval,
                rx.clone(),
            ))
        });
        let task = tokio::spawn(worker.run(session, rx));
        Ok(ConsumerHandle {
            shutdown: tx,
            task: Mutex::new(Some(task)),
            purger: Mutex::new(purger),
            shared,
        })
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
    /// Handler failures that were requeued for another try.
    pub retried: u64,
    /// Deliveries rejected to the dead-letter exchange after `max_attempts`
    /// handler failures.
    pub dead_lettered: u64,
    /// Deliveries rejected to the dead-letter exchange because they have no
    /// valid `message_id`.
    pub invalid: u64,
    /// Database failures (not counted as attempts): the delivery was requeued.
    pub store_errors: u64,
    /// Deliveries whose handler said
    /// [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable):
    /// tried again later, not counted as attempts.
    pub deferred: u64,
    /// Connections opened after the first one.
    pub reconnects: u64,
}

#[derive(Debug, Default)]
struct Counters {
    handled: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    invalid: AtomicU64,
    store_errors: AtomicU64,
    deferred: AtomicU64,
    reconnects: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
struct Shared {
    queue: String,
    consumer_name: String,
    connected: AtomicBool,
    running: AtomicBool,
    counters: Counters,
}

/// A running [`RabbitConsumer`]. Dropping it stops the consumer (without
/// waiting); [`shutdown`](ConsumerHandle::shutdown) stops it gracefully.
#[derive(Debug)]
pub struct ConsumerHandle {
    shutdown: watch::Sender<bool>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    purger: Mutex<Option<tokio::task::JoinHandle<()>>>,
    shared: Arc<Shared>,
}

/// Deletes inbox entries older than `retention` every `interval`, in
/// batches that rest between them, until shutdown.
async fn purge_inbox_loop(
    outbox: SqliteOutbox,
    pool: SqlitePool,
    retention: Duration,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    while !*shutdown.borrow() {
        let before = outbox_api::Timestamp::now().sub(retention);
        let stop = shutdown.clone();
        let purged = outbox_api::purge::purge_in_batches(
            RabbitConsumerBuilder::INBOX_PURGE_BATCH,
            || *stop.borrow(),
            |limit| outbox.purge_inbox(&pool, before, limit),
        )
        .await;
        match purged {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(purged = n, table = %outbox.inbox_table(), "purged inbox entries past retention")
            }
            Err(e) => tracing::warn!(error = %e, "inbox purge failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            // The handle is gone (dropped without shutdown): stop too.
            changed = shutdown.changed() => if changed.is_err() { return },
        }
    }
}

impl ConsumerHandle {
    /// Stops consuming (`basic.cancel`), lets the delivery in flight finish
    /// (committed and acknowledged, or rolled back and requeued), closes the
    /// channel and the connection — deliveries buffered but not started go
    /// back to the queue — and waits until all that is done.
    pub async fn shutdown(&self) {
        self.shutdown.send_replace(true);
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "consumer task ended abnormally");
            }
        }
        let purger = self.purger.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(purger) = purger {
            if let Err(e) = purger.await {
                tracing::error!(error = %e, "inbox purge task ended abnormally");
            }
        }
        self.shared.running.store(false, Ordering::SeqCst);
    }

    /// Whether the consumer still runs.
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::SeqCst)
    }

    /// Whether it is connected and consuming right now.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::SeqCst)
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.shared.queue
    }

    /// The consumer name recorded in the inbox.
    pub fn consumer_name(&self) -> &str {
        &self.shared.consumer_name
    }

    /// Counts since start.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            handled: get(&c.handled),
            duplicates: get(&c.duplicates),
            retried: get(&c.retried),
            dead_lettered: get(&c.dead_lettered),
            invalid: get(&c.invalid),
            store_errors: get(&c.store_errors),
            deferred: get(&c.deferred),
            reconnects: get(&c.reconnects),
        }
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// An open connection consuming the queue.
struct Session {
    connection: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
}

/// Entries of the in-process attempt counter kept at most (oldest dropped).
const MAX_TRACKED_ATTEMPTS: usize = 10_000;

struct Worker {
    settings: RabbitConsumerBuilder,
    uri: AMQPUri,
    outbox: SqliteOutbox,
    pool: SqlitePool,
    handler: Arc<dyn InboxHandler>,
    /// Handler failures so far, by message id, with when the last one happened.
    attempts: HashMap<MessageId, (u32, Instant)>,
    shared: Arc<Shared>,
    /// Requeues waiting for their retry delay.
    delayed: JoinSet<()>,
}

impl Worker {
    async fn open_session(&self) -> Result<Session> {
        let config = &self.settings.config;
        let queue = &self.settings.queue;
        let attempt = async {
            let properties = ConnectionProperties::default()
                .with_connection_name(LongString::from(config.connection_name.as_bytes()));
            let connection = Connection::connect_uri(self.uri.clone(), properties)
                .await
                .map_err(|e| connect_error(config, &self.uri, &e))?;
            let unavailable = |what: &str, e: lapin::Error| {
                Error::unavailable(format!(
                    "{what} on {}: {}",
                    config.redacted_url(),
                    config.scrub(&e.to_string())
                ))
            };
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| unavailable("opening a channel", e))?;
            channel
                .basic_qos(self.settings.prefetch, BasicQosOptions::default())
                .await
                .map_err(|e| unavailable("setting the prefetch", e))?;
            let tag = format!("{}-{}", self.settings.consumer_name, MessageId::new());
            let tag = ShortString::try_new(tag.chars().take(200).collect::<String>())
                .unwrap_or_else(|_| ShortString::from("outbox-rs"));
            let consumer = channel
                .basic_consume(
                    ShortString::from(queue.as_str()),
                    tag,
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    let not_found = matches!(
                        e.kind(),
                        lapin::ErrorKind::ProtocolError(a)
                            if *a.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                    );
                    if not_found {
                        Error::new(
                            outbox_api::ErrorKind::NotFound,
                            format!(
                                "queue `{queue}` does not exist on {}",
                                config.redacted_url()
                            ),
                        )
                    } else {
                        Error::unavailable(format!(
                            "consuming queue `{queue}` on {}: {}",
                            config.redacted_url(),
                            config.scrub(&e.to_string())
                        ))
                    }
                })?;
            Ok(Session {
                connection,
                channel,
                consumer,
            })
        };
        timeout(config.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(Error::unavailable(format!(
                    "connecting to RabbitMQ at {} timed out after {:?}",
                    config.redacted_url(),
                    config.connect_timeout
                )))
            })
    }

    async fn run(mut self, first: Session, mut shutdown: watch::Receiver<bool>) {
        let mut session = Some(first);
        let mut failures = 0u32;
        loop {
            if *shutdown.borrow() {
                break;
            }
            let current = match session.take() {
                Some(s) => s,
                None => match self.open_session().await {
                    Ok(s) => {
                        failures = 0;
                        bump(&self.shared.counters.reconnects);
                        tracing::info!(queue = %self.shared.queue, "reconnected to RabbitMQ; consuming again");
                        s
                    }
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let config = &self.settings.config;
                        let delay = backoff(config.reconnect_min, config.reconnect_max, failures);
                        tracing::warn!(
                            error = %e,
                            queue = %self.shared.queue,
                            failures,
                            retry_in_ms = delay.as_millis() as u64,
                            "consumer cannot reach RabbitMQ"
                        );
                        tokio::select! {
                            _ = tokio::time::sleep(delay) => {}
                            _ = shutdown.changed() => {}
                        }
                        continue;
                    }
                },
            };
            self.shared.connected.store(true, Ordering::SeqCst);
            let stopped = self.consume(current, &mut shutdown).await;
            self.shared.connected.store(false, Ordering::SeqCst);
            // Requeues still waiting are moot: the broker requeues every
            // unacknowledged delivery of a closed channel.
            self.delayed.abort_all();
            if stopped {
                break;
            }
        }
        self.shared.running.store(false, Ordering::SeqCst);
        tracing::info!(queue = %self.shared.queue, "consumer stopped");
    }

    /// Consumes until shutdown (returns `true`, after closing gracefully)
    /// or until the connection fails (returns `false`).
    async fn consume(&mut self, mut s: Session, shutdown: &mut watch::Receiver<bool>) -> bool {
        let mut check = tokio::time::interval(Duration::from_millis(500));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            while self.delayed.try_join_next().is_some() {}
            tokio::select! {
                biased;
                _ = shutdown.changed() => {
                    self.close(s).await;
                    return true;
                }
                next = s.consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        if !self.process(delivery).await {
                            tracing::warn!(queue = %self.shared.queue, "acknowledging failed; reconnecting");
                            return false;
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(
                            queue = %self.shared.queue,
                            error = %self.settings.config.scrub(&e.to_string()),
                            "RabbitMQ consumer failed; reconnecting"
                        );
                        return false;
                    }
                    None => {
                        tracing::warn!(queue = %self.shared.queue, "the broker cancelled the consumer; reconnecting");
                        return false;
                    }
                },
                _ = check.tick() => {
                    if !s.connection.status().connected() || !s.channel.status().connected() {
                        tracing::warn!(queue = %self.shared.queue, "RabbitMQ connection lost; reconnecting");
                        return false;
                    }
                }
            }
        }
    }

    /// Graceful stop: cancel the consumer, close channel and connection.
    async fn close(&mut self, s: Session) {
        let limit = self.settings.config.connect_timeout;
        if s.channel.status().connected() {
            let _ = timeout(
                limit,
                s.channel
                    .basic_cancel(s.consumer.tag(), BasicCancelOptions::default()),
            )
            .await;
            let _ = timeout(limit, s.channel.close(200, "consumer stopped".into())).await;
        }
        if s.connection.status().connected() {
            let _ = timeout(limit, s.connection.close(200, "consumer stopped".into())).await;
        }
    }

    /// Handles one delivery; `false` when acknowledging failed (the channel
    /// is gone).
    async fn process(&mut self, delivery: Delivery) -> bool {
        let mut received = match Received::decode(&delivery) {
            Ok(r) => r,
            Err(why) => {
                bump(&self.shared.counters.invalid);
                tracing::warn!(
                    queue = %self.shared.queue,
                    exchange = %delivery.exchange,
                    routing_key = %delivery.routing_key,
                    reason = %why,
                    "rejecting a delivery that cannot be handled (to the dead-letter exchange, if any)"
                );
                return settle(
                    delivery
                        .acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await,
                );
            }
        };
        let id = received.id;
        received.attempt = self.attempts.get(&id).map_or(0, |a| a.0) + 1;
        let span = tracing::info_span!(
            "outbox.receive",
            message.id = %id,
            message.type = received.message_type.as_deref(),
            message.key = received.key.as_deref(),
            trace_parent = received.trace_parent.as_deref(),
            consumer = %self.shared.consumer_name,
            queue = %self.shared.queue,
            redelivered = received.redelivered,
            attempt = received.attempt,
            outcome = tracing::field::Empty,
        );
        outbox_api::trace::continue_trace(&span, received.trace_parent.as_deref());
        let outcome = self.handle(&received).instrument(span.clone()).await;
        self.settle_outcome(delivery, &received, outcome, &span)
            .instrument(span.clone())
            .await
    }

    /// Acknowledges, requeues or dead-letters the delivery after handling.
    async fn settle_outcome(
        &mut self,
        delivery: Delivery,
        received: &Received,
        outcome: InboxOutcome,
        span: &tracing::Span,
    ) -> bool {
        let id = received.id;
        let counters = &self.shared.counters;
        match outcome {
            InboxOutcome::Committed => {
                span.record("outcome", "handled");
                bump(&counters.handled);
                self.attempts.remove(&id);
                settle(delivery.acker.ack(BasicAckOptions::default()).await)
            }
            InboxOutcome::Duplicate => {
                span.record("outcome", "duplicate");
                bump(&counters.duplicates);
                self.attempts.remove(&id);
                tracing::debug!("already handled (inbox); acknowledging");
                settle(delivery.acker.ack(BasicAckOptions::default()).await)
            }
            InboxOutcome::HandlerFailed(error)
                if received.attempt >= self.settings.max_attempts =>
            {
                span.record("outcome", "dead-lettered");
                bump(&counters.dead_lettered);
                self.attempts.remove(&id);
                tracing::error!(
                    %error,
                    attempts = received.attempt,
                    "handler failed on its last attempt; rejecting to the dead-letter exchange"
                );
                settle(
                    delivery
                        .acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await,
                )
            }
            InboxOutcome::HandlerFailed(error) => {
                span.record("outcome", "failed");
                bump(&counters.retried);
                self.remember_attempt(id, received.attempt);
                tracing::warn!(
                    %error,
                    attempts = received.attempt,
                    max_attempts = self.settings.max_attempts,
                    "handler failed; the delivery will be retried"
                );
                self.requeue(delivery).await
            }
            InboxOutcome::HandlerUnavailable { reason, .. } => {
                span.record("outcome", "unavailable");
                bump(&counters.deferred);
                tracing::warn!(%reason, "handler temporarily unavailable (not counted as an attempt); requeueing");
                self.requeue(delivery).await
            }
            InboxOutcome::StoreFailed(error) => {
                span.record("outcome", "store-failed");
                bump(&counters.store_errors);
                tracing::warn!(%error, "the inbox database failed (not counted as an attempt); requeueing");
                self.requeue(delivery).await
            }
        }
    }

    fn remember_attempt(&mut self, id: MessageId, attempt: u32) {
        if self.attempts.len() >= MAX_TRACKED_ATTEMPTS {
            let mut by_age: Vec<(Instant, MessageId)> = self
                .attempts
                .iter()
                .map(|(id, (_, at))| (*at, *id))
                .collect();
            by_age.sort();
            for (_, old) in by_age.into_iter().take(MAX_TRACKED_ATTEMPTS / 10) {
                self.attempts.remove(&old);
            }
        }
        self.attempts.insert(id, (attempt, Instant::now()));
    }

    /// Requeues the delivery after the retry delay, without holding up the
    /// deliveries behind it.
    async fn requeue(&mut self, delivery: Delivery) -> bool {
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let delay = self.settings.retry_delay;
        if delay.is_zero() {
            return settle(delivery.acker.nack(options).await);
        }
        let acker = delivery.acker;
        self.delayed.spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = acker.nack(options).await;
        });
        true
    }

    /// The inbox transaction around the handler.
    async fn handle(&self, received: &Received) -> InboxOutcome {
        let handler = &self.handler;
        self.outbox
            .receive_once(
                &self.pool,
                &self.shared.consumer_name,
                received.id,
                self.settings.handler_timeout,
                async |tx| handler.handle(received, tx).await,
            )
            .await
    }
}

/// `true` when an ack/nack/reject went out.
fn settle(result: lapin::Result<bool>) -> bool {
    matches!(result, Ok(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_a_delivery() {
        let id = MessageId::new();
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from(TRACEPARENT_HEADER),
            AMQPValue::LongString(LongString::from(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )),
        );
        headers.insert(
            ShortString::from(KEY_HEADER),
            AMQPValue::LongString(LongString::from("order-1")),
        );
        headers.insert(ShortString::from("n"), AMQPValue::LongInt(7));
        let mut d = Delivery::mock(1, "x".into(), "rk".into(), true, b"{}".to_vec());
        d.properties = lapin::BasicProperties::default()
            .with_message_id(ShortString::from(id.to_string()))
            .with_type(ShortString::from("OrderPlaced"))
            .with_timestamp(5)
            .with_headers(headers);
        let r = Received::decode(&d).unwrap();
        assert_eq!(r.id, id);
        assert_eq!(r.message_type.as_deref(), Some("OrderPlaced"));
        assert_eq!(r.key.as_deref(), Some("order-1"));
        assert!(r.trace_parent.as_deref().unwrap().contains("0af7651916cd"));
        assert_eq!(r.header("n"), Some("7"));
        assert_eq!(r.timestamp, Some(Timestamp::from_millis(5000)));
        assert!(r.redelivered);
        assert_eq!((r.exchange.as_str(), r.routing_key.as_str()), ("x", "rk"));

        let mut bad = Delivery::mock(2, "".into(), "q".into(), false, vec![]);
        assert!(
            Received::decode(&bad)
                .unwrap_err()
                .contains("no message_id")
        );
        bad.properties = lapin::BasicProperties::default().with_message_id("nope".into());
        assert!(
            Received::decode(&bad)
                .unwrap_err()
                .contains("not a message id")
        );
    }

    #[test]
    fn bad_settings_name_the_field() {
        let b = || RabbitConsumer::builder("amqp://u:secretpw@h:5672/%2f", "q");
        b().validate().unwrap();
        let e = b().prefetch(0).validate().unwrap_err();
        assert!(e.to_string().contains("prefetch"), "{e}");
        let e = b().max_attempts(0).validate().unwrap_err();
        assert!(e.to_string().contains("max_attempts"), "{e}");
        let e = RabbitConsumer::builder("amqp://u:secretpw@h:5672/%2f", "")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("queue"), "{e}");
        let e = RabbitConsumer::builder("amqp://u:secretpw@h:bad/%2f", "q")
            .validate()
            .unwrap_err();
        assert!(!e.to_string().contains("secretpw"), "{e}");
    }
}
