//! [`NatsConfig`]: where the server is, how to log in, how long to wait.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::ServerAddr;
use outbox_api::{Error, Message, Result};

/// The variable the tests and examples read the server URL from.
pub const URL_ENV: &str = "OUTBOX_NATS_URL";

/// Picks the subject of a message; see [`NatsConfig::subject_with`].
pub type SubjectFn = Arc<dyn Fn(&Message) -> String + Send + Sync>;

/// How to reach and use a NATS server; build a [`NatsTransport`] or a
/// [`NatsConsumer`](crate::NatsConsumer) from it.
///
/// Setters take and return the configuration (as sqlx's `PoolOptions`).
/// The URL may carry `user:password@`; a password or token is never shown
/// by `Debug`, in logs or in errors.
///
/// [`NatsTransport`]: crate::NatsTransport
#[derive(Clone)]
pub struct NatsConfig {
    pub(crate) url: String,
    pub(crate) user: Option<(String, String)>,
    pub(crate) token: Option<String>,
    pub(crate) credentials_file: Option<PathBuf>,
    pub(crate) nkey_seed: Option<String>,
    pub(crate) require_tls: bool,
    pub(crate) root_certificates: Vec<PathBuf>,
    pub(crate) client_certificate: Option<(PathBuf, PathBuf)>,
    pub(crate) connect_timeout: Duration,
    pub(crate) ack_timeout: Duration,
    pub(crate) window: usize,
    pub(crate) max_reconnect_delay: Duration,
    pub(crate) subject_prefix: String,
    pub(crate) subject_fn: Option<SubjectFn>,
    pub(crate) client_name: String,
    /// Partitioned subject roots and their partition counts.
    pub(crate) partitioned: std::collections::BTreeMap<String, u16>,
}

impl NatsConfig {
    /// A configuration for the server at `url` (`nats://host:4222`,
    /// `nats://user:password@host:4222`, `tls://host:4222`).
    pub fn new(url: impl Into<String>) -> Self {
        NatsConfig {
            url: url.into(),
            user: None,
            token: None,
            credentials_file: None,
            nkey_seed: None,
            require_tls: false,
            root_certificates: Vec::new(),
            client_certificate: None,
            connect_timeout: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(5),
            window: 256,
            max_reconnect_delay: Duration::from_secs(8),
            subject_prefix: "outbox".to_owned(),
            subject_fn: None,
            client_name: "outbox-rs".to_owned(),
            partitioned: std::collections::BTreeMap::new(),
        }
    }

    /// Logs in with a user and password (instead of, or overriding, those
    /// in the URL).
    pub fn user_password(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// Logs in with a token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Logs in with a credentials file (a user JWT and its nkey seed, as
    /// `nsc` writes it).
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.credentials_file = Some(path.into());
        self
    }

    /// Logs in with an nkey seed (`SU…`).
    pub fn nkey(mut self, seed: impl Into<String>) -> Self {
        self.nkey_seed = Some(seed.into());
        self
    }

    /// Refuses a connection without TLS (a `tls://` URL requires it too).
    pub fn require_tls(mut self, required: bool) -> Self {
        self.require_tls = required;
        self
    }

    /// Trusts the CA certificates in this PEM file besides the platform's.
    pub fn root_certificates(mut self, pem: impl Into<PathBuf>) -> Self {
        self.root_certificates.push(pem.into());
        self
    }

    /// Presents this client certificate and key (PEM files): mutual TLS.
    pub fn client_certificate(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_certificate = Some((cert.into(), key.into()));
        self
    }

    /// How long connecting may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a publish waits for the server's acknowledgement before it
    /// counts as unavailable (default 5 s).
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// How many publishes may await their acknowledgement at once, over
    /// all concurrent sends (default 256): a continuous window, a publish
    /// going out as soon as an earlier one is acknowledged.
    pub fn window(mut self, window: usize) -> Self {
        self.window = window;
        self
    }

