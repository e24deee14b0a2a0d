//! [`KafkaTransport`]: publishing to Kafka with an idempotent producer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_api::{Error, Message, Outcome, Result, Transport};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};

use crate::config::{KafkaConfig, check_topic};

/// The header carrying the outbox message id: what a consumer's inbox
/// deduplicates on (a relay that crashed after the broker took a message
/// sends it again).
pub const ID_HEADER: &str = "outbox-id";
/// The header carrying the message type (`OrderPlaced`).
pub const TYPE_HEADER: &str = "outbox-type";
/// The header carrying the ordering key, if the message has one (it is
/// also the Kafka key).
pub const KEY_HEADER: &str = "outbox-key";
/// The header carrying the payload's MIME type.
pub const CONTENT_TYPE_HEADER: &str = "content-type";
/// The header carrying when the message was enqueued (Unix milliseconds).
pub const CREATED_AT_HEADER: &str = "outbox-created-at";
/// The header carrying the W3C `traceparent` of the enqueuing span.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The headers the transport writes itself; a message's own header of one
/// of these names is left out.
const OWN_HEADERS: &[&str] = &[
    ID_HEADER,
    TYPE_HEADER,
    KEY_HEADER,
    CONTENT_TYPE_HEADER,
    CREATED_AT_HEADER,
    TRACEPARENT_HEADER,
];

/// How long a topic found missing stays missing before the brokers are
/// asked again.
const MISSING_FOR: Duration = Duration::from_secs(1);

/// A [`Transport`] publishing integration messages to Kafka.
///
/// Each message goes to the topic [`KafkaConfig::topic_of`] picks, its
/// ordering key as the Kafka key (the default partitioner sends a key's
/// messages to one partition, so they keep their order), the payload as
/// the value, and the headers above beside the message's own. The
/// producer is idempotent with `acks=all`: its own retries never write a
/// message twice, and `Delivered` means every in-sync replica has it.
///
/// | the broker says | outcome |
/// |---|---|
/// | written (`acks=all`) | `Delivered` |
/// | the topic does not exist (asked of the brokers before sending; a send never creates one) | `Rejected` naming the topic |
/// | a topic name Kafka does not take | `Rejected`, not sent |
/// | too large (the producer's `message.max.bytes` or the topic's limit), an invalid record, not authorised for the topic, a policy violation | `Rejected` with the broker's words |
/// | no broker reachable, no answer within the delivery timeout, not enough replicas, a leader moving, the producer fenced or failed | `Unavailable` |
///
/// A refusal belongs to its message only: the batch's other messages are
/// sent and settled on their own. librdkafka reconnects by itself;
/// [`probe`](Transport::probe) succeeds once a broker answers a metadata
/// request.
#[derive(Clone)]
pub struct KafkaTransport {
    inner: Arc<Inner>,
}

struct Inner {
    config: KafkaConfig,
    /// Replaced after a fatal error of the idempotent producer (its
    /// sequence broken beyond repair), which makes it refuse every send.
    producer: RwLock<FutureProducer>,
    /// What the brokers said of each topic seen.
    topics: Mutex<HashMap<String, Topic>>,
}

#[derive(Clone, Copy)]
enum Topic {
    Exists,
    Missing(Instant),
}

impl std::fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl KafkaTransport {
    /// A configuration for the brokers `bootstrap` (`host:port,…`), to
    /// adjust with its setters and pass to [`connect`](Self::connect).
    pub fn builder(bootstrap: impl Into<String>) -> KafkaConfig {
        KafkaConfig::new(bootstrap)
    }

    /// Checks `config`, creates the producer and asks the brokers for
    /// their metadata. A configuration librdkafka refuses, or one that
    /// would weaken the guarantees, is `ErrorKind::Config` naming the
    /// property; brokers that do not answer within the metadata timeout
    /// are `ErrorKind::Unavailable`. Secrets never appear in the error.
    pub async fn connect(config: KafkaConfig) -> Result<Self> {
        config.validate()?;
        let producer = create_producer(&config)?;
        let transport = KafkaTransport {
            inner: Arc::new(Inner {
                config,
                producer: RwLock::new(producer),
                topics: Mutex::new(HashMap::new()),
            }),
        };
        transport.probe().await?;
        Ok(transport)
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.inner.config
    }

    /// The rdkafka producer (shared by clones), for code that needs more.
    pub fn producer(&self) -> FutureProducer {
        self.inner.producer()
    }

