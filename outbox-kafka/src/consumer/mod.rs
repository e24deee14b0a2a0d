//! [`KafkaConsumer`]: consumes Kafka topics as a consumer group into any
//! store's [`Inbox`](outbox_api::Inbox), so that at-least-once delivery
//! gives exactly-once effects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[cfg(doc)]
use outbox_api::receive::Received;
use outbox_api::receive::{
    ConsumerStats, Counters, InboxHandler, RetryRules, bind, purge_inbox_loop,
};
use outbox_api::{Error, ErrorKind, Result};
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use tokio::sync::watch;

use crate::KafkaConfig;
use crate::config::check_topic;

mod context;
mod offsets;
mod worker;

/// Header of a dead letter: why it was dead-lettered.
pub const DEAD_REASON_HEADER: &str = "outbox-dead-reason";
/// Header of a dead letter: the topic it was received from.
pub const DEAD_TOPIC_HEADER: &str = "outbox-dead-topic";
/// Header of a dead letter: its partition and offset there (`3/1042`).
pub const DEAD_OFFSET_HEADER: &str = "outbox-dead-offset";
/// Header of a dead letter: the consumer group that gave up on it.
pub const DEAD_GROUP_HEADER: &str = "outbox-dead-group";
/// Header of a dead letter: the handler failures it took.
pub const DEAD_ATTEMPTS_HEADER: &str = "outbox-dead-attempts";

/// Consumer properties the consumer's guarantees rest on, with the value it
/// sets: [`KafkaConsumerBuilder::set`] and [`KafkaConfig::set`] cannot
/// change them.
const FIXED: &[(&str, &str)] = &[
    // Offsets are committed by the consumer itself, only below the oldest
    // message not settled yet.
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
    // Subscribing never creates a topic.
    ("allow.auto.create.topics", "false"),
    // The classic group protocol with an eager assignor: a rebalance
    // revokes every partition, and the consumer lets go of all it holds.
    ("partition.assignment.strategy", "range,roundrobin"),
    ("group.protocol", "classic"),
];

/// Consumes Kafka topics into an inbox, as a member of a consumer group.
///
/// Each record is decoded ([`Received`]: the `outbox-id` header is the
/// inbox key, the `outbox-key` header or else the Kafka key the ordering
/// key), run through the inbox with the handler, and settled by
/// [`RetryRules::settle`], as for every consumer of this project: a failed
/// handler is tried again **in place** after `retry_delay`, later records of
/// its key held behind it (other keys go on); at `max_attempts` it is
/// produced to the dead-letter topic (acknowledged by the brokers) and
/// passed; an outage of the handler's downstream or of the database is
/// retried uncounted with a growing backoff.
///
/// **Offsets** are committed only after the inbox transaction committed
/// (or the record was found a duplicate, or dead-lettered), and never past
/// a record not settled yet: a partition's committed offset is its oldest
/// unsettled record. After a crash, or when a rebalance moves a partition,
/// it is read again from there; the inbox turns what was handled past it
/// into duplicates. Nothing is lost and each effect happens once.
///
/// **Order**: a key's records are in one partition (the transport uses the
/// message key as the Kafka key), and one member of the group reads a
/// partition at a time. A rebalance revokes every partition (an eager
/// assignor; the cooperative one is refused): the consumer commits what is
/// safe, forgets what it held, and the next owner starts at the oldest
/// record not settled, so a key's records run in order across members.
///
/// Records received and not settled are bounded by
/// [`max_in_flight`](KafkaConsumerBuilder::max_in_flight): past it, the
/// consumer pauses fetching (it keeps polling, so the group keeps it).
pub struct KafkaConsumer;

