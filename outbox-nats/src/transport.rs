//! [`NatsTransport`]: publishing to JetStream with acknowledgements.

use std::collections::HashMap;
use std::error::Error as _;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use async_nats::connection::State;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, Context};
use async_nats::{Client, HeaderMap, HeaderName, HeaderValue};
use async_trait::async_trait;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use outbox_api::{Error, Message, Outcome, Result, Transport};
use tokio::time::timeout;

use crate::config::NatsConfig;
use crate::stream::StreamSpec;
use crate::subject;

/// The header carrying the outbox message id, which JetStream uses to drop
/// a message published again within the stream's duplicate window.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// The header carrying the message type (`OrderPlaced`).
pub const TYPE_HEADER: &str = "Outbox-Type";
/// The header carrying the ordering key, if the message has one.
pub const KEY_HEADER: &str = "Outbox-Key";
/// The header carrying the payload's MIME type.
pub const CONTENT_TYPE_HEADER: &str = "Content-Type";
/// The header carrying when the message was enqueued (Unix milliseconds).
pub const CREATED_AT_HEADER: &str = "Outbox-Created-At";
/// The header carrying the W3C `traceparent` of the enqueuing span.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A [`Transport`] publishing integration messages to NATS JetStream.
///
/// Each message goes to the subject [`NatsConfig::subject_of`] picks, with
/// the headers above and its own headers, `Nats-Msg-Id` being the outbox
/// message id: a message sent again after a relay crash, within the
/// stream's duplicate window, is dropped by the server, and its
/// acknowledgement (marked duplicate) counts as delivered.
///
/// | the server says | outcome |
/// |---|---|
/// | acknowledged, or acknowledged as a duplicate | `Delivered` |
/// | no stream captures the subject (checked: JetStream answers and names none) | `Rejected` naming the subject |
/// | the stream refuses the message (too large for it, a limit with `discard: new`, …) | `Rejected` with the server's words |
/// | larger than the server's `max_payload`, a subject or header NATS cannot carry | `Rejected`, not published |
/// | not connected, no acknowledgement within `ack_timeout`, JetStream unavailable (503), no responders while a stream captures the subject | `Unavailable` |
///
/// At most [`window`](NatsConfig::window) publishes await their
/// acknowledgement at once, over all concurrent sends; a publish goes out
/// as soon as an earlier one is acknowledged. Messages of one send are
/// published in order on one connection. The client reconnects by itself
/// with exponential backoff; [`probe`](Transport::probe) succeeds once it
/// is connected and JetStream answers.
#[derive(Clone)]
pub struct NatsTransport {
    inner: Arc<Inner>,
}

struct Inner {
    config: NatsConfig,
    client: Client,
    js: Context,
}

/// A message ready to publish.
struct Prepared {
    subject: String,
    headers: HeaderMap,
}

/// How a failed publish is settled.
enum Verdict {
    Outcome(Outcome),
    /// No responders: either no stream captures the subject, or its stream
    /// is down; asked of JetStream before deciding.
    NoResponders,
}

impl NatsTransport {
    /// A configuration for the server at `url`, to adjust with its setters
    /// and pass to [`connect`](Self::connect).
    pub fn builder(url: impl Into<String>) -> NatsConfig {
        NatsConfig::new(url)
    }

    /// Checks `config`, connects and asks JetStream for the account's
    /// information. Fails with a clear error (secrets redacted): a
    /// malformed URL or a refused login is `ErrorKind::Config`; a server
    /// that cannot be reached, or has no JetStream answering, is
    /// `ErrorKind::Unavailable`.
    pub async fn connect(config: NatsConfig) -> Result<Self> {
        let client = connect_client(&config).await?;
        let js = jetstream::ContextBuilder::new()
            .timeout(config.ack_timeout)
            .ack_timeout(config.ack_timeout)
            .max_ack_inflight(config.window)
            .backpressure_on_inflight(true)
            .build(client.clone());
        let transport = NatsTransport {
            inner: Arc::new(Inner { config, client, js }),
        };
        transport.probe().await?;
        Ok(transport)
    }

    /// The configuration.
    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// The async-nats client (shared by clones), for code that needs more.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The JetStream context publishes go through.
    pub fn jetstream(&self) -> &Context {
        &self.inner.js
    }

    /// Creates the stream `spec` describes if it does not exist; if it
    /// does, checks that it captures the spec's subjects and keeps message
    /// ids for at least its duplicate window (see [`StreamSpec`]), and
    /// fails with a `Config` error saying what to change if not.
    pub async fn declare(&self, spec: &StreamSpec) -> Result<()> {
        spec.declare_on(&self.inner.js, &|e| self.inner.config.scrub(e))
            .await
    }

