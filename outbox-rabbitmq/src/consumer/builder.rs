//! [`RabbitConsumer`] and its settings, [`RabbitConsumerBuilder`]: checked,
//! then spawned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_api::receive::{Attempts, Counters, Held, RetryRules, purge_inbox_loop};
use outbox_api::{Error, Result};
use tokio::sync::watch;

use super::InboxHandler;
#[cfg(doc)]
use super::Received;
use super::handle::{ConsumerHandle, Shared};
use super::session::{Worker, owner_marker};
use crate::Partitions;
use crate::config::{MAX_SHORT_STRING, RabbitConfig};
use outbox_api::receive::{BoundInbox, bind};

/// Consumes a RabbitMQ queue into any store's
/// [`Inbox`](outbox_api::Inbox) (`SqliteInbox`, `PgInbox`, `MemoryInbox`).
/// Start one with [`RabbitConsumer::builder`], then
/// [`spawn`](RabbitConsumerBuilder::spawn) it with the inbox and the
/// handler.
///
/// For each delivery, in order (one at a time; up to `prefetch` are
/// buffered):
///
/// 1. Decode it into a [`Received`]. No `message_id`, or one that is not a
///    UUID: rejected without requeue (the queue's dead-letter exchange gets
///    it, if it has one), with a warning.
/// 2. If an earlier delivery of the same ordering key ([`Received::key`])
///    waits for a retry, hold this one behind it (see *Order* below).
/// 3. Run the store's inbox transaction
///    ([`Inbox::receive_once`](outbox_api::Inbox::receive_once)): begin (`BEGIN IMMEDIATE` on SQLite);
///    record `(consumer, message_id)` in the inbox — a duplicate is
///    acknowledged without running the handler; run the [`InboxHandler`]
///    (time limit, panics caught); on `Ok`, commit, **then** acknowledge.
/// 4. Handler error, panic or timeout: rolled back; the delivery is tried
///    again **in place** after [`retry_delay`](RabbitConsumerBuilder::retry_delay),
///    counting the attempt in this process by message id; at
///    [`max_attempts`](RabbitConsumerBuilder::max_attempts), it is rejected
///    without requeue so that the queue's dead-letter exchange gets it.
/// 5. The handler says
///    [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable), or the
///    database fails (begin, inbox insert, commit): rolled back and tried
///    again in place after the
///    [`unavailable_backoff`](RabbitConsumerBuilder::unavailable_backoff)
///    (growing per consecutive try, capped; a handler's `retry_after` is
///    honoured), **not** counted: an outage of a downstream must not
///    dead-letter good messages.
///
/// # Order
///
/// Deliveries of one ordering key are handled in the order the broker
/// delivers them, retries included: a delivery waiting for its retry holds
/// back the later deliveries *of its key* (in memory, unacknowledged) until
/// it is acknowledged or dead-lettered; other keys go on meanwhile. A
/// message without a key holds nothing back. Held deliveries keep their
/// prefetch slots: if `prefetch` of them wait behind one key, nothing else
/// arrives until that key moves, so give `prefetch` room for the keys that
/// may be retrying at once. A retry is never a requeue (`basic.nack` would
/// put the delivery at the queue's head, behind the later deliveries of its
/// key already buffered here), so [`Received::redelivered`] stays as the
/// broker first said.
///
/// When the connection is lost it reconnects with exponential backoff and
/// consumes again; deliveries that were not acknowledged, held ones
/// included, come back from the broker (redelivered, in queue order) and the
/// inbox turns them into no-ops if they had been committed.
#[derive(Debug)]
pub struct RabbitConsumer {
    _private: (),
}

impl RabbitConsumer {
    /// A consumer of `queue` on the broker at `url`
    /// (`amqp://user:password@host:port/vhost`).
    pub fn builder(url: impl Into<String>, queue: impl Into<String>) -> RabbitConsumerBuilder {
        Self::with_config(
            RabbitConfig::new(url).connection_name("outbox-rs consumer"),
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
            unavailable_backoff: RabbitConsumerBuilder::DEFAULT_UNAVAILABLE_BACKOFF,
            handler_timeout: RabbitConsumerBuilder::DEFAULT_HANDLER_TIMEOUT,
            inbox_retention: Some(RabbitConsumerBuilder::DEFAULT_INBOX_RETENTION),
            inbox_purge_interval: RabbitConsumerBuilder::DEFAULT_INBOX_PURGE_INTERVAL,
            partitions: None,
            replica: (0, 1),
            takeover_check: RabbitConsumerBuilder::DEFAULT_TAKEOVER_CHECK,
        }
    }

