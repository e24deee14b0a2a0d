//! [`KafkaConfig`]: where the broker is, which topic a message goes to, and
//! the producer's settings.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use outbox_api::{Error, Message, Result};
use rdkafka::ClientConfig;

/// Picks a message's topic (see [`KafkaConfig::topic_with`]).
pub type TopicFn = Arc<dyn Fn(&Message) -> String + Send + Sync>;

/// The producer settings the transport's guarantees rest on; [`set`]
/// refuses to change them.
///
/// [`set`]: KafkaConfig::set
const FIXED: &[(&str, &str)] = &[
    // No duplicates from the producer's own retries, and per-partition
    // order kept across them.
    ("enable.idempotence", "true"),
    // `Ok` only once every in-sync replica has the message.
    ("acks", "all"),
    // A topic that does not exist is refused, never created by a send.
    ("allow.auto.create.topics", "false"),
];

/// Words in a property name whose value is a secret: never shown.
const SECRET_WORDS: &[&str] = &["password", "secret", "key.pem", "keystore", "oauthbearer"];

/// The configuration of a [`KafkaTransport`](crate::KafkaTransport).
///
/// Defaults: topic prefix `outbox`, delivery timeout 10 s (how long a send
/// waits for the broker's answer before it says `Unavailable`), metadata
/// timeout 5 s, linger 1 ms.
#[derive(Clone)]
pub struct KafkaConfig {
    pub(crate) bootstrap: String,
    pub(crate) topic_prefix: String,
    pub(crate) topic_fn: Option<TopicFn>,
    pub(crate) delivery_timeout: Duration,
    pub(crate) metadata_timeout: Duration,
    pub(crate) linger: Duration,
    pub(crate) extra: BTreeMap<String, String>,
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let extra: BTreeMap<&str, &str> = self
            .extra
            .iter()
            .map(|(k, v)| {
                let shown = if is_secret(k) { "***" } else { v.as_str() };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("bootstrap", &self.bootstrap)
            .field("topic_prefix", &self.topic_prefix)
            .field("topic_fn", &self.topic_fn.as_ref().map(|_| "custom"))
            .field("delivery_timeout", &self.delivery_timeout)
            .field("metadata_timeout", &self.metadata_timeout)
            .field("linger", &self.linger)
            .field("extra", &extra)
            .finish()
    }
}

fn is_secret(property: &str) -> bool {
    SECRET_WORDS.iter().any(|w| property.contains(w))
}

impl KafkaConfig {
    /// A configuration for the brokers `bootstrap` (`host:port`, several
    /// separated by commas), with the defaults above.
    pub fn new(bootstrap: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap: bootstrap.into(),
            topic_prefix: "outbox".to_owned(),
            topic_fn: None,
            delivery_timeout: Duration::from_secs(10),
            metadata_timeout: Duration::from_secs(5),
            linger: Duration::from_millis(1),
            extra: BTreeMap::new(),
        }
    }

    /// The prefix of the default topic, `{prefix}.{message_type}` (see
    /// [`topic_of`](Self::topic_of)).
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.topic_prefix = prefix.into();
        self
    }

    /// Picks every message's topic with `f` instead of
    /// [`topic_of`](Self::topic_of)'s rule.
    pub fn topic_with(mut self, f: impl Fn(&Message) -> String + Send + Sync + 'static) -> Self {
        self.topic_fn = Some(Arc::new(f));
        self
    }

    /// How long a send waits for the broker's answer; past it, the
    /// messages not answered yet are `Unavailable` (the relay sends them
    /// again later, uncounted). The producer keeps them queued and retries
    /// them itself, so one may reach the topic twice: consumers keep an
    /// inbox. Keep it below the relay's `handler_timeout`.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// How long asking the brokers for a topic's metadata (on
    /// [`connect`](crate::KafkaTransport::connect), in
    /// [`probe`](outbox_api::Transport::probe), and for a topic not seen
    /// yet) may take.
    pub fn metadata_timeout(mut self, timeout: Duration) -> Self {
        self.metadata_timeout = timeout;
        self
    }

    /// How long the producer waits to fill a request before sending it
    /// (`linger.ms`); a relay's batch goes out together either way.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Sets a librdkafka producer property (`client.id`,
    /// `security.protocol`, `sasl.username`, …). Properties the transport's
    /// guarantees rest on (`enable.idempotence=true`, `acks=all`,
    /// `allow.auto.create.topics=false`) cannot be changed:
    /// [`connect`](crate::KafkaTransport::connect) refuses a different
    /// value, naming it. Values of properties that hold secrets never
    /// appear in `Debug`, logs or errors.
    pub fn set(mut self, property: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.insert(property.into(), value.into());
        self
    }

    /// The topic `m` goes to:
    /// 1. the function set with [`topic_with`](Self::topic_with), if any;
    /// 2. else, with a destination, its exchange (or, if that is empty,
    ///    its routing key);
    /// 3. else `{topic_prefix}.{message_type}`.
    pub fn topic_of(&self, m: &Message) -> String {
        if let Some(f) = &self.topic_fn {
            return f(m);
        }
        match &m.destination {
            Some(d) if !d.exchange.is_empty() => d.exchange.clone(),
            Some(d) => d.routing_key.clone(),
            None => format!("{}.{}", self.topic_prefix, m.message_type),
        }
    }

    /// Checks the configuration: brokers named, timeouts positive, the
    /// fixed properties unchanged. `Err` is `ErrorKind::Config` naming the
    /// field.
    pub fn validate(&self) -> Result<()> {
        if self.bootstrap.trim().is_empty() {
            return Err(Error::config(
                "bootstrap",
                "no Kafka broker given: pass `host:port` (several separated by commas)",
            ));
        }
        for (name, d) in [
            ("delivery_timeout", self.delivery_timeout),
            ("metadata_timeout", self.metadata_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::config(name, format!("{name} must be positive")));
            }
        }
        for (property, fixed) in FIXED {
            if let Some(v) = self.extra.get(*property)
                && v != fixed
            {
                return Err(Error::config(
                    property,
                    format!(
                        "`{property}` must stay `{fixed}`: the transport's guarantees rest on \
                         it (docs/rules.md, Kafka), and `{v}` would weaken them"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `text` with every secret property's value replaced by `***`.
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for (k, v) in &self.extra {
            if is_secret(k) && !v.is_empty() {
                out = out.replace(v.as_str(), "***");
            }
        }
        out
    }

    /// The librdkafka configuration of an admin client: the brokers and the
    /// connection's properties (security), nothing of the producer's.
    pub(crate) fn admin_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap);
        for (k, v) in &self.extra {
            if k.starts_with("security.")
                || k.starts_with("sasl.")
                || k.starts_with("ssl.")
                || k == "client.id"
            {
                c.set(k, v);
            }
        }
        c
    }

    /// The librdkafka configuration of the producer.
    pub(crate) fn producer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap)
            // A message handed to the producer stays queued until the
            // broker takes it: the send itself answers `Unavailable` after
            // `delivery_timeout` (docs/decisions.md, "Kafka: rdkafka").
            .set("message.timeout.ms", "0")
            .set("linger.ms", self.linger.as_millis().to_string())
            // Reconnect soon after an outage; librdkafka's own backoff.
            .set("reconnect.backoff.max.ms", "1000");
        for (k, v) in &self.extra {
            c.set(k, v);
        }
        for (k, v) in FIXED {
            c.set(*k, *v);
        }
        c
    }
}

