//! RabbitMQ wiring (`--amqp URL`): topology, the relays' transports and the
//! modules' inbox consumers.

use std::sync::Arc;
use std::time::Duration;

use outbox::rabbitmq::lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use outbox::rabbitmq::lapin::types::ShortString;
use outbox::rabbitmq::lapin::{Connection, ConnectionProperties};
use outbox::rabbitmq::{
    ExchangeType, Partitions, RabbitConfig, RabbitConsumer, RabbitConsumerBuilder, RabbitTransport,
    Topology,
};

use crate::consumer::Consumer;
use crate::fail::{Context, Fail};
use crate::inbox::{InboxModule, ModuleReceiver};
use crate::messages::{OrderPlaced, StockRejected, StockReserved};
use outbox::OutboxMessage;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The names of everything MiniShop declares on the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpNames {
    /// Where both modules publish (direct; routing key = message type).
    pub exchange: String,
    /// Where rejected deliveries go (fanout).
    pub dead_letter_exchange: String,
    /// The dead letters, for a human.
    pub dead_letter_queue: String,
    /// Warehouse's inbox queue (`OrderPlaced`), when one process runs
    /// both modules.
    pub warehouse_queue: String,
    /// Warehouse's partition queues (`minishop.warehouse.0` …), when the
    /// modules run as separate processes (`--role`): Ordering publishes
    /// `OrderPlaced` partitioned by its key (the order id), each partition
    /// has a single active consumer among the warehouse replicas.
    pub warehouse_partitions: Option<Partitions>,
    /// Ordering's inbox queue (`StockReserved`, `StockRejected`).
    pub ordering_queue: String,
    /// Ordering's partition queues (`minishop.ordering.0` …), whenever
    /// Warehouse has partitions: Warehouse publishes its answers
    /// partitioned by key (the order id), and Ordering consumes every
    /// partition, a worker each.
    pub ordering_partitions: Option<Partitions>,
    /// Whether the names are unique to this run (deleted at exit).
    pub isolated: bool,
}

impl AmqpNames {
    /// `minishop`, `minishop.warehouse`, …; with a `run` id, each name gets
    /// the suffix `.run-<id>`, so that other runs do not share the queues
    /// (`isolated`: the id is this process's own, and the names are
    /// deleted at exit). With `partitions`, Warehouse consumes that many
    /// partition queues instead of one queue.
    pub fn new(run: Option<&str>, isolated: bool, partitions: Option<u16>) -> Result<Self, Fail> {
        let suffix = run.map(|id| format!(".run-{id}")).unwrap_or_default();
        let partitioned = |module: &str| {
            partitions
                .map(|n| Partitions::new(format!("minishop.{module}{suffix}"), n))
                .transpose()
                .context("--partitions")
        };
        let warehouse_partitions = partitioned("warehouse")?;
        let ordering_partitions = partitioned("ordering")?;
        Ok(AmqpNames {
            exchange: format!("minishop{suffix}"),
            dead_letter_exchange: format!("minishop.dlx{suffix}"),
            dead_letter_queue: format!("minishop.dead{suffix}"),
            warehouse_queue: format!("minishop.warehouse{suffix}"),
            ordering_queue: format!("minishop.ordering{suffix}"),
            warehouse_partitions,
            ordering_partitions,
            isolated,
        })
    }

    /// Exchanges, queues bound by message type, and dead-lettering. Every
    /// process declares all of it (declaring is idempotent), so that no
    /// message is unroutable whichever process starts first.
    pub fn topology(&self) -> Topology {
        let topology = Topology::new()
            .exchange(&self.exchange, ExchangeType::Direct)
            .exchange(&self.dead_letter_exchange, ExchangeType::Fanout)
            .queue(&self.dead_letter_queue)
            .bind(&self.dead_letter_queue, &self.dead_letter_exchange, "");
        let topology = match &self.warehouse_partitions {
            None => topology
                .dead_letter(&self.warehouse_queue, &self.dead_letter_exchange)
                .bind(
                    &self.warehouse_queue,
                    &self.exchange,
                    OrderPlaced::MESSAGE_TYPE,
                ),
            Some(p) => topology
                .partitioned(p)
                .dead_letter_partitioned(p, &self.dead_letter_exchange)
                .bind_partitioned(p, &self.exchange, OrderPlaced::MESSAGE_TYPE),
        };
        match &self.ordering_partitions {
            None => topology
                .dead_letter(&self.ordering_queue, &self.dead_letter_exchange)
                .bind(
                    &self.ordering_queue,
                    &self.exchange,
                    StockReserved::MESSAGE_TYPE,
                )
                .bind(
                    &self.ordering_queue,
                    &self.exchange,
                    StockRejected::MESSAGE_TYPE,
                ),
            Some(p) => topology
                .partitioned(p)
                .dead_letter_partitioned(p, &self.dead_letter_exchange)
                .bind_partitioned(p, &self.exchange, StockReserved::MESSAGE_TYPE)
                .bind_partitioned(p, &self.exchange, StockRejected::MESSAGE_TYPE),
        }
    }
}

