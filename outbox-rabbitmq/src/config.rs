//! Configuration of a [`RabbitTransport`](crate::RabbitTransport).

use std::fmt;
use std::time::Duration;

use lapin::uri::{AMQPScheme, AMQPUri};
use outbox_api::backend::{password_of, redact_url};
use outbox_api::{Error, Result};

use crate::transport::RabbitTransport;

/// The environment variable [`RabbitConfig::from_env`] reads.
pub const URL_ENV: &str = "OUTBOX_AMQP_URL";

/// Longest exchange name, routing key or header name AMQP can carry (a
/// `shortstr`), in bytes.
pub const MAX_SHORT_STRING: usize = 255;

/// How to reach RabbitMQ and where messages go by default.
///
/// Built with [`RabbitTransport::builder`] or [`RabbitConfig::from_env`];
/// every setter consumes and returns the configuration. Nothing is checked
/// until [`build`](RabbitConfig::build) (or [`validate`](RabbitConfig::validate)),
/// which fails with an [`ErrorKind::Config`](outbox_api::ErrorKind::Config)
/// error naming the field.
///
/// The password of the URL never appears in `Debug`, logs or errors.
#[derive(Clone)]
pub struct RabbitConfig {
    pub(crate) url: String,
    pub(crate) default_exchange: String,
    pub(crate) routing_key: Option<String>,
    pub(crate) confirm_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) connection_name: String,
    /// Partitioned exchanges and their partition counts.
    pub(crate) partitioned: std::collections::BTreeMap<String, u16>,
}