impl KafkaConsumer {
    /// A member of the consumer group `group` reading `topics` from the
    /// brokers `config` names (its security properties apply; its producer
    /// properties serve the dead letters). `group` is also the consumer
    /// name recorded in the inbox.
    pub fn builder<T: Into<String>>(
        config: KafkaConfig,
        topics: impl IntoIterator<Item = T>,
        group: impl Into<String>,
    ) -> KafkaConsumerBuilder {
        let group = group.into();
        KafkaConsumerBuilder {
            config,
            topics: topics.into_iter().map(Into::into).collect(),
            dead_letter_topic: format!("outbox-dead.{group}"),
            group,
            max_in_flight: 256,
            commit_interval: Duration::from_millis(200),
            session_timeout: Duration::from_secs(10),
            rules: RetryRules {
                max_attempts: 5,
                retry_delay: Duration::from_secs(1),
                unavailable_backoff: (Duration::from_millis(100), Duration::from_secs(30)),
            },
            handler_timeout: Duration::from_secs(30),
            inbox_retention: Some(Duration::from_secs(7 * 24 * 3600)),
            inbox_purge_interval: Duration::from_secs(60),
            properties: BTreeMap::new(),
        }
    }
}

/// Settings of a [`KafkaConsumer`]; finish with [`spawn`](Self::spawn).
#[derive(Debug, Clone)]
pub struct KafkaConsumerBuilder {
    config: KafkaConfig,
    topics: Vec<String>,
    group: String,
    dead_letter_topic: String,
    max_in_flight: usize,
    commit_interval: Duration,
    session_timeout: Duration,
    rules: RetryRules,
    handler_timeout: Duration,
    inbox_retention: Option<Duration>,
    inbox_purge_interval: Duration,
    properties: BTreeMap<String, String>,
}

/// How long the consume loop may run records of one key back to back
/// before it polls the consumer again (which serves rebalances).
const LANE_SLICE: Duration = Duration::from_millis(500);

/// librdkafka's `max.poll.interval.ms`: a member that does not poll for
/// that long leaves the group. The loop polls between records, so one
/// record's handler (bounded by `handler_timeout`) is the longest gap.
const MAX_POLL_INTERVAL: Duration = Duration::from_secs(300);