    /// Creates `topic` with `partitions` partitions, each kept on
    /// `replication` brokers, unless it exists: `Ok(true)` when it was
    /// created, `Ok(false)` when it was there already (its partitions are
    /// left as they are). The transport and the consumer never create a
    /// topic themselves; an application (or its deployment) does, once.
    /// A bad name is `ErrorKind::Config`; a broker that refuses or does
    /// not answer within the metadata timeout, `ErrorKind::Unavailable`.
    pub async fn create_topic(
        &self,
        topic: &str,
        partitions: i32,
        replication: i32,
    ) -> Result<bool> {
        check_topic(topic).map_err(|why| Error::config("topic", why))?;
        if partitions < 1 || replication < 1 {
            return Err(Error::config(
                "topic",
                format!("`{topic}` needs at least one partition and one replica"),
            ));
        }
        let config = &self.inner.config;
        let admin: AdminClient<DefaultClientContext> =
            config.admin_config().create().map_err(|e| {
                Error::config(
                    "admin",
                    config.scrub(&format!(
                        "librdkafka refused the admin client's configuration: {e}"
                    )),
                )
            })?;
        let answers = admin
            .create_topics(
                &[NewTopic::new(
                    topic,
                    partitions,
                    TopicReplication::Fixed(replication),
                )],
                &AdminOptions::new()
                    .request_timeout(Some(config.metadata_timeout))
                    .operation_timeout(Some(config.metadata_timeout)),
            )
            .await
            .map_err(|e| {
                Error::unavailable(config.scrub(&format!("creating topic `{topic}`: {e}")))
            })?;
        let created = match answers.first() {
            Some(Ok(_)) => true,
            Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => false,
            Some(Err((_, code))) => {
                return Err(Error::unavailable(format!(
                    "the brokers refused to create topic `{topic}`: {code}"
                )));
            }
            None => {
                return Err(Error::unavailable(format!(
                    "no answer about topic `{topic}`"
                )));
            }
        };
        self.inner
            .topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(topic);
        Ok(created)
    }

    /// Waits up to `timeout` for every message handed to the producer to be
    /// settled (`flush`).
    pub async fn flush(&self, timeout: Duration) -> Result<()> {
        let producer = self.producer();
        let config = self.inner.config.clone();
        blocking(move || {
            producer
                .flush(timeout)
                .map_err(|e| Error::unavailable(config.scrub(&format!("flushing: {e}"))))
        })
        .await
    }
}

pub(crate) fn create_producer(config: &KafkaConfig) -> Result<FutureProducer> {
    config.producer_config().create().map_err(|e| {
        Error::config(
            "producer",
            config.scrub(&format!(
                "librdkafka refused the producer's configuration: {e}"
            )),
        )
    })
}

/// Runs `f` (a blocking librdkafka call) on the blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::backend(format!("a blocking Kafka call failed: {e}")))?
}