/// Checks the URL without connecting (a malformed one fails here, redacted).
pub fn check_url(url: &str) -> Result<String, Fail> {
    let config = RabbitConfig::new(url);
    config.validate().context("--amqp")?;
    Ok(config.redacted_url())
}

/// A relay's transport: publishes to the shop's exchange, with confirms.
/// With partitions, each module's transport routes by key hash to the
/// other module's partitions: Ordering publishes `OrderPlaced` only,
/// Warehouse its answers only.
pub async fn transport(url: &str, names: &AmqpNames, who: &str) -> Result<RabbitTransport, Fail> {
    let mut config = RabbitTransport::builder(url)
        .default_exchange(&names.exchange)
        .connect_timeout(CONNECT_TIMEOUT)
        .connection_name(format!("minishop {who} relay"));
    let theirs = match who {
        "ordering" => &names.warehouse_partitions,
        _ => &names.ordering_partitions,
    };
    if let Some(p) = theirs {
        config = config.partitioned_exchange(&names.exchange, p.count());
    }
    config.build().await.context("connecting to RabbitMQ")
}

/// Counted handler failures after which a delivery is dead-lettered, on a
/// database server — PostgreSQL or MySQL, where a lost serialisation or a
/// deadlock may fail a handler now and then (SQLite keeps the library's
/// default, 3).
pub const SERVER_MAX_ATTEMPTS: u32 = 5;
/// Deliveries the broker sends ahead to each consumer (RabbitMQ and NATS).
pub const PREFETCH: u16 = 200;

/// Consumes `queue` into `module`'s inbox (ack after the inbox commit).
pub async fn consumer(
    url: &str,
    queue: &str,
    module: Arc<dyn InboxModule>,
) -> Result<Consumer, Fail> {
    let config = RabbitConfig::new(url)
        .connect_timeout(CONNECT_TIMEOUT)
        .connection_name(format!("minishop {} consumer", module.db().name));
    let what = format!("queue `{queue}`");
    spawn_consumer(RabbitConsumer::with_config(config, queue), what, module).await
}

/// Replica `replica` of `replicas` of `module` (Warehouse's processes; a
/// single process with `(0, 1)`): consumes the partitions it owns into the
/// module's shared inbox (one consumer name, so a message redelivered to
/// another replica is a duplicate there too), and stands by for the
/// others, taking one over within about a second when its owner dies and
/// handing it back when the owner returns.
pub async fn partitioned_consumer(
    url: &str,
    partitions: &Partitions,
    (replica, replicas): (u16, u16),
    module: Arc<dyn InboxModule>,
) -> Result<Consumer, Fail> {
    let builder = RabbitConsumer::partitioned(url, partitions.clone())
        .replica(replica, replicas)
        .connect_timeout(CONNECT_TIMEOUT)
        .connection_name(format!(
            "minishop {} consumer, replica {replica} of {replicas}",
            module.db().name
        ));
    let what = format!("the partition queues `{}.*`", partitions.prefix());
    spawn_consumer(builder, what, module).await
}

/// Spawns `builder` on `module`'s inbox (SQLite, PostgreSQL or MySQL); `what` it
/// consumes names it in errors.
async fn spawn_consumer(
    builder: RabbitConsumerBuilder,
    what: String,
    module: Arc<dyn InboxModule>,
) -> Result<Consumer, Fail> {
    let builder = builder.consumer_name(module.db().name).prefetch(PREFETCH);
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
        .map(Consumer::Rabbit)
        .context(format!("consuming RabbitMQ {what}"))
}

/// Deletes the queues and exchanges of an isolated run (best effort).
pub async fn delete_isolated(url: &str, names: &AmqpNames) {
    let work = async {
        let conn = Connection::connect(url, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        let partitions: Vec<String> = [&names.warehouse_partitions, &names.ordering_partitions]
            .into_iter()
            .flatten()
            .flat_map(Partitions::queues)
            .collect();
        for q in [
            &names.warehouse_queue,
            &names.ordering_queue,
            &names.dead_letter_queue,
        ]
        .into_iter()
        .chain(&partitions)
        {
            ch.queue_delete(ShortString::from(q.as_str()), QueueDeleteOptions::default())
                .await?;
        }
        for x in [&names.exchange, &names.dead_letter_exchange] {
            ch.exchange_delete(
                ShortString::from(x.as_str()),
                ExchangeDeleteOptions::default(),
            )
            .await?;
        }
        let _ = conn.close(200, "minishop done".into()).await;
        Ok::<_, outbox::rabbitmq::lapin::Error>(())
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, work).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(
            "could not delete this run's queues and exchanges ({}): {}",
            names.exchange,
            e.to_string()
                .replace(url, &outbox::backend::redact_url(url))
        ),
        Err(_) => tracing::warn!("timed out deleting this run's queues and exchanges"),
    }
}