/// Whether `topic` is a name Kafka takes: 1–249 of `[A-Za-z0-9._-]`, not
/// `.` or `..`. `Err` says what is wrong with it.
pub(crate) fn check_topic(topic: &str) -> std::result::Result<(), String> {
    if topic.is_empty() {
        return Err("the topic name is empty".to_owned());
    }
    if topic.len() > 249 {
        return Err(format!(
            "the topic name `{}…` is {} characters long; Kafka takes at most 249",
            &topic[..40],
            topic.len()
        ));
    }
    if topic == "." || topic == ".." {
        return Err(format!("`{topic}` is not a topic name Kafka takes"));
    }
    if let Some(c) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "the topic name `{topic}` holds {c:?}; Kafka takes letters, digits, `.`, `_` and `-`"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_api::{MessageKind, NewMessage, Timestamp};

    fn message(m: NewMessage) -> Message {
        m.into_message(Timestamp::from_millis(1)).unwrap()
    }

    #[test]
    fn topics_follow_the_destination_then_the_type() {
        let c = KafkaConfig::new("b:9092");
        let plain = message(NewMessage::new(
            MessageKind::Integration,
            "OrderPlaced",
            "{}",
        ));
        assert_eq!(c.topic_of(&plain), "outbox.OrderPlaced");
        let routed = message(
            NewMessage::new(MessageKind::Integration, "OrderPlaced", "{}")
                .destination("orders", "eu"),
        );
        assert_eq!(c.topic_of(&routed), "orders");
        let key_only = message(
            NewMessage::new(MessageKind::Integration, "OrderPlaced", "{}").destination("", "eu"),
        );
        assert_eq!(c.topic_of(&key_only), "eu");
        let custom = c.topic_with(|m| format!("t-{}", m.message_type));
        assert_eq!(custom.topic_of(&plain), "t-OrderPlaced");
    }

    #[test]
    fn the_guarantees_cannot_be_configured_away_and_secrets_stay_hidden() {
        let e = KafkaConfig::new("b:9092")
            .set("acks", "1")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("acks"), "{e}");
        let e = KafkaConfig::new("b:9092")
            .set("enable.idempotence", "false")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("enable.idempotence"), "{e}");
        assert!(KafkaConfig::new(" ").validate().is_err());
        assert!(
            KafkaConfig::new("b:9092")
                .delivery_timeout(Duration::ZERO)
                .validate()
                .is_err()
        );
        let c = KafkaConfig::new("b:9092").set("sasl.password", "s3cret");
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        assert_eq!(c.scrub("login with s3cret failed"), "login with *** failed");
    }

    #[test]
    fn topic_names_are_checked() {
        assert!(check_topic("orders.eu_1-a").is_ok());
        for bad in ["", ".", "..", "a b", "a/b"] {
            assert!(check_topic(bad).is_err(), "{bad:?}");
        }
        assert!(check_topic(&"x".repeat(250)).is_err());
    }
}