impl RabbitConfig {
    /// Runs a connection `attempt` within `connect_timeout`; running out of
    /// time is an `Unavailable` error naming the (redacted) URL.
    pub(crate) async fn within_connect_timeout<T>(
        &self,
        attempt: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(self.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(Error::unavailable(format!(
                    "connecting to RabbitMQ at {} timed out after {:?}",
                    self.redacted_url(),
                    self.connect_timeout
                )))
            })
    }

    /// Default [`confirm_timeout`](RabbitConfig::confirm_timeout): 10 s.
    pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
    /// Default [`connect_timeout`](RabbitConfig::connect_timeout): 10 s.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
    /// Default first reconnect delay: 100 ms.
    pub const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
    /// Default longest reconnect delay: 30 s.
    pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(30);

    /// A configuration for the broker at `url`
    /// (`amqp://user:password@host:port/vhost`, the vhost percent-encoded:
    /// `%2f` is `/`), with the defaults: exchange `""` (RabbitMQ's default
    /// exchange), routing key = the message type, confirm and connect
    /// timeouts of 10 s, reconnect backoff from 100 ms to 30 s.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitConfig {
            url: url.into(),
            default_exchange: String::new(),
            routing_key: None,
            confirm_timeout: Self::DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            reconnect_min: Self::DEFAULT_RECONNECT_MIN,
            reconnect_max: Self::DEFAULT_RECONNECT_MAX,
            connection_name: "outbox-rs relay".to_owned(),
            partitioned: std::collections::BTreeMap::new(),
        }
    }

    /// The configuration for the URL in `OUTBOX_AMQP_URL`, checked.
    ///
    /// Fails with a `Config` error if the variable is unset, not Unicode,
    /// or not a valid AMQP URL (the error shows the URL with its password
    /// redacted).
    pub fn from_env() -> Result<Self> {
        let url = match std::env::var(URL_ENV) {
            Ok(url) => url,
            Err(std::env::VarError::NotPresent) => {
                return Err(Error::config(
                    URL_ENV,
                    "is not set; set it to the broker's URL, e.g. amqp://guest:guest@127.0.0.1:5672/%2f",
                ));
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(Error::config(URL_ENV, "is not valid Unicode"));
            }
        };
        let config = RabbitConfig::new(url);
        config.validate()?;
        Ok(config)
    }

    /// The exchange used for messages without a destination (default `""`,
    /// RabbitMQ's default exchange, which routes to the queue named by the
    /// routing key).
    pub fn default_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.default_exchange = exchange.into();
        self
    }

    /// The routing key used for messages without a destination. Without one,
    /// the routing key is the message's type.
    pub fn routing_key(mut self, routing_key: impl Into<String>) -> Self {
        self.routing_key = Some(routing_key.into());
        self
    }

    /// Publishes to `exchange` **partitioned by ordering key** into
    /// `partitions` partitions: a message's routing key becomes
    /// `<routing key>.<partition>`, the partition being
    /// [`Partitions::of_message`](crate::Partitions::of_message) of its key
    /// (of its id when it has none). Subscribers bind `partitions` queues
    /// with [`Topology::partitioned`](crate::Topology::partitioned) and
    /// [`Topology::bind_partitioned`](crate::Topology::bind_partitioned)
    /// with the same count. A count the subscribers do not bind leaves some
    /// routing keys unroutable: those messages are `Rejected` (never lost
    /// silently).
    pub fn partitioned_exchange(mut self, exchange: impl Into<String>, partitions: u16) -> Self {
        self.partitioned.insert(exchange.into(), partitions);
        self
    }

    /// How long to wait for the broker's confirms of a batch before the
    /// unconfirmed messages count as `Unavailable` (default 10 s).
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long one connection attempt (TCP, AMQP handshake, confirm
    /// channel) may take (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The delay before the first reconnect attempt after a failed one, and
    /// the longest delay it doubles up to (defaults 100 ms and 30 s; ±20 %
    /// jitter).
    pub fn reconnect_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.reconnect_min = first;
        self.reconnect_max = max;
        self
    }

    /// The connection name shown in the RabbitMQ management UI (default
    /// `outbox-rs relay`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// The broker URL with its password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The default exchange.
    pub fn get_default_exchange(&self) -> &str {
        &self.default_exchange
    }

    /// The default routing key (`None`: the message type).
    pub fn get_routing_key(&self) -> Option<&str> {
        self.routing_key.as_deref()
    }

    /// The confirm timeout.
    pub fn get_confirm_timeout(&self) -> Duration {
        self.confirm_timeout
    }

    /// The connect timeout.
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Checks every value; the error names the field and never contains the
    /// password.
    pub fn validate(&self) -> Result<()> {
        self.parse_url()?;
        if self.default_exchange.len() > MAX_SHORT_STRING {
            return Err(Error::config(
                "default_exchange",
                format!(
                    "is {} bytes long; AMQP allows at most {MAX_SHORT_STRING}",
                    self.default_exchange.len()
                ),
            ));
        }
        if let Some(key) = &self.routing_key {
            if key.len() > MAX_SHORT_STRING {
                return Err(Error::config(
                    "routing_key",
                    format!(
                        "is {} bytes long; AMQP allows at most {MAX_SHORT_STRING}",
                        key.len()
                    ),
                ));
            }
        }
        for (exchange, partitions) in &self.partitioned {
            crate::partition::check_count(*partitions).map_err(|_| {
                Error::config(
                    "partitioned_exchange",
                    format!(
                        "`{exchange}`: partitions must be 1 to {} (got {partitions})",
                        crate::MAX_PARTITIONS
                    ),
                )
            })?;
        }
        if self.confirm_timeout.is_zero() {
            return Err(Error::config(
                "confirm_timeout",
                "must be greater than zero",
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::config(
                "connect_timeout",
                "must be greater than zero",
            ));
        }
        if self.reconnect_min.is_zero() || self.reconnect_max < self.reconnect_min {
            return Err(Error::config(
                "reconnect_backoff",
                format!(
                    "first delay ({:?}) must be greater than zero and at most the longest ({:?})",
                    self.reconnect_min, self.reconnect_max
                ),
            ));
        }
        Ok(())
    }

    /// Parses the URL; errors redact the password.
    pub(crate) fn parse_url(&self) -> Result<AMQPUri> {
        let uri = self.url.parse::<AMQPUri>().map_err(|reason| {
            Error::config(
                "amqp_url",
                format!(
                    "`{}` is not a valid AMQP URL (amqp://user:password@host:port/vhost): {}",
                    self.redacted_url(),
                    self.scrub(&reason)
                ),
            )
        })?;
        if uri.scheme == AMQPScheme::AMQPS && !cfg!(feature = "tls") {
            return Err(Error::config(
                "amqp_url",
                format!(
                    "`{}` asks for TLS (amqps://), but outbox-rabbitmq was built without its `tls` feature",
                    self.redacted_url()
                ),
            ));
        }
        Ok(uri)
    }

    /// Removes the URL's password (and the raw URL) from a text that may
    /// have come from a library.
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut text = text.replace(&self.url, &self.redacted_url());
        if let Some(password) = password_of(&self.url) {
            if password.len() >= 3 {
                text = text.replace(password, "***");
            }
        }
        text
    }

    /// Checks the configuration, connects to the broker and opens a
    /// confirm-mode channel. Fails with a clear error if the URL is
    /// malformed, the broker cannot be reached, or the credentials are
    /// refused.
    pub async fn build(self) -> Result<RabbitTransport> {
        RabbitTransport::connect(self).await
    }

    /// Checks the configuration but does not connect: the first
    /// [`send`](outbox_api::Transport::send) or
    /// [`probe`](outbox_api::Transport::probe) does. For applications that
    /// may start before the broker.
    pub fn build_lazy(self) -> Result<RabbitTransport> {
        RabbitTransport::lazy(self)
    }
}