impl KafkaConsumerBuilder {
    /// Records received and not settled at most (default 256), held ones
    /// included: past it, fetching pauses until some settle.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// How often settled offsets are committed (default 200 ms; also on
    /// every rebalance and at shutdown). A crash loses at most this much
    /// of committing: those records come again and are duplicates.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every;
        self
    }

    /// How long the group coordinator waits for a member's heartbeat
    /// before it moves the member's partitions to the others (default
    /// 10 s; `session.timeout.ms`): how soon a crashed member's partitions
    /// are read again.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Handler failures before the record is dead-lettered (default 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.rules.max_attempts = attempts;
        self
    }

    /// The delay before trying a failed record again (default 1 s).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.rules.retry_delay = delay;
        self
    }

    /// First and longest delay of the uncounted retries (default 100 ms
    /// to 30 s).
    pub fn unavailable_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.rules.unavailable_backoff = (first, max);
        self
    }

    /// How long the handler may run (default 30 s); past it, the inbox
    /// transaction rolls back and the try counts as failed.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// Where dead letters are produced (default `outbox-dead.{group}`): a
    /// topic that must exist (the consumer never creates one). A dead
    /// letter carries the record's key, headers and value, and
    /// [`DEAD_REASON_HEADER`] and its siblings.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = topic.into();
        self
    }

    /// How long inbox entries are kept (default 7 days; `None` keeps them
    /// forever). An entry must outlive every redelivery of its message —
    /// the sender's lease and retries, an operator's retry of a poisoned
    /// message, a partition read again from an old committed offset — or a
    /// late duplicate runs the handler again. Older entries are purged
    /// every [`inbox_purge_interval`](Self::inbox_purge_interval) in small
    /// batches, beside the deliveries.
    pub fn inbox_retention(mut self, retention: Option<Duration>) -> Self {
        self.inbox_retention = retention;
        self
    }

    /// How often the inbox purge runs (default 1 min).
    pub fn inbox_purge_interval(mut self, interval: Duration) -> Self {
        self.inbox_purge_interval = interval;
        self
    }

    /// Sets a librdkafka consumer property (`client.id`,
    /// `fetch.max.bytes`, …), over the same property of the
    /// [`KafkaConfig`]. The properties the consumer's guarantees rest on
    /// (automatic commits off, an eager assignor, no topic creation)
    /// cannot be changed: [`spawn`](Self::spawn) refuses, naming it.
    pub fn set(mut self, property: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(property.into(), value.into());
        self
    }

    /// Checks the settings; a `Config` error names the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        self.config.validate()?;
        if self.group.trim().is_empty() {
            return Err(Error::config("group", "the consumer group's name is empty"));
        }
        if self.topics.is_empty() {
            return Err(Error::config("topics", "no topic to consume"));
        }
        for topic in &self.topics {
            check_topic(topic).map_err(|why| Error::config("topics", why))?;
        }
        check_topic(&self.dead_letter_topic)
            .map_err(|why| Error::config("dead_letter_topic", why))?;
        if self.topics.contains(&self.dead_letter_topic) {
            return Err(Error::config(
                "dead_letter_topic",
                format!(
                    "`{}` is also consumed: dead letters would come back to the handler",
                    self.dead_letter_topic
                ),
            ));
        }
        if self.max_in_flight == 0 {
            return Err(Error::config("max_in_flight", "must be at least 1"));
        }
        if self.rules.max_attempts == 0 {
            return Err(Error::config("max_attempts", "must be at least 1"));
        }
        for (name, d) in [
            ("handler_timeout", self.handler_timeout),
            ("commit_interval", self.commit_interval),
            ("session_timeout", self.session_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::config(name, "must be longer than zero"));
            }
        }
        if self.handler_timeout >= MAX_POLL_INTERVAL {
            return Err(Error::config(
                "handler_timeout",
                format!(
                    "{:?} must be below {MAX_POLL_INTERVAL:?}: a member that does not poll for \
                     that long leaves its group",
                    self.handler_timeout
                ),
            ));
        }
        for (property, fixed) in FIXED {
            let set = self
                .properties
                .get(*property)
                .or_else(|| self.config.extra.get(*property));
            if let Some(v) = set
                && v != fixed
            {
                return Err(Error::config(
                    property,
                    format!(
                        "`{property}` must stay `{fixed}` for the consumer: its guarantees rest \
                         on it (docs/rules.md, Kafka), and `{v}` would weaken them"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The librdkafka configuration of the consumer.
    fn consumer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        let session = self.session_timeout.as_millis();
        c.set("bootstrap.servers", &self.config.bootstrap)
            .set("group.id", &self.group)
            // A group that never committed starts at the oldest record: a
            // message published before the first member started is not
            // skipped.
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", session.to_string())
            .set("heartbeat.interval.ms", (session / 3).max(1).to_string())
            .set(
                "max.poll.interval.ms",
                MAX_POLL_INTERVAL.as_millis().to_string(),
            )
            .set("enable.partition.eof", "false")
            // Whether a broker connection is up (see the statistics).
            .set("statistics.interval.ms", "250")
            .set("reconnect.backoff.max.ms", "1000");
        for (k, v) in self.config.extra.iter().chain(&self.properties) {
            c.set(k, v);
        }
        for (k, v) in FIXED {
            c.set(*k, *v);
        }
        c
    }

    /// Creates the consumer, checks that the topics and the dead-letter
    /// topic exist, joins the group and starts consuming on the current
    /// tokio runtime.
    ///
    /// Fails with a `Config` error for bad settings or a dead-letter topic
    /// that does not exist, `NotFound` when a consumed topic does not
    /// exist, `Unavailable` when no broker answers within the
    /// configuration's metadata timeout. Secrets never appear in the error.
    pub async fn spawn<I: outbox_api::Inbox>(
        self,
        inbox: I,
        handler: impl InboxHandler<I::Conn>,
    ) -> Result<KafkaConsumerHandle> {
        self.validate()?;
        let counters = Arc::new(Counters::default());
        let shared = Arc::new(context::Shared::new(
            self.config.clone(),
            self.group.clone(),
            counters.clone(),
        ));
        let consumer: StreamConsumer<context::Context> = self
            .consumer_config()
            .create_with_context(context::Context(shared.clone()))
            .map_err(|e| {
                Error::config(
                    "consumer",
                    self.config.scrub(&format!(
                        "librdkafka refused the consumer's configuration: {e}"
                    )),
                )
            })?;
        let consumer = Arc::new(consumer);
        self.check_topics(&consumer).await?;
        let dead = crate::transport::create_producer(&self.config)?;
        consumer
            .subscribe(&self.topics.iter().map(String::as_str).collect::<Vec<_>>())
            .map_err(|e| {
                Error::unavailable(
                    self.config
                        .scrub(&format!("subscribing to {:?}: {e}", self.topics)),
                )
            })?;
        let running = Arc::new(AtomicBool::new(true));
        let (stop, stopped) = watch::channel(false);
        let inbox = bind(inbox, Arc::new(handler));
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
                stopped.clone(),
            ))
        });
        tracing::info!(
            topics = ?self.topics,
            group = %self.group,
            inbox = %inbox.table(),
            "consuming from Kafka"
        );
        let worker = worker::Worker::new(self, consumer, dead, inbox, shared.clone(), stopped);
        let flag = running.clone();
        let task = tokio::spawn(async move {
            worker.run().await;
            flag.store(false, Ordering::SeqCst);
        });
        Ok(KafkaConsumerHandle {
            stop,
            task: tokio::sync::Mutex::new(Some(task)),
            purger: tokio::sync::Mutex::new(purger),
            counters,
            running,
            shared,
        })
    }

    /// Asks the brokers whether the topics and the dead-letter topic exist.
    async fn check_topics(&self, consumer: &Arc<StreamConsumer<context::Context>>) -> Result<()> {
        let consumer = consumer.clone();
        let timeout = self.config.metadata_timeout;
        let (bootstrap, scrub) = (self.config.bootstrap.clone(), self.config.clone());
        let metadata = tokio::task::spawn_blocking(move || {
            consumer.fetch_metadata(None, timeout).map(|m| {
                m.topics()
                    .iter()
                    .filter(|t| t.error().is_none() && !t.partitions().is_empty())
                    .map(|t| t.name().to_owned())
                    .collect::<std::collections::HashSet<String>>()
            })
        })
        .await
        .map_err(|e| Error::backend(format!("a blocking Kafka call failed: {e}")))?
        .map_err(|e| {
            Error::unavailable(scrub.scrub(&format!(
                "no Kafka broker of `{bootstrap}` answered within {timeout:?}: {e}"
            )))
        })?;
        if let Some(missing) = self.topics.iter().find(|t| !metadata.contains(*t)) {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "the Kafka topic `{missing}` does not exist (the consumer never creates one)"
                ),
            ));
        }
        if !metadata.contains(&self.dead_letter_topic) {
            return Err(Error::config(
                "dead_letter_topic",
                format!(
                    "the Kafka topic `{}` does not exist: create it, so that dead letters are \
                     kept for a human (the consumer never creates one)",
                    self.dead_letter_topic
                ),
            ));
        }
        Ok(())
    }
}