    /// Flushes and closes the connection. Clones share it: none can send
    /// afterwards.
    pub async fn close(&self) {
        let _ = timeout(self.inner.config.connect_timeout, self.inner.client.flush()).await;
        let _ = self.inner.client.clone().drain().await;
    }
}

/// Connects a client for `config`; errors as [`NatsTransport::connect`].
pub(crate) async fn connect_client(config: &NatsConfig) -> Result<Client> {
    config.validate()?;
    let addr = config.server_addr()?;
    let options = config
        .connect_options()
        .await?
        .event_callback(|event| async move {
            match event {
                async_nats::Event::Connected => tracing::info!("NATS connection restored"),
                async_nats::Event::Disconnected => {
                    tracing::warn!("NATS connection lost; reconnecting")
                }
                other => tracing::debug!(event = %other, "NATS client event"),
            }
        });
    options.connect(addr).await.map_err(|e| {
        use async_nats::ConnectErrorKind as K;
        let words = config.scrub(&format!("{e}{}", source_words(&e)));
        let server = config.url_redacted();
        match e.kind() {
            K::Authentication | K::AuthorizationViolation => Error::config(
                "url",
                format!("NATS at {server} refused the login: {words}"),
            ),
            K::ServerParse | K::Tls => Error::config(
                "url",
                format!("cannot connect to NATS at {server}: {words}"),
            ),
            _ => Error::unavailable(format!("cannot connect to NATS at {server}: {words}")),
        }
    })
}

/// `: {source}` if `e` has a source, else nothing.
pub(crate) fn source_words(e: &dyn std::error::Error) -> String {
    e.source().map(|s| format!(": {s}")).unwrap_or_default()
}