    /// A consumer of every partition queue of `partitions` (declared with
    /// [`Topology::partitioned`](crate::Topology::partitioned)) on the
    /// broker at `url`; the inbox consumer name defaults to the prefix.
    ///
    /// Each partition has a single active consumer, so a key's messages are
    /// handled by one process at a time, in order. Run one such consumer per
    /// replica of the service, each with its own
    /// [`replica`](RabbitConsumerBuilder::replica) index: a replica
    /// subscribes at once to the partitions it owns (`i % replicas ==
    /// index`) and stands by for the others — it takes one over when no
    /// consumer is on it (its owner died or is not running), and hands it
    /// back as soon as another consumer waits for it (the owner is back).
    /// Partitions thus spread over the replicas and fail over when one dies.
    pub fn partitioned(url: impl Into<String>, partitions: Partitions) -> RabbitConsumerBuilder {
        let mut builder = Self::builder(url, partitions.prefix());
        builder.partitions = Some(partitions);
        builder
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
    pub(super) unavailable_backoff: (Duration, Duration),
    pub(super) handler_timeout: Duration,
    pub(super) inbox_retention: Option<Duration>,
    pub(super) inbox_purge_interval: Duration,
    pub(super) partitions: Option<Partitions>,
    pub(super) replica: (u16, u16),
    pub(super) takeover_check: Duration,
}

impl RabbitConsumerBuilder {
    /// Default [`inbox_retention`](Self::inbox_retention): 7 days.
    pub const DEFAULT_INBOX_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Default [`inbox_purge_interval`](Self::inbox_purge_interval): 1 min.
    pub const DEFAULT_INBOX_PURGE_INTERVAL: Duration = Duration::from_secs(60);
    /// Inbox entries deleted per purge statement.
    pub const INBOX_PURGE_BATCH: usize = outbox_api::receive::INBOX_PURGE_BATCH;

    /// Default [`prefetch`](Self::prefetch): 32.
    pub const DEFAULT_PREFETCH: u16 = 32;
    /// Default [`max_attempts`](Self::max_attempts): 3.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
    /// Default [`retry_delay`](Self::retry_delay): 200 ms.
    pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(200);
    /// Default [`unavailable_backoff`](Self::unavailable_backoff): 200 ms,
    /// at most 30 s.
    pub const DEFAULT_UNAVAILABLE_BACKOFF: (Duration, Duration) =
        (Duration::from_millis(200), Duration::from_secs(30));
    /// Default [`takeover_check`](Self::takeover_check): 1 s.
    pub const DEFAULT_TAKEOVER_CHECK: Duration = Duration::from_secs(1);

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
    /// process by message id: a restart starts counting again. Only handler
    /// errors, panics and timeouts count; `TemporarilyUnavailable` and
    /// database failures do not.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// How long a delivery whose handler failed waits before it is tried
    /// again, in place (default 200 ms). Later deliveries of its key wait
    /// behind it; other keys go on meanwhile.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// First and longest delay before a delivery is tried again after an
    /// outage — its handler said
    /// [`TemporarilyUnavailable`](outbox_api::TemporarilyUnavailable), or the
    /// inbox database failed — not counted as an attempt (defaults 200 ms
    /// and 30 s; doubling per consecutive outage of that delivery, ±20 %
    /// jitter). A handler's
    /// [`retry_after`](outbox_api::TemporarilyUnavailable::retry_after) is
    /// honoured as the least delay. Later deliveries of its key wait behind
    /// it.
    pub fn unavailable_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.unavailable_backoff = (first, max);
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

    /// Partitioned consumers ([`RabbitConsumer::partitioned`]): this
    /// process is replica `index` of `replicas` (0-based; default 0 of 1,
    /// which owns every partition). It owns the partitions `i` with `i %
    /// replicas == index` and stands by for the others.
    pub fn replica(mut self, index: u16, replicas: u16) -> Self {
        self.replica = (index, replicas);
        self
    }

    /// Partitioned consumers: how often a standby partition checks whether
    /// it has a consumer (to take it over when not), and a taken-over one
    /// whether another consumer waits (to hand it back) (default 1 s,
    /// ±20 % jitter). The failover time of a partition whose consumer died.
    pub fn takeover_check(mut self, every: Duration) -> Self {
        self.takeover_check = every;
        self
    }

    /// How long one connection attempt may take (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config = self.config.connect_timeout(timeout);
        self
    }

