//! The running shop: both modules, their relays, and the bus between them.

use std::sync::Arc;
use std::time::Duration;

use outbox::{HealthStatus, Relay, RelayHandle, Store};

use crate::amqp::{self, AmqpNames};
use crate::consumer::Consumer;
use crate::db::Location;
use crate::fail::{Context, Fail};
use crate::health::{ShopHealth, combine};
use crate::inbox::{EmbeddedBus, InboxModule};
use crate::nats::{self, NatsNames};
use crate::ordering::Ordering;
use crate::warehouse::Warehouse;

/// How integration messages travel between the modules.
#[derive(Debug, Clone)]
pub enum Bus {
    /// In-process ([`EmbeddedBus`]): no services needed.
    Embedded,
    /// Through RabbitMQ.
    Amqp {
        /// The broker URL (with its password: never print it, use `redacted`).
        url: String,
        /// The URL as it may be shown.
        redacted: String,
        /// The names of the queues and exchanges.
        names: Box<AmqpNames>,
    },
    /// Through NATS JetStream.
    Nats {
        /// The server URL (with its password: never print it, use `redacted`).
        url: String,
        /// The URL as it may be shown.
        redacted: String,
        /// The names of the streams.
        names: NatsNames,
    },
}

/// Which modules this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Modules {
    /// Ordering and Warehouse (`--role all`).
    Both,
    /// Ordering only (`--role ordering`): Warehouse runs in other
    /// processes (`--role warehouse`), reached through RabbitMQ or NATS.
    OrderingOnly,
}

/// The shop's modules running in this process: Ordering, and Warehouse
/// unless it runs in processes of its own.
#[derive(Debug)]
pub struct Shop {
    /// The Ordering module.
    pub ordering: Arc<Ordering>,
    /// Ordering's relay (`OrderPlaced` out, `OrderConfirmed` in-process).
    pub ordering_relay: RelayHandle,
    /// The Warehouse module and its relay (`StockReserved` /
    /// `StockRejected` out), when it runs in this process.
    pub warehouse: Option<(Arc<Warehouse>, RelayHandle)>,
    consumers: Vec<Consumer>,
    amqp: Option<(String, AmqpNames)>,
    nats: Option<(outbox::nats::NatsTransport, NatsNames)>,
    /// `embedded`, `rabbitmq` or `nats`.
    pub bus_name: &'static str,
    /// For humans: `the embedded bus` or `RabbitMQ at amqp://user:***@host…`.
    pub bus_description: String,
}

/// A module's relay: `name` labels its metrics; `worker_id` must be
/// stable across restarts (a restarted process takes back the leases of the
/// one before it at once) and unique among the processes sharing its outbox.
pub fn relay(store: Arc<dyn Store>, name: &str, worker_id: String) -> outbox::RelayBuilder {
    // On PostgreSQL the store's listener LISTENs for other processes'
    // commits (on MySQL it polls for them); commits in this process wake
    // it at once.
    Relay::builder_shared(store)
        .worker_id(worker_id)
        // The `outbox.name` label of its metrics.
        .name(name)
        .batch_size(200)
        // Commits in this process wake the relays at once; this is only
        // the fallback for commits by other processes.
        .poll_interval(Duration::from_millis(500))
}

/// Warehouse's relay in a process that runs both modules: its answers out
/// through `out`.
fn warehouse_relay(
    warehouse: &Warehouse,
    out: Arc<dyn outbox::Transport>,
) -> Result<RelayHandle, Fail> {
    relay(
        warehouse.database().store(),
        "warehouse",
        "minishop-warehouse".into(),
    )
    .transport_shared(out)
    .spawn()
    .context("starting the warehouse relay")
}

/// Ordering's relay: `OrderPlaced` out through `out`, `OrderConfirmed` to
/// its in-process handler.
fn ordering_relay(
    ordering: &Arc<Ordering>,
    out: Arc<dyn outbox::Transport>,
) -> Result<RelayHandle, Fail> {
    relay(
        ordering.database().store(),
        "ordering",
        "minishop-ordering".into(),
    )
    .transport_shared(out)
    .dispatcher(ordering.handlers())
    .spawn()
    .context("starting the ordering relay")
}