    /// The longest pause between two reconnection attempts (default 8 s);
    /// the pauses grow exponentially up to it. The client reconnects
    /// forever.
    pub fn max_reconnect_delay(mut self, delay: Duration) -> Self {
        self.max_reconnect_delay = delay;
        self
    }

    /// The first tokens of the default subject (default `outbox`): a
    /// message without a destination is published to
    /// `{prefix}.{message_type}`.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// Partitions the subjects that are `root` or begin with `root.` (one
    /// or more tokens, e.g. `shop` or `shop.warehouse`; the longest
    /// matching root counts) **by ordering key** into `partitions`
    /// partitions: such a subject gets the token
    /// `.{partition}` appended, the partition being
    /// [`outbox_api::partition::of_message`] of the message's key (of its id
    /// when it has none) — the same hash as the RabbitMQ transport's. A
    /// [`NatsConsumer::partitioned`](crate::NatsConsumer::partitioned)
    /// consumes each partition with one process at a time, so a key's
    /// messages keep their order across consumer processes. Sender and
    /// consumers must agree on `partitions`; changing it moves keys (drain
    /// first).
    pub fn partitioned(mut self, root: impl Into<String>, partitions: u16) -> Self {
        self.partitioned.insert(root.into(), partitions);
        self
    }

    /// Picks every message's subject with `f` instead of the default rule
    /// (see [`subject_of`](Self::subject_of)).
    pub fn subject_with(mut self, f: impl Fn(&Message) -> String + Send + Sync + 'static) -> Self {
        self.subject_fn = Some(Arc::new(f));
        self
    }