impl Inner {
    fn unavailable(&self, why: &str) -> Outcome {
        Outcome::Unavailable(format!("NATS is unavailable: {}", self.config.scrub(why)))
    }

    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        if self.client.connection_state() != State::Connected {
            return batch
                .iter()
                .map(|_| self.unavailable("not connected"))
                .collect();
        }
        let max_payload = self.client.server_info().max_payload;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        // Acknowledgements are read while later messages are published:
        // the window's permit of a message is released only when its
        // acknowledgement is read, so this send must read its own while it
        // waits for a permit for its next message.
        let mut acks = FuturesUnordered::new();
        let mut answers = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            let p = match self.prepare(m, max_payload) {
                Ok(p) => p,
                Err(why) => {
                    outcomes[i] = Some(Outcome::Rejected(self.config.scrub(&why)));
                    continue;
                }
            };
            let publish = PublishMessage::build()
                .payload(m.payload.clone().into())
                .headers(p.headers);
            let sending = self.js.send_publish(p.subject.clone(), publish);
            tokio::pin!(sending);
            let sent = loop {
                tokio::select! {
                    biased;
                    Some(answer) = acks.next(), if !acks.is_empty() => answers.push(answer),
                    sent = &mut sending => break sent,
                }
            };
            match sent {
                Ok(ack) => {
                    let subject = p.subject;
                    acks.push(async move { (i, subject, ack.await) });
                }
                Err(e) => {
                    // The client could not take it: this one and the rest
                    // were not published.
                    let why = self.publish_words(&e);
                    for o in outcomes[i..].iter_mut().filter(|o| o.is_none()) {
                        *o = Some(self.unavailable(&why));
                    }
                    break;
                }
            }
        }
        while let Some(answer) = acks.next().await {
            answers.push(answer);
        }
        let mut streams: HashMap<String, Outcome> = HashMap::new();
        for (i, subject, answer) in answers {
            let outcome = match answer {
                Ok(_) => Outcome::Delivered,
                Err(e) => match self.verdict(&e) {
                    Verdict::Outcome(o) => o,
                    Verdict::NoResponders => match streams.get(&subject) {
                        Some(o) => o.clone(),
                        None => {
                            let o = self.no_responders(&subject).await;
                            streams.insert(subject, o.clone());
                            o
                        }
                    },
                },
            };
            outcomes[i] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| self.unavailable("not acknowledged")))
            .collect()
    }

    fn publish_words(&self, e: &PublishError) -> String {
        self.config.scrub(&format!("{e}{}", source_words(e)))
    }

    /// What a publish error means for its message.
    fn verdict(&self, e: &PublishError) -> Verdict {
        let words = self.publish_words(e);
        match e.kind() {
            PublishErrorKind::StreamNotFound => Verdict::NoResponders,
            PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
            | PublishErrorKind::MaxAckPending => Verdict::Outcome(self.unavailable(&words)),
            PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
                Verdict::Outcome(Outcome::Rejected(format!("JetStream refused it: {words}")))
            }
            _ => match e
                .source()
                .and_then(|s| s.downcast_ref::<jetstream::Error>())
            {
                // 5xx: JetStream (or the stream's leader) is not available,
                // or out of resources: not the message's fault.
                Some(api) if api.code() >= 500 => Verdict::Outcome(self.unavailable(&words)),
                Some(api) => Verdict::Outcome(Outcome::Rejected(format!(
                    "JetStream refused it: {} (code {}, error code {})",
                    self.config.scrub(&api.to_string()),
                    api.code(),
                    api.error_code().0
                ))),
                // Not an answer of the server (a garbled reply): uncertain.
                None => Verdict::Outcome(self.unavailable(&words)),
            },
        }
    }

    /// No responders for `subject`: the message's fault if JetStream
    /// answers and no stream captures it, an outage otherwise.
    async fn no_responders(&self, subject: &str) -> Outcome {
        match self.js.stream_by_subject(subject).await {
            Err(e)
                if e.kind() == async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound =>
            {
                Outcome::Rejected(format!(
                    "no JetStream stream captures subject `{subject}` (declare one with NatsTransport::declare or `nats stream add`)"
                ))
            }
            Ok(stream) => self.unavailable(&format!(
                "stream `{stream}` captures `{subject}` but nobody answered the publish"
            )),
            Err(e) => self.unavailable(&format!(
                "no responders for `{subject}`, and JetStream did not say which stream captures it: {e}"
            )),
        }
    }

    /// The subject and headers of `m`; `Err` is why it is rejected without
    /// being published.
    fn prepare(&self, m: &Message, max_payload: usize) -> std::result::Result<Prepared, String> {
        let subject = self.config.subject_of(m);
        subject::check(&subject)?;
        let mut headers = HeaderMap::new();
        // NATS/1.0\r\n … \r\n
        let mut header_bytes = 12;
        let mut add = |name: &str, value: &str| -> std::result::Result<(), String> {
            let shown: String = name.chars().take(40).collect();
            let key = HeaderName::from_str(name).map_err(|_| {
                format!("header name `{shown}` cannot be carried by NATS (no `:`, spaces or control characters)")
            })?;
            let value = HeaderValue::from_str(value).map_err(|_| {
                format!("the value of header `{shown}` holds a line break, which NATS cannot carry")
            })?;
            header_bytes += name.len() + 2 + value.as_str().len() + 2;
            headers.insert(key, value);
            Ok(())
        };
        for (name, value) in &m.headers {
            add(name, value)?;
        }
        add(MSG_ID_HEADER, &m.id.to_string())?;
        add(TYPE_HEADER, &m.message_type)?;
        add(CONTENT_TYPE_HEADER, &m.content_type)?;
        add(CREATED_AT_HEADER, &m.created_at.as_millis().to_string())?;
        if let Some(key) = &m.key {
            add(KEY_HEADER, key)?;
        }
        if let Some(tp) = &m.trace_parent {
            add(TRACEPARENT_HEADER, tp)?;
        }
        let size = header_bytes + m.payload.len();
        if max_payload > 0 && size > max_payload {
            return Err(format!(
                "the message takes {size} bytes with its headers ({} of payload); the server's max_payload is {max_payload}",
                m.payload.len()
            ));
        }
        Ok(Prepared { subject, headers })
    }
}

#[async_trait]
impl Transport for NatsTransport {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        self.inner.send(batch).await
    }

    async fn probe(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.client.connection_state() != State::Connected {
            return Err(Error::unavailable(format!(
                "NATS at {} is not connected (reconnecting)",
                inner.config.url_redacted()
            )));
        }
        // The account's information, as raw JSON: its shape changes
        // between server versions, an answer is all that is asked.
        let ask = inner.client.request("$JS.API.INFO", Default::default());
        let refused = |words: String| {
            Err(Error::unavailable(format!(
                "JetStream at {} does not answer: {}",
                inner.config.url_redacted(),
                inner.config.scrub(&words)
            )))
        };
        match timeout(inner.config.ack_timeout, ask).await {
            Ok(Ok(reply)) => match serde_json::from_slice::<serde_json::Value>(&reply.payload) {
                Ok(v) if v.get("error").is_none() => Ok(()),
                Ok(v) => refused(v["error"].to_string()),
                Err(e) => refused(format!("an answer that is not JSON: {e}")),
            },
            Ok(Err(e)) => refused(format!("{e}{}", source_words(&e))),
            Err(_) => Err(Error::unavailable(format!(
                "JetStream at {} did not answer within {:?}",
                inner.config.url_redacted(),
                inner.config.ack_timeout
            ))),
        }
    }
}

impl fmt::Debug for NatsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTransport")
            .field("config", &self.inner.config)
            .field("state", &self.inner.client.connection_state())
            .finish_non_exhaustive()
    }
}
