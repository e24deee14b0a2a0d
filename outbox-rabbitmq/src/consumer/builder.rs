//! [`RabbitConsumer`] and its settings, [`RabbitConsumerBuilder`]: checked,
//! then spawned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_api::{Error, Result};
use outbox_sqlite::SqliteOutbox;
use outbox_sqlite::sqlx::SqlitePool;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::InboxHandler;
use super::handle::{ConsumerHandle, Counters, Shared, purge_inbox_loop};
use super::session::Worker;
use crate::config::{MAX_SHORT_STRING, RabbitConfig};

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
    pub(super) config: RabbitConfig,
    pub(super) queue: String,
    pub(super) consumer_name: String,
    pub(super) prefetch: u16,
    pub(super) max_attempts: u32,
    pub(super) retry_delay: Duration,
    pub(super) handler_timeout: Duration,
    pub(super) inbox_retention: Option<Duration>,
    pub(super) inbox_purge_interval: Duration,
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

#[cfg(test)]
mod tests {
    use super::*;

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