    /// The client name the server shows in its connection list (default
    /// `outbox-rs`).
    pub fn client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = name.into();
        self
    }

    /// The URL, its password replaced by `***`.
    pub fn url_redacted(&self) -> String {
        self.scrub(&self.url)
    }

    /// The publish acknowledgement timeout.
    pub fn get_ack_timeout(&self) -> Duration {
        self.ack_timeout
    }

    /// The connect timeout.
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The window of unacknowledged publishes.
    pub fn get_window(&self) -> usize {
        self.window
    }

    /// The subject `m` is published to:
    /// 1. the function set with [`subject_with`](Self::subject_with), if any;
    /// 2. else, with a destination, `{exchange}.{routing_key}` (the
    ///    exchange names the stream's subjects, the routing key the rest;
    ///    an empty exchange gives the routing key alone);
    /// 3. else `{subject_prefix}.{message_type}`;
    ///
    /// then, under a [`partitioned`](Self::partitioned) root,
    /// `.{partition}` appended.
    pub fn subject_of(&self, m: &Message) -> String {
        let subject = if let Some(f) = &self.subject_fn {
            f(m)
        } else {
            match &m.destination {
                Some(d) if d.exchange.is_empty() => d.routing_key.clone(),
                Some(d) if d.routing_key.is_empty() => d.exchange.clone(),
                Some(d) => format!("{}.{}", d.exchange, d.routing_key),
                None => format!("{}.{}", self.subject_prefix, m.message_type),
            }
        };
        let root = self
            .partitioned
            .iter()
            .filter(|(root, _)| {
                subject
                    .strip_prefix(root.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
            })
            .max_by_key(|(root, _)| root.len());
        match root {
            Some((_, count)) => {
                let p = outbox_api::partition::of_message(m.key.as_deref(), m.id, *count);
                format!("{subject}.{p}")
            }
            None => subject,
        }
    }

    /// Checks the configuration; a `Config` error names the setting.
    pub fn validate(&self) -> Result<()> {
        self.server_addr()?;
        if self.window == 0 {
            return Err(Error::config("window", "must be at least 1"));
        }
        for (name, d) in [
            ("connect_timeout", self.connect_timeout),
            ("ack_timeout", self.ack_timeout),
            ("max_reconnect_delay", self.max_reconnect_delay),
        ] {
            if d.is_zero() {
                return Err(Error::config(name, "must be longer than zero"));
            }
        }
        if self.subject_fn.is_none() {
            crate::subject::check(&format!("{}.x", self.subject_prefix))
                .map_err(|why| Error::config("subject_prefix", why))?;
        }
        for (root, partitions) in &self.partitioned {
            if outbox_api::partition::check_count("partitioned", *partitions).is_err() {
                return Err(Error::config(
                    "partitioned",
                    format!(
                        "`{root}`: partitions must be 1 to {} (got {partitions})",
                        outbox_api::partition::MAX_PARTITIONS
                    ),
                ));
            }
            crate::subject::check(root)
                .map_err(|why| Error::config("partitioned", format!("root `{root}`: {why}")))?;
        }
        let logins = [
            self.user.is_some(),
            self.token.is_some(),
            self.credentials_file.is_some(),
            self.nkey_seed.is_some(),
        ];
        if logins.iter().filter(|&&set| set).count() > 1 {
            return Err(Error::config(
                "user_password / token / credentials_file / nkey",
                "set at most one way to log in",
            ));
        }
        Ok(())
    }

    pub(crate) fn server_addr(&self) -> Result<ServerAddr> {
        self.url.parse::<ServerAddr>().map_err(|e| {
            Error::config(
                "url",
                format!(
                    "`{}` is not a NATS URL: {}",
                    self.url_redacted(),
                    self.scrub(&e.to_string())
                ),
            )
        })
    }

    /// The async-nats options for this configuration.
    pub(crate) async fn connect_options(&self) -> Result<async_nats::ConnectOptions> {
        let mut options = async_nats::ConnectOptions::new();
        if let Some(path) = &self.credentials_file {
            options = options.credentials_file(path).await.map_err(|e| {
                Error::config(
                    "credentials_file",
                    format!("cannot read `{}`: {e}", path.display()),
                )
            })?;
        }
        if let Some((user, password)) = &self.user {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.token {
            options = options.token(token.clone());
        }
        if let Some(seed) = &self.nkey_seed {
            options = options.nkey(seed.clone());
        }
        for pem in &self.root_certificates {
            options = options.add_root_certificates(pem.clone());
        }
        if let Some((cert, key)) = &self.client_certificate {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        let max_delay = self.max_reconnect_delay;
        Ok(options
            .require_tls(self.require_tls)
            .connection_timeout(self.connect_timeout)
            .name(&self.client_name)
            .max_reconnects(None)
            .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, max_delay)))
    }

    /// `text` with every secret of this configuration replaced by `***`.
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        let mut secrets: Vec<String> = Vec::new();
        if let Some((_, password)) = &self.user {
            secrets.push(password.clone());
        }
        if let Some(token) = &self.token {
            secrets.push(token.clone());
        }
        if let Some(seed) = &self.nkey_seed {
            secrets.push(seed.clone());
        }
        // The URL's user part, read as text so that a URL that does not
        // parse is scrubbed too: `user:password@` hides the password, a
        // lone `token@` the token.
        if let Some(rest) = self.url.split_once("://").map(|(_, r)| r) {
            let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
            if let Some((userinfo, _)) = authority.rsplit_once('@') {
                match userinfo.split_once(':') {
                    Some((_, password)) => secrets.push(password.to_owned()),
                    None => secrets.push(userinfo.to_owned()),
                }
            }
        }
        for secret in secrets.iter().filter(|s| !s.is_empty()) {
            out = out.replace(secret.as_str(), "***");
        }
        out
    }
}