impl fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &self.redacted_url())
            .field("default_exchange", &self.default_exchange)
            .field("routing_key", &self.routing_key)
            .field("partitioned", &self.partitioned)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_api::ErrorKind;

    #[test]
    fn debug_hides_the_password() {
        let c = RabbitConfig::new("amqp://alice:hunter2xyz@broker:5672/%2f");
        let d = format!("{c:?}");
        assert!(!d.contains("hunter2xyz"), "{d}");
        assert!(d.contains("alice:***@broker"), "{d}");
    }

    #[test]
    fn malformed_url_is_a_config_error_without_the_password() {
        for url in [
            "amqp://alice:hunter2xyz@broker:notaport/%2f",
            "http://alice:hunter2xyz@broker/",
            "amqp:alice:hunter2xyz",
            "nonsense hunter2xyz",
        ] {
            let err = RabbitConfig::new(url).validate().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{err}");
            let text = format!("{err} {err:?}");
            assert!(text.contains("amqp_url"), "{text}");
            assert!(text.contains("not a valid AMQP URL"), "{text}");
            if url.contains("://") {
                assert!(!text.contains("hunter2xyz"), "{text}");
                assert!(text.contains("alice:***@broker"), "{text}");
            }
        }
    }

    #[test]
    fn bad_values_name_the_field() {
        let base = || RabbitConfig::new("amqp://guest:guest@localhost:5672/%2f");
        base().validate().unwrap();
        let err = base().routing_key("k".repeat(256)).validate().unwrap_err();
        assert!(err.to_string().contains("routing_key"), "{err}");
        let err = base()
            .default_exchange("x".repeat(300))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("default_exchange"), "{err}");
        let err = base()
            .confirm_timeout(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("confirm_timeout"), "{err}");
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn amqps_needs_the_tls_feature() {
        let err = RabbitConfig::new("amqps://u:hunter2xyz@broker/%2f")
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("`tls` feature"), "{err}");
        assert!(!err.to_string().contains("hunter2xyz"), "{err}");
    }

    #[test]
    fn password_of_finds_it() {
        assert_eq!(password_of("amqp://u:p@h/v"), Some("p"));
        assert_eq!(password_of("amqp://u@h/v"), None);
        assert_eq!(password_of("amqp://h/v"), None);
    }
}