impl Shop {
    /// Opens the modules' databases at `location` and starts relays (and
    /// consumers): both modules, or Ordering only (then `bus` must be
    /// RabbitMQ or NATS).
    pub async fn start(location: &Location, bus: Bus, modules: Modules) -> Result<Shop, Fail> {
        let ordering = Ordering::open(location).await?;
        let ordering_inbox: Arc<dyn InboxModule> = ordering.clone();
        match bus {
            Bus::Embedded if modules == Modules::OrderingOnly => Err(Fail(
                "Ordering alone needs RabbitMQ or NATS to reach the warehouse processes".into(),
            )),
            Bus::Embedded => {
                let warehouse = Warehouse::open(location).await?;
                let warehouse_inbox: Arc<dyn InboxModule> = warehouse.clone();
                let bus: Arc<dyn outbox::Transport> =
                    Arc::new(EmbeddedBus::new(&[ordering_inbox, warehouse_inbox]));
                let ordering_relay = ordering_relay(&ordering, Arc::clone(&bus))?;
                let warehouse_relay = warehouse_relay(&warehouse, bus)?;
                Ok(Shop {
                    ordering,
                    ordering_relay,
                    warehouse: Some((warehouse, warehouse_relay)),
                    consumers: Vec::new(),
                    amqp: None,
                    nats: None,
                    bus_name: "embedded",
                    bus_description: "the embedded bus".into(),
                })
            }
            Bus::Nats {
                url,
                redacted,
                names,
            } => {
                let ordering_out = nats::transport(&url, &names, "ordering").await?;
                nats::declare(&ordering_out, &names).await?;
                let mut consumers = Vec::new();
                let warehouse = match modules {
                    Modules::Both => {
                        let warehouse = Warehouse::open(location).await?;
                        let warehouse_inbox: Arc<dyn InboxModule> = warehouse.clone();
                        let warehouse_out = nats::transport(&url, &names, "warehouse").await?;
                        // Partitioned: every partition in this process, a worker each.
                        consumers
                            .push(nats::consumer(&url, &names, warehouse_inbox, (0, 1)).await?);
                        let warehouse_relay = warehouse_relay(&warehouse, Arc::new(warehouse_out))?;
                        Some((warehouse, warehouse_relay))
                    }
                    Modules::OrderingOnly => None,
                };
                consumers.push(nats::consumer(&url, &names, ordering_inbox, (0, 1)).await?);
                let ordering_relay = ordering_relay(&ordering, Arc::new(ordering_out.clone()))?;
                let bus_description = format!(
                    "NATS JetStream at {redacted} (stream `{}`{}{})",
                    names.stream,
                    if names.isolated { ", isolated" } else { "" },
                    match (names.partitions, modules) {
                        (Some(n), Modules::OrderingOnly) => format!(
                            "; the warehouse in its own processes, {n} partitions `{}.warehouse.*.<p>`",
                            names.prefix
                        ),
                        (Some(n), Modules::Both) => format!(
                            "; the warehouse consumes {n} partitions `{}.warehouse.*.<p>`",
                            names.prefix
                        ),
                        (None, _) => String::new(),
                    }
                );
                Ok(Shop {
                    ordering,
                    ordering_relay,
                    warehouse,
                    consumers,
                    amqp: None,
                    nats: Some((ordering_out, names)),
                    bus_name: "nats",
                    bus_description,
                })
            }
            Bus::Amqp {
                url,
                redacted,
                names,
            } => {
                let ordering_out = amqp::transport(&url, &names, "ordering").await?;
                ordering_out
                    .declare(&names.topology())
                    .await
                    .context("declaring the RabbitMQ topology")?;
                let mut consumers = Vec::new();
                let warehouse = match modules {
                    Modules::Both => {
                        let warehouse = Warehouse::open(location).await?;
                        let warehouse_inbox: Arc<dyn InboxModule> = warehouse.clone();
                        let warehouse_out = amqp::transport(&url, &names, "warehouse").await?;
                        consumers.push(match &names.warehouse_partitions {
                            // Every partition in this process, a worker each.
                            Some(p) => {
                                amqp::partitioned_consumer(&url, p, (0, 1), warehouse_inbox).await?
                            }
                            None => {
                                amqp::consumer(&url, &names.warehouse_queue, warehouse_inbox)
                                    .await?
                            }
                        });
                        let warehouse_relay = warehouse_relay(&warehouse, Arc::new(warehouse_out))?;
                        Some((warehouse, warehouse_relay))
                    }
                    Modules::OrderingOnly => None,
                };
                consumers.push(match &names.ordering_partitions {
                    // Every partition in this process, a worker each.
                    Some(p) => amqp::partitioned_consumer(&url, p, (0, 1), ordering_inbox).await?,
                    None => amqp::consumer(&url, &names.ordering_queue, ordering_inbox).await?,
                });
                let ordering_relay = ordering_relay(&ordering, Arc::new(ordering_out))?;
                let bus_description = format!(
                    "RabbitMQ at {redacted} (exchange `{}`{}{})",
                    names.exchange,
                    if names.isolated { ", isolated" } else { "" },
                    match (&names.warehouse_partitions, modules) {
                        (Some(p), Modules::OrderingOnly) => format!(
                            "; the warehouse in its own processes, {} partitions `{}.*`",
                            p.count(),
                            p.prefix()
                        ),
                        (Some(p), Modules::Both) => format!(
                            "; the warehouse consumes {} partitions `{}.*`",
                            p.count(),
                            p.prefix()
                        ),
                        (None, _) => String::new(),
                    }
                );
                Ok(Shop {
                    ordering,
                    ordering_relay,
                    warehouse,
                    consumers,
                    amqp: Some((url, *names)),
                    nats: None,
                    bus_name: "rabbitmq",
                    bus_description,
                })
            }
        }
    }