/// A running [`KafkaConsumer`]. Dropping it stops the consumer (without
/// waiting); [`shutdown`](Self::shutdown) stops it gracefully.
pub struct KafkaConsumerHandle {
    stop: watch::Sender<bool>,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    purger: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    counters: Arc<Counters>,
    running: Arc<AtomicBool>,
    shared: Arc<context::Shared>,
}

impl std::fmt::Debug for KafkaConsumerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumerHandle")
            .field("group", &self.shared.group)
            .field("running", &self.is_running())
            .field("partitions", &self.partitions())
            .finish_non_exhaustive()
    }
}

impl KafkaConsumerHandle {
    /// The partitions this member holds right now (topic, partition), in
    /// order.
    pub fn partitions(&self) -> Vec<(String, i32)> {
        self.shared
            .assigned
            .lock()
            .map(|a| a.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Whether it runs and a broker connection is up (the client's
    /// statistics, every 250 ms).
    pub fn is_connected(&self) -> bool {
        self.is_running() && self.shared.connected.load(Ordering::SeqCst)
    }

    /// Stops consuming: the record in flight finishes (committed, or rolled
    /// back); the offsets settled are committed; records received and not
    /// settled (held for a retry) are let go, to be read again from the
    /// committed offset by whoever holds the partition next; the member
    /// leaves the group, so that the others take its partitions at once.
    /// Waits until that is done.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        for task in [
            self.task.lock().await.take(),
            self.purger.lock().await.take(),
        ]
        .into_iter()
        .flatten()
        {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "Kafka consumer task ended abnormally");
            }
        }
    }

    /// Whether it still runs.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Counts since start.
    pub fn stats(&self) -> ConsumerStats {
        self.counters.stats()
    }
}

impl Drop for KafkaConsumerHandle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}
