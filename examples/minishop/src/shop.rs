//! The running shop: both modules, their relays, and the bus between them.

use std::sync::Arc;
use std::time::Duration;

use outbox::{HealthStatus, Relay, RelayHandle, Store};

use crate::amqp::{self, AmqpNames, Consumer};
use crate::db::Location;
use crate::fail::{Context, Fail};
use crate::health::{ShopHealth, combine};
use crate::inbox::{EmbeddedBus, InboxModule};
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
        /// Unique queue and exchange names for this run.
        isolated: bool,
    },
}

/// Both modules, running.
#[derive(Debug)]
pub struct Shop {
    /// The Ordering module.
    pub ordering: Arc<Ordering>,
    /// The Warehouse module.
    pub warehouse: Arc<Warehouse>,
    /// Ordering's relay (`OrderPlaced` out, `OrderConfirmed` in-process).
    pub ordering_relay: RelayHandle,
    /// Warehouse's relay (`StockReserved` / `StockRejected` out).
    pub warehouse_relay: RelayHandle,
    consumers: Vec<Consumer>,
    amqp: Option<(String, AmqpNames)>,
    /// `embedded` or `rabbitmq`.
    pub bus_name: &'static str,
    /// For humans: `the embedded bus` or `RabbitMQ at amqp://user:***@host…`.
    pub bus_description: String,
}

impl Shop {
    /// Opens both modules' databases at `location` and starts relays (and
    /// consumers).
    pub async fn start(location: &Location, bus: Bus) -> Result<Shop, Fail> {
        let ordering = Ordering::open(location).await?;
        let warehouse = Warehouse::open(location).await?;
        let ordering_inbox: Arc<dyn InboxModule> = ordering.clone();
        let warehouse_inbox: Arc<dyn InboxModule> = warehouse.clone();
        let relay = |store: Arc<dyn Store>, name: &str| {
            // On PostgreSQL the store's listener LISTENs for other
            // processes' commits; commits in this process wake it at once.
            Relay::builder_shared(store)
                // Stable across restarts: a restarted MiniShop takes back
                // the leases of the process before it at once.
                .worker_id(format!("minishop-{name}"))
                // The `outbox.name` label of its metrics.
                .name(name)
                .batch_size(200)
                // Commits in this process wake the relays at once; this is
                // only the fallback for commits by other processes.
                .poll_interval(Duration::from_millis(500))
        };
        let spawn = |b: outbox::RelayBuilder, name: &str| {
            b.spawn().context(format!("starting the {name} relay"))
        };
        match bus {
            Bus::Embedded => {
                let bus: Arc<dyn outbox::Transport> =
                    Arc::new(EmbeddedBus::new(&[ordering_inbox, warehouse_inbox]));
                let ordering_relay = spawn(
                    relay(ordering.database().store(), "ordering")
                        .transport_shared(Arc::clone(&bus))
                        .dispatcher(ordering.handlers()),
                    "ordering",
                )?;
                let warehouse_relay = spawn(
                    relay(warehouse.database().store(), "warehouse").transport_shared(bus),
                    "warehouse",
                )?;
                Ok(Shop {
                    ordering,
                    warehouse,
                    ordering_relay,
                    warehouse_relay,
                    consumers: Vec::new(),
                    amqp: None,
                    bus_name: "embedded",
                    bus_description: "the embedded bus".into(),
                })
            }
            Bus::Amqp {
                url,
                redacted,
                isolated,
            } => {
                let names = AmqpNames::new(isolated);
                let ordering_out = amqp::transport(&url, &names, "ordering").await?;
                ordering_out
                    .declare(&names.topology())
                    .await
                    .context("declaring the RabbitMQ topology")?;
                let warehouse_out = amqp::transport(&url, &names, "warehouse").await?;
                let mut consumers = Vec::new();
                consumers
                    .push(amqp::consumer(&url, &names.warehouse_queue, warehouse_inbox).await?);
                consumers.push(amqp::consumer(&url, &names.ordering_queue, ordering_inbox).await?);
                let ordering_relay = spawn(
                    relay(ordering.database().store(), "ordering")
                        .transport(ordering_out)
                        .dispatcher(ordering.handlers()),
                    "ordering",
                )?;
                let warehouse_relay = spawn(
                    relay(warehouse.database().store(), "warehouse").transport(warehouse_out),
                    "warehouse",
                )?;
                let bus_description = format!(
                    "RabbitMQ at {redacted} (exchange `{}`{})",
                    names.exchange,
                    if isolated { ", isolated" } else { "" }
                );
                Ok(Shop {
                    ordering,
                    warehouse,
                    ordering_relay,
                    warehouse_relay,
                    consumers,
                    amqp: Some((url, names)),
                    bus_name: "rabbitmq",
                    bus_description,
                })
            }
        }
    }

    /// Both relays' health, and the consumers', worst wins.
    pub async fn health(&self) -> ShopHealth {
        let (o, w) = tokio::join!(self.ordering_relay.health(), self.warehouse_relay.health());
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
                    format!("consumer of `{}`: reconnecting to RabbitMQ", c.queue()),
                ));
            }
        }
        combine(
            self.bus_name,
            vec![("ordering", o), ("warehouse", w)],
            findings,
        )
    }

    /// What each module's outbox, relay and consumer are doing (for "what
    /// is stuck" after a timeout).
    pub async fn describe(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let parts: [(&str, Arc<dyn Store>, &RelayHandle); 2] = [
            (
                "ordering",
                self.ordering.database().store(),
                &self.ordering_relay,
            ),
            (
                "warehouse",
                self.warehouse.database().store(),
                &self.warehouse_relay,
            ),
        ];
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

    /// Messages the relays delivered since they started (to the bus, the
    /// broker or an in-process handler).
    pub fn relayed(&self) -> u64 {
        self.ordering_relay.totals().delivered + self.warehouse_relay.totals().delivered
    }

    /// Stops the relays (in-flight work finishes, leases go back), then the
    /// consumers; deletes an isolated run's queues.
    pub async fn shutdown(self) {
        tokio::join!(
            self.ordering_relay.shutdown(),
            self.warehouse_relay.shutdown()
        );
        for c in &self.consumers {
            c.shutdown().await;
        }
        if let Some((url, names)) = &self.amqp {
            if names.isolated {
                amqp::delete_isolated(url, names).await;
            }
        }
        self.ordering.database().close().await;
        self.warehouse.database().close().await;
    }
}