    /// The relays' health, and the consumers', worst wins.
    pub async fn health(&self) -> ShopHealth {
        let mut relays = vec![("ordering", self.ordering_relay.health().await)];
        if let Some((_, relay)) = &self.warehouse {
            relays.push(("warehouse", relay.health().await));
        }
        let mut findings = Vec::new();
        for c in &self.consumers {
            if !c.is_running() {
                findings.push((
                    HealthStatus::Unhealthy,
                    format!("consumer of `{}`: stopped", c.queue()),
                ));
            } else if !c.is_connected() {
                findings.push((
                    HealthStatus::Degraded,
                    format!("consumer of `{}`: reconnecting to the broker", c.queue()),
                ));
            }
        }
        combine(self.bus_name, relays, findings)
    }

    /// What each module's outbox, relay and consumer are doing (for "what
    /// is stuck" after a timeout).
    pub async fn describe(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let mut parts: Vec<(&str, Arc<dyn Store>, &RelayHandle)> = vec![(
            "ordering",
            self.ordering.database().store(),
            &self.ordering_relay,
        )];
        if let Some((warehouse, relay)) = &self.warehouse {
            parts.push(("warehouse", warehouse.database().store(), relay));
        }
        for (name, store, relay) in parts {
            let stats = match store.stats().await {
                Ok(s) => format!(
                    "pending {}, poisoned {}, processed {}{}",
                    s.pending,
                    s.poisoned,
                    s.processed,
                    s.oldest_pending_created_at
                        .map(|t| format!(
                            ", oldest pending {:.1} s",
                            outbox::Timestamp::now().since(t).as_secs_f64()
                        ))
                        .unwrap_or_default()
                ),
                Err(e) => format!("stats unavailable: {e}"),
            };
            let h = relay.health().await;
            let reasons = if h.reasons.is_empty() {
                String::new()
            } else {
                format!(" ({})", h.reasons.join("; "))
            };
            lines.push(format!(
                "{name} outbox: {stats}; relay {}{reasons}",
                h.status.as_str()
            ));
        }
        for c in &self.consumers {
            lines.push(c.describe());
        }
        lines
    }

    /// Messages this process's relays delivered since they started (to the
    /// bus, the broker or an in-process handler).
    pub fn relayed(&self) -> u64 {
        self.ordering_relay.totals().delivered
            + self
                .warehouse
                .as_ref()
                .map_or(0, |(_, relay)| relay.totals().delivered)
    }

    /// Stops the relays without waiting for the shop to be released (a
    /// request may still hold it).
    pub async fn stop_relays(&self) {
        self.ordering_relay.shutdown().await;
        if let Some((_, relay)) = &self.warehouse {
            relay.shutdown().await;
        }
    }

    /// Stops the relays (in-flight work finishes, leases go back), then the
    /// consumers; deletes an isolated run's queues.
    pub async fn shutdown(self) {
        self.stop_relays().await;
        for c in &self.consumers {
            c.shutdown().await;
        }
        if let Some((url, names)) = &self.amqp {
            if names.isolated {
                amqp::delete_isolated(url, names).await;
            }
        }
        if let Some((transport, names)) = &self.nats {
            if names.isolated {
                nats::delete_isolated(transport, names).await;
            }
        }
        self.ordering.database().close().await;
        if let Some((warehouse, _)) = &self.warehouse {
            warehouse.database().close().await;
        }
    }
}