/// Exponential backoff from 10 ms up to `max`, with jitter.
pub(crate) fn reconnect_delay(attempts: usize, max: Duration) -> Duration {
    if attempts <= 1 {
        return Duration::from_millis(10).min(max);
    }
    let exp = 10u64.saturating_mul(1u64 << attempts.min(20));
    let base = Duration::from_millis(exp).min(max);
    base.mul_f64(0.75 + fastrand::f64() * 0.25)
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let login = if self.user.is_some() {
            "user_password"
        } else if self.token.is_some() {
            "token"
        } else if self.credentials_file.is_some() {
            "credentials_file"
        } else if self.nkey_seed.is_some() {
            "nkey"
        } else {
            "url"
        };
        f.debug_struct("NatsConfig")
            .field("url", &self.url_redacted())
            .field("login", &login)
            .field("require_tls", &self.require_tls)
            .field("connect_timeout", &self.connect_timeout)
            .field("ack_timeout", &self.ack_timeout)
            .field("window", &self.window)
            .field("max_reconnect_delay", &self.max_reconnect_delay)
            .field("subject_prefix", &self.subject_prefix)
            .field("subject_with", &self.subject_fn.is_some())
            .field("client_name", &self.client_name)
            .field("partitioned", &self.partitioned)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_show() {
        let c = NatsConfig::new("nats://app:s3cret-pw@127.0.0.1:4222");
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("app:***@"), "{shown}");
        let c = NatsConfig::new("nats://127.0.0.1:4222").token("tok-123456");
        assert!(!format!("{c:?}").contains("tok-123456"));
        assert_eq!(c.scrub("bad token tok-123456"), "bad token ***");
        let c = NatsConfig::new("nats://127.0.0.1:4222").user_password("u", "hunter22");
        assert!(!format!("{c:?}").contains("hunter22"));
        assert_eq!(c.scrub("x hunter22 y"), "x *** y");
    }

    #[test]
    fn bad_settings_are_named() {
        let e = NatsConfig::new("http://x:1").validate().unwrap_err();
        assert!(e.to_string().contains("url"), "{e}");
        let e = NatsConfig::new("nats://p:secretpw@:::")
            .validate()
            .unwrap_err();
        assert!(!e.to_string().contains("secretpw"), "{e}");
        let e = NatsConfig::new("nats://h")
            .window(0)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        let e = NatsConfig::new("nats://h")
            .ack_timeout(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("ack_timeout"), "{e}");
        let e = NatsConfig::new("nats://h")
            .subject_prefix("a b")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("subject_prefix"), "{e}");
        let e = NatsConfig::new("nats://h")
            .token("t")
            .user_password("u", "p")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("at most one"), "{e}");
        NatsConfig::new("nats://127.0.0.1:4222").validate().unwrap();
    }

    #[test]
    fn partitioned_subjects_get_the_keys_partition_under_the_longest_root() {
        let c = NatsConfig::new("nats://h")
            .partitioned("shop", 4)
            .partitioned("shop.warehouse", 8);
        let m = |dest: (&str, &str), key: Option<&str>| {
            let mut m = outbox_api::NewMessage::new(
                outbox_api::MessageKind::Integration,
                "T",
                b"{}".to_vec(),
            )
            .destination(dest.0, dest.1);
            if let Some(key) = key {
                m = m.key(key);
            }
            m.into_message(outbox_api::Timestamp::now()).unwrap()
        };
        let p8 = outbox_api::partition::of_key("order-1", 8);
        let p4 = outbox_api::partition::of_key("order-1", 4);
        assert_eq!(
            c.subject_of(&m(("shop.warehouse", "OrderPlaced"), Some("order-1"))),
            format!("shop.warehouse.OrderPlaced.{p8}")
        );
        assert_eq!(
            c.subject_of(&m(("shop", "Other"), Some("order-1"))),
            format!("shop.Other.{p4}")
        );
        // Not under a root: unchanged; a root is whole tokens.
        assert_eq!(
            c.subject_of(&m(("shopping", "X"), Some("order-1"))),
            "shopping.X"
        );
        // Keyless: by message id, still one of the partitions.
        let keyless = c.subject_of(&m(("shop", "X"), None));
        let p: u16 = keyless.rsplit('.').next().unwrap().parse().unwrap();
        assert!(p < 4, "{keyless}");
    }

    #[test]
    fn reconnect_delays_grow_to_the_cap() {
        let max = Duration::from_secs(2);
        assert_eq!(reconnect_delay(1, max), Duration::from_millis(10));
        let later = reconnect_delay(4, max);
        assert!(later >= Duration::from_millis(120) && later <= Duration::from_millis(160));
        assert!(reconnect_delay(40, max) <= max);
    }
}