    /// First and longest delay between reconnect attempts (defaults 100 ms
    /// and 30 s, doubling, ±20 % jitter).
    pub fn reconnect_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.config = self.config.reconnect_backoff(first, max);
        self
    }

    /// The connection name shown in the RabbitMQ management UI (default
    /// `outbox-rs consumer`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.config = self.config.connection_name(name);
        self
    }

    /// The retry rules these settings make.
    pub(super) fn rules(&self) -> RetryRules {
        RetryRules {
            max_attempts: self.max_attempts,
            retry_delay: self.retry_delay,
            unavailable_backoff: self.unavailable_backoff,
        }
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
        let (first, max) = self.unavailable_backoff;
        if first.is_zero() || max < first {
            return Err(Error::config(
                "unavailable_backoff",
                format!("needs 0 < first <= max (got {first:?} and {max:?})"),
            ));
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
        let (index, replicas) = self.replica;
        outbox_api::partition::check_replica(
            index,
            replicas,
            self.partitions.is_some(),
            "RabbitConsumer::partitioned",
        )?;
        if let Some(p) = &self.partitions {
            let longest = owner_marker(&p.queue(p.count().saturating_sub(1)));
            if longest.len() > MAX_SHORT_STRING {
                return Err(Error::config(
                    "partitions",
                    format!("queue name `{longest}` is over {MAX_SHORT_STRING} bytes"),
                ));
            }
        }
        if self.takeover_check.is_zero() {
            return Err(Error::config("takeover_check", "must be greater than zero"));
        }
        if self.inbox_purge_interval.is_zero() {
            return Err(Error::config(
                "inbox_purge_interval",
                "must be greater than zero",
            ));
        }
        Ok(())
    }

    /// Checks the settings, connects, starts consuming into `inbox` with
    /// `handler` run in each of its transactions, and returns the handle of
    /// the running consumer (on the current tokio runtime).
    ///
    /// `inbox` is the store's [`Inbox`](outbox_api::Inbox) on the
    /// application's database: `SqliteInbox::new(outbox, pool)`,
    /// `PgInbox::new(outbox, pool)` (one connection per delivery in flight,
    /// one more while the inbox purge runs) or `MemoryInbox::new(store)`;
    /// the handler enqueues replies with that store's outbox. Fails with a
    /// clear error (password redacted) when a setting is invalid or the
    /// credentials are refused (`ErrorKind::Config`), the queue does not
    /// exist (`ErrorKind::NotFound`), or the broker cannot be reached
    /// (`ErrorKind::Unavailable`).
    pub async fn spawn<I: outbox_api::Inbox>(
        self,
        inbox: I,
        handler: impl InboxHandler<I::Conn>,
    ) -> Result<ConsumerHandle> {
        self.spawn_on(bind(inbox, Arc::new(handler))).await
    }

    async fn spawn_on(self, inbox: BoundInbox) -> Result<ConsumerHandle> {
        self.validate()?;
        let uri = self.config.parse_url()?;
        let counters = Arc::new(Counters::default());
        // (queue, standby) for each queue consumed.
        let queues: Vec<(String, bool)> = match &self.partitions {
            None => vec![(self.queue.clone(), false)],
            Some(p) => {
                let (index, replicas) = self.replica;
                (0..p.count())
                    .map(|i| (p.queue(i), i % replicas != index))
                    .collect()
            }
        };
        let (tx, rx) = watch::channel(false);
        let mut workers = Vec::new();
        for (queue, standby) in queues {
            let shared = Arc::new(Shared {
                queue: queue.clone(),
                consumer_name: self.consumer_name.clone(),
                connected: AtomicBool::new(false),
                running: AtomicBool::new(true),
                standby,
                counters: Arc::clone(&counters),
                meter: crate::metrics::ConsumerMeter::new(&queue, &self.consumer_name),
            });
            let worker = Worker {
                settings: self.clone(),
                marker: self.partitions.as_ref().map(|_| owner_marker(&queue)),
                queue,
                uri: uri.clone(),
                inbox: inbox.clone(),
                attempts: Attempts::default(),
                shared,
                held: Held::default(),
                stop: rx.clone(),
            };
            // What this process owns is consumed from the start: a setting
            // the broker refuses fails here, clearly.
            let session = if standby {
                None
            } else {
                let session = worker.open_session().await?;
                // Connected from here on: callers may check right after `spawn`.
                worker.shared.connected.store(true, Ordering::SeqCst);
                Some(session)
            };
            workers.push((worker, session));
        }
        tracing::info!(
            queue = %self.queue,
            partitions = self.partitions.as_ref().map(|p| p.count()),
            replica = self.replica.0,
            replicas = self.replica.1,
            consumer = %self.consumer_name,
            inbox = %inbox.table(),
            url = %self.config.redacted_url(),
            "consuming from RabbitMQ"
        );
        let purger = self.inbox_retention.map(|retention| {
            let purging = inbox.clone();
            tokio::spawn(purge_inbox_loop(
                purging.table(),
                move |before, limit| {
                    let inbox = purging.clone();
                    async move { inbox.purge(before, limit).await }
                },
                retention,
                self.inbox_purge_interval,
                rx.clone(),
            ))
        });
        let shared: Vec<Arc<Shared>> = workers.iter().map(|(w, _)| Arc::clone(&w.shared)).collect();
        let tasks = workers
            .into_iter()
            .map(|(worker, session)| tokio::spawn(worker.run(session, rx.clone())))
            .collect();
        Ok(ConsumerHandle {
            shutdown: tx,
            tasks: Mutex::new(tasks),
            purger: Mutex::new(purger),
            name: self.queue,
            consumer_name: self.consumer_name,
            queues: shared,
            counters,
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
        let e = b()
            .unavailable_backoff(Duration::from_secs(2), Duration::from_secs(1))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("unavailable_backoff"), "{e}");
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