impl Inner {
    fn producer(&self) -> FutureProducer {
        self.producer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn unavailable(&self, why: &str) -> Outcome {
        Outcome::Unavailable(format!("Kafka is unavailable: {}", self.config.scrub(why)))
    }

    /// After a fatal error the idempotent producer refuses every send:
    /// a new one takes its place (a new producer id; the broker keeps
    /// what the old one wrote).
    fn renew_if_fatal(&self) {
        let producer = self.producer();
        if let Some((code, why)) = producer.client().fatal_error() {
            tracing::warn!(?code, %why, "the Kafka producer failed for good; creating a new one");
            match create_producer(&self.config) {
                Ok(fresh) => {
                    *self.producer.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                }
                Err(e) => tracing::warn!(error = %e, "creating a new Kafka producer failed"),
            }
        }
    }

    /// Whether `topic` exists, asking the brokers when it was not seen yet
    /// (or was missing a while ago). `Err` is the outcome to give.
    async fn check_exists(&self, topic: &str) -> std::result::Result<(), Outcome> {
        let known = self
            .topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(topic)
            .copied();
        match known {
            Some(Topic::Exists) => return Ok(()),
            Some(Topic::Missing(at)) if at.elapsed() < MISSING_FOR => {
                return Err(missing(topic));
            }
            _ => {}
        }
        let producer = self.producer();
        let (name, timeout) = (topic.to_owned(), self.config.metadata_timeout);
        let asked = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), timeout)
                .map(|m| {
                    m.topics()
                        .iter()
                        .find(|t| t.name() == name)
                        .map(|t| (t.error(), t.partitions().len()))
                })
        })
        .await;
        let state = match asked {
            Ok(Ok(Some((None, partitions)))) if partitions > 0 => Topic::Exists,
            Ok(Ok(Some((Some(err), _))))
                if RDKafkaErrorCode::from(err) == RDKafkaErrorCode::UnknownTopicOrPartition =>
            {
                Topic::Missing(Instant::now())
            }
            Ok(Ok(None)) => Topic::Missing(Instant::now()),
            Ok(Ok(Some((err, _)))) => {
                return Err(self.unavailable(&format!(
                    "the brokers' metadata for topic `{topic}` is not usable yet: {err:?}"
                )));
            }
            Ok(Err(e)) => {
                return Err(
                    self.unavailable(&format!("asking the brokers about topic `{topic}`: {e}"))
                );
            }
            Err(e) => return Err(self.unavailable(&format!("a metadata request failed: {e}"))),
        };
        self.topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(topic.to_owned(), state);
        match state {
            Topic::Exists => Ok(()),
            Topic::Missing(_) => Err(missing(topic)),
        }
    }

    /// What a failed produce of `topic` means.
    fn verdict(&self, topic: &str, e: &KafkaError) -> Outcome {
        let code = e.rdkafka_error_code();
        use RDKafkaErrorCode as C;
        match code {
            Some(
                C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidMessage
                | C::InvalidRecord
                | C::InvalidTopic
                | C::TopicAuthorizationFailed
                | C::PolicyViolation
                | C::InvalidTimestamp,
            ) => Outcome::Rejected(self.config.scrub(&format!(
                "Kafka refused the message for topic `{topic}`: {e}"
            ))),
            Some(C::UnknownTopicOrPartition | C::UnknownTopic) => {
                // Deleted since it was seen: ask again next time.
                self.topics
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(topic.to_owned(), Topic::Missing(Instant::now()));
                missing(topic)
            }
            _ => {
                if code == Some(C::Fatal) {
                    self.renew_if_fatal();
                }
                self.unavailable(&format!("producing to topic `{topic}`: {e}"))
            }
        }
    }

    /// Hands `m` to the producer (waiting while its queue is full, up to
    /// the delivery timeout); the delivery to await, or the outcome.
    async fn produce(
        &self,
        producer: &FutureProducer,
        topic: &str,
        m: &Message,
    ) -> std::result::Result<DeliveryFuture, Outcome> {
        let mut headers = OwnedHeaders::new_with_capacity(6 + m.headers.len());
        for (name, value) in &m.headers {
            if !OWN_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name)) {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
        }
        let id = m.id.to_string();
        let created = m.created_at.as_millis().to_string();
        let mut own: Vec<(&str, &str)> = vec![
            (ID_HEADER, &id),
            (TYPE_HEADER, &m.message_type),
            (CONTENT_TYPE_HEADER, &m.content_type),
            (CREATED_AT_HEADER, &created),
        ];
        if let Some(key) = &m.key {
            own.push((KEY_HEADER, key));
        }
        if let Some(tp) = &m.trace_parent {
            own.push((TRACEPARENT_HEADER, tp));
        }
        for (key, value) in own {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic)
            .payload(m.payload.as_slice())
            .headers(headers);
        if let Some(key) = &m.key {
            record = record.key(key.as_bytes());
        }
        let deadline = Instant::now() + self.config.delivery_timeout;
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < deadline =>
                {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err(self.verdict(topic, &e)),
            }
        }
    }

    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut deliveries = Vec::with_capacity(batch.len());
        // One producer for the whole batch (a fatal error replaces it for
        // the next one).
        let producer = self.producer();
        for (i, m) in batch.iter().enumerate() {
            let topic = self.config.topic_of(m);
            if let Err(why) = check_topic(&topic) {
                outcomes[i] = Some(Outcome::Rejected(why));
                continue;
            }
            if let Err(outcome) = self.check_exists(&topic).await {
                outcomes[i] = Some(outcome);
                continue;
            }
            match self.produce(&producer, &topic, m).await {
                Ok(delivery) => deliveries.push((i, topic, delivery)),
                Err(outcome) => outcomes[i] = Some(outcome),
            }
        }
        // librdkafka never gives a message up (`message.timeout.ms` = 0):
        // what has no answer within the delivery timeout is `Unavailable`
        // here and stays queued there.
        let limit = self.config.delivery_timeout;
        let settled = tokio::time::timeout(
            limit,
            futures_util::future::join_all(
                deliveries
                    .into_iter()
                    .map(|(i, topic, delivery)| async move { (i, topic, delivery.await) }),
            ),
        )
        .await;
        match settled {
            Ok(settled) => {
                for (i, topic, answer) in settled {
                    outcomes[i] = Some(match answer {
                        Ok(Ok(_)) => Outcome::Delivered,
                        Ok(Err((e, _))) => self.verdict(&topic, &e),
                        Err(_) => self.unavailable("the producer went away before an answer"),
                    });
                }
            }
            Err(_) => {
                let why = format!("no answer within {limit:?}");
                for o in outcomes.iter_mut().filter(|o| o.is_none()) {
                    *o = Some(self.unavailable(&why));
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| self.unavailable("no outcome")))
            .collect()
    }
}

fn missing(topic: &str) -> Outcome {
    Outcome::Rejected(format!(
        "the Kafka topic `{topic}` does not exist (the transport never creates one: create it, \
         or route the message elsewhere)"
    ))
}

#[async_trait]
impl Transport for KafkaTransport {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        self.inner.send(batch).await
    }

    async fn probe(&self) -> Result<()> {
        self.inner.renew_if_fatal();
        let producer = self.inner.producer();
        let config = self.inner.config.clone();
        blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(None, config.metadata_timeout)
                .map_err(|e| {
                    Error::unavailable(config.scrub(&format!(
                        "no Kafka broker of `{}` answered within {:?}: {e}",
                        config.bootstrap, config.metadata_timeout
                    )))
                })?;
            if metadata.brokers().is_empty() {
                return Err(Error::unavailable(format!(
                    "the Kafka cluster at `{}` names no broker",
                    config.bootstrap
                )));
            }
            Ok(())
        })
        .await
    }
}
