//! Quick start on the in-memory backend: enqueue in a transaction, let the
//! relay deliver to a typed handler and to a (memory) broker, watch a
//! failing message get retried and poisoned, and read the health report.
//!
//! Run with `cargo run --example quickstart`.

use std::time::Duration;

use outbox::memory::{MemoryStore, MemoryTransport};
use outbox::{Handlers, MessageContext, NewMessage, OutboxMessage, Relay};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: u64,
    total_cents: u64,
}

impl OutboxMessage for OrderPlaced {
    const MESSAGE_TYPE: &'static str = "OrderPlaced";
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderConfirmed {
    order_id: u64,
}

impl OutboxMessage for OrderConfirmed {
    const MESSAGE_TYPE: &'static str = "OrderConfirmed";
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = MemoryStore::new();
    let (broker, broker_handle) = MemoryTransport::new();

    let handlers = Handlers::new().on::<OrderConfirmed>(
        |event: OrderConfirmed, ctx: MessageContext| async move {
            if event.order_id == 13 {
                return Err(format!("order {} is unlucky", event.order_id));
            }
            println!(
                "handled OrderConfirmed for order {} (message {})",
                event.order_id, ctx.id
            );
            Ok(())
        },
    );

    let relay = Relay::builder(store.clone())
        .dispatcher(handlers)
        .transport(broker)
        .retry_policy(outbox::RetryPolicy::Fixed(Duration::from_millis(50)))
        .spawn()?;

    // The business transaction: the order row and its messages commit together.
    for order_id in [1, 2, 13] {
        let mut tx = store.begin();
        tx.enqueue(
            NewMessage::integration(&OrderPlaced {
                order_id,
                total_cents: 4200,
            })?
            .key(order_id.to_string()),
        )?;
        tx.enqueue(NewMessage::domain(&OrderConfirmed { order_id })?.key(order_id.to_string()))?;
        tx.commit()?; // wakes the relay at once
    }

    // A transaction that rolls back is never delivered.
    let mut tx = store.begin();
    tx.enqueue(NewMessage::integration(&OrderPlaced {
        order_id: 99,
        total_cents: 1,
    })?)?;
    tx.rollback();

    // Wait until order 13's domain message has used up its five attempts.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while outbox::Store::stats(&store).await?.poisoned == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expected order 13 to be poisoned"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay.until_idle().await?;

    println!(
        "broker received {} integration messages:",
        broker_handle.delivered_count()
    );
    for m in broker_handle.delivered() {
        println!(
            "  {} {}",
            m.message_type,
            String::from_utf8_lossy(&m.payload)
        );
    }
    let health = relay.health().await;
    println!("health: {} {:?}", health.status.as_str(), health.reasons);
    relay.shutdown().await;
    Ok(())
}
