//! NATS JetStream wiring (`--nats URL`): the streams, the relays'
//! transports and the modules' inbox consumers.
//!
//! One stream carries both modules' messages, on subjects
//! `minishop.<receiving module>.<message type>`; each module consumes its
//! own subjects with a durable consumer named after it. Dead letters go to
//! a second stream, `minishop-dead.<module>`, for a human.
//!
//! With partitions (several processes, or PostgreSQL), each subject gets
//! the partition of its key (the order id) as a last token, and each
//! module consumes its partitions with `NatsConsumer::partitioned`: the
//! warehouse replicas share them (one owner per partition, taken over when
//! a replica dies), and each partition has a worker of its own.

use std::sync::Arc;
use std::time::Duration;

use outbox::OutboxMessage;
use outbox::nats::{NatsConfig, NatsConsumer, NatsTransport, StreamSpec};

use crate::amqp::{PREFETCH, SERVER_MAX_ATTEMPTS};
use crate::consumer::Consumer;
use crate::fail::{Context, Fail};
use crate::inbox::{InboxModule, ModuleReceiver};
use crate::messages::OrderPlaced;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The relays' lease and handler timeout (the library's defaults): the
/// stream's duplicate window covers them.
const RELAY_LEASE: Duration = Duration::from_secs(60);
const RELAY_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a consumer's handler may run; `ack_wait` is twice as long.
const HANDLER_TIMEOUT: Duration = Duration::from_secs(5);

/// The names of everything MiniShop declares on the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsNames {
    /// The stream of both modules' messages.
    pub stream: String,
    /// Its subjects' first token: `minishop`, or `minishop-<run id>`.
    pub prefix: String,
    /// The dead letters' stream, for a human.
    pub dead_stream: String,
    /// Its subjects' first token.
    pub dead_prefix: String,
    /// How many partitions each module's subjects have, if any.
    pub partitions: Option<u16>,
    /// Whether the names are unique to this run (deleted at exit).
    pub isolated: bool,
}

impl NatsNames {
    /// `MINISHOP` on `minishop.>`, `MINISHOP_DEAD` on `minishop-dead.>`;
    /// with a `run` id, each name gets it as a suffix. With `partitions`,
    /// each module's subjects are partitioned by key.
    pub fn new(run: Option<&str>, isolated: bool, partitions: Option<u16>) -> Self {
        let (upper, lower) = match run {
            Some(id) => (format!("_{id}"), format!("-{id}")),
            None => (String::new(), String::new()),
        };
        NatsNames {
            stream: format!("MINISHOP{upper}"),
            prefix: format!("minishop{lower}"),
            dead_stream: format!("MINISHOP_DEAD{upper}"),
            dead_prefix: format!("minishop-dead{lower}"),
            partitions,
            isolated,
        }
    }

    /// The subject of a message of `message_type`: the receiving module's.
    pub fn subject(&self, message_type: &str) -> String {
        let to = if message_type == OrderPlaced::MESSAGE_TYPE {
            "warehouse"
        } else {
            "ordering"
        };
        format!("{}.{to}.{message_type}", self.prefix)
    }
}

/// Checks the URL without connecting (a malformed one fails here, redacted).
pub fn check_url(url: &str) -> Result<String, Fail> {
    let config = NatsConfig::new(url);
    config.validate().context("--nats")?;
    Ok(config.url_redacted())
}

/// A relay's transport: publishes to the receiving module's subject (with
/// partitions, its key's partition appended), and awaits JetStream's
/// acknowledgement.
pub async fn transport(url: &str, names: &NatsNames, who: &str) -> Result<NatsTransport, Fail> {
    let routes = names.clone();
    let mut config = NatsTransport::builder(url)
        .connect_timeout(CONNECT_TIMEOUT)
        .client_name(format!("minishop {who} relay"))
        .subject_with(move |m| routes.subject(&m.message_type));
    if let Some(n) = names.partitions {
        for module in ["warehouse", "ordering"] {
            config = config.partitioned(format!("{}.{module}", names.prefix), n);
        }
    }
    NatsTransport::connect(config)
        .await
        .context("connecting to NATS")
}

/// Declares both streams (or checks them, when they exist).
pub async fn declare(transport: &NatsTransport, names: &NatsNames) -> Result<(), Fail> {
    transport
        .declare(
            &StreamSpec::new(names.stream.as_str(), [format!("{}.>", names.prefix)])
                .covering(RELAY_LEASE, RELAY_HANDLER_TIMEOUT),
        )
        .await
        .context("declaring the NATS stream")?;
    transport
        .declare(&StreamSpec::new(
            names.dead_stream.as_str(),
            [format!("{}.>", names.dead_prefix)],
        ))
        .await
        .context("declaring the NATS dead-letter stream")
}

/// Consumes `module`'s subjects into its inbox (ack after the inbox
/// commit), with a durable consumer named after the module; with
/// partitions, as replica `replica` of `replicas` (one process: `(0, 1)`).
pub async fn consumer(
    url: &str,
    names: &NatsNames,
    module: Arc<dyn InboxModule>,
    (replica, replicas): (u16, u16),
) -> Result<Consumer, Fail> {
    let name = module.db().name;
    let config = NatsConfig::new(url)
        .connect_timeout(CONNECT_TIMEOUT)
        .client_name(format!("minishop {name} consumer"));
    let (builder, subjects) = match names.partitions {
        Some(n) => {
            let filter = format!("{}.{name}.*", names.prefix);
            let what = format!("{filter}.<0..{n}>");
            let builder = NatsConsumer::partitioned(config, names.stream.as_str(), name, filter, n)
                .replica(replica, replicas);
            (builder, what)
        }
        None => {
            let subjects = format!("{}.{name}.>", names.prefix);
            let builder = NatsConsumer::builder(config, names.stream.as_str(), name)
                .filter_subject(subjects.as_str());
            (builder, subjects)
        }
    };
    let builder = builder
        .dead_letter_subject(format!("{}.{name}", names.dead_prefix))
        .max_ack_pending(usize::from(PREFETCH))
        // MiniShop's handlers take milliseconds: a short ack_wait makes a
        // dead replica's partitions move within seconds.
        .handler_timeout(HANDLER_TIMEOUT)
        .ack_wait(HANDLER_TIMEOUT * 2);
    let spawned = match ModuleReceiver::of(module)? {
        ModuleReceiver::Sqlite(inbox, handler) => builder.spawn(inbox, handler).await,
        ModuleReceiver::Postgres(inbox, handler) => {
            builder
                .max_attempts(SERVER_MAX_ATTEMPTS)
                .retry_delay(Duration::from_millis(50))
                .unavailable_backoff(Duration::from_millis(50), Duration::from_secs(5))
                .spawn(inbox, handler)
                .await
        }
        ModuleReceiver::MySql(inbox, handler) => {
            builder
                .max_attempts(SERVER_MAX_ATTEMPTS)
                .retry_delay(Duration::from_millis(50))
                .unavailable_backoff(Duration::from_millis(50), Duration::from_secs(5))
                .spawn(inbox, handler)
                .await
        }
    };
    spawned
        .map(|h| Consumer::Nats(h, subjects.clone()))
        .context(format!("consuming NATS subjects `{subjects}`"))
}

/// Deletes the streams of an isolated run (best effort).
pub async fn delete_isolated(transport: &NatsTransport, names: &NatsNames) {
    for stream in [&names.stream, &names.dead_stream] {
        if let Err(e) = transport.jetstream().delete_stream(stream).await {
            tracing::warn!(stream = %stream, error = %e, "could not delete this run's stream");
        }
    }
}
