//! `--role warehouse --replica I --replicas N`: one of N processes running
//! the Warehouse module over RabbitMQ or NATS JetStream and PostgreSQL (or
//! MySQL), beside an Ordering process (`--role ordering`).
//!
//! The replicas share everything that is the module's: its schema or
//! database (stock, reservations, one outbox, one inbox) and its inbox
//! consumer name. Each runs
//!
//! * a partitioned consumer of `OrderPlaced` (RabbitMQ: queues
//!   `minishop.warehouse.0` …, a single active consumer each; NATS:
//!   subjects `minishop.warehouse.OrderPlaced.0` …, a lease each): replica
//!   I consumes the partitions `p` with `p % N == I` and stands by for the
//!   others — it takes one over when its owner dies (RabbitMQ: within
//!   about a second; NATS: the lease, a second and `ack_wait`, about 14 s)
//!   and hands it back when the owner returns. A key's (an order's)
//!   messages are thus handled by one process at a time, in order;
//! * a relay on the shared outbox with the stable worker id
//!   `minishop-warehouse-I` (a restarted replica takes back its own leases
//!   at once; the others' leases are never touched while they hold).
//!
//! Stock stays right however many replicas reserve at once: the
//! reservation is one conditional `UPDATE … WHERE available >= qty`, which
//! PostgreSQL (or InnoDB) serialises on the stock row (see `Warehouse`).

use std::sync::Arc;

use crate::amqp;
use crate::db::Location;
use crate::fail::{Context, Fail};
use crate::inbox::InboxModule;
use crate::nats;
use crate::shop::{Bus, relay};
use crate::warehouse::Warehouse;

/// Runs warehouse replica `replica` of `replicas` until Ctrl-C or SIGTERM,
/// then stops gracefully (in-flight work finishes, leases go back) and
/// prints what it did.
pub async fn run(
    location: &Location,
    bus: &Bus,
    (replica, replicas): (u16, u16),
) -> Result<(), Fail> {
    let warehouse = Warehouse::open(location).await?;
    let module: Arc<dyn InboxModule> = warehouse.clone();
    let (out, consumer, count, what): (Arc<dyn outbox::Transport>, _, u16, String) = match bus {
        Bus::Amqp {
            url,
            redacted,
            names,
        } => {
            let Some(partitions) = &names.warehouse_partitions else {
                return Err(Fail("a warehouse replica needs partitions".into()));
            };
            let out = amqp::transport(url, names, "warehouse").await?;
            out.declare(&names.topology())
                .await
                .context("declaring the RabbitMQ topology")?;
            let consumer =
                amqp::partitioned_consumer(url, partitions, (replica, replicas), module).await?;
            let what = format!(
                "RabbitMQ at {redacted}, partitions `{}.*`",
                partitions.prefix()
            );
            (Arc::new(out), consumer, partitions.count(), what)
        }
        Bus::Nats {
            url,
            redacted,
            names,
        } => {
            let Some(count) = names.partitions else {
                return Err(Fail("a warehouse replica needs partitions".into()));
            };
            let out = nats::transport(url, names, "warehouse").await?;
            nats::declare(&out, names).await?;
            let consumer = nats::consumer(url, names, module, (replica, replicas)).await?;
            let what = format!(
                "NATS JetStream at {redacted}, partitions `{}.warehouse.*.<p>`",
                names.prefix
            );
            (Arc::new(out), consumer, count, what)
        }
        Bus::Embedded => {
            return Err(Fail(
                "--role warehouse needs --amqp URL or --nats URL".into(),
            ));
        }
    };
    let relay = relay(
        warehouse.database().store(),
        "warehouse",
        format!("minishop-warehouse-{replica}"),
    )
    .transport_shared(out)
    .spawn()
    .context("starting the warehouse relay")?;
    eprintln!(
        "MiniShop warehouse, replica {replica} of {replicas}: {}, {what}, {count} partitions (owns {}); Ctrl-C stops it.",
        location.describe_module("warehouse"),
        (0..count)
            .filter(|p| p % replicas == replica)
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    );
    crate::http::shutdown_signal().await;
    relay.shutdown().await;
    consumer.shutdown().await;
    let s = consumer.stats();
    // The relays share one outbox: a replica relays answers that others
    // committed too.
    println!(
        "warehouse replica {replica} of {replicas}: handled {} OrderPlaced (duplicates {}, retried {}, dead-lettered {}, store errors {}); relayed {} answers",
        s.handled,
        s.duplicates,
        s.retried,
        s.dead_lettered,
        s.store_errors,
        relay.totals().delivered
    );
    warehouse.database().close().await;
    eprintln!("MiniShop stopped.");
    Ok(())
}
