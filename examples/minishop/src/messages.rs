//! The messages of the saga, shared by both modules (their public contract).
//!
//! ```text
//! Ordering ──OrderPlaced──▶ Warehouse          (integration: bus / RabbitMQ)
//! Ordering ◀─StockReserved── Warehouse          (integration)
//! Ordering ◀─StockRejected── Warehouse          (integration)
//! Ordering ──OrderConfirmed──▶ Ordering         (domain: in-process handler)
//! ```

use outbox::OutboxMessage;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// An order was placed (Ordering → Warehouse); key: the order id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order.
    pub order_id: Uuid,
    /// Who ordered.
    pub customer: String,
    /// What.
    pub sku: String,
    /// How many.
    pub qty: u32,
    /// Price of the whole order, in cents.
    pub total_cents: i64,
}

impl OutboxMessage for OrderPlaced {
    const MESSAGE_TYPE: &'static str = "OrderPlaced";
}

/// The warehouse reserved the stock of an order (Warehouse → Ordering).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StockReserved {
    /// The order.
    pub order_id: Uuid,
    /// What was reserved.
    pub sku: String,
    /// How many.
    pub qty: u32,
}

impl OutboxMessage for StockReserved {
    const MESSAGE_TYPE: &'static str = "StockReserved";
}

/// The warehouse could not reserve the stock of an order (Warehouse → Ordering).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StockRejected {
    /// The order.
    pub order_id: Uuid,
    /// What was asked for.
    pub sku: String,
    /// How many.
    pub qty: u32,
    /// Why, for humans.
    pub reason: String,
}

impl OutboxMessage for StockRejected {
    const MESSAGE_TYPE: &'static str = "StockRejected";
}

/// An order is confirmed (a domain message of Ordering, handled in-process:
/// the saga's last step).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderConfirmed {
    /// The order.
    pub order_id: Uuid,
}

impl OutboxMessage for OrderConfirmed {
    const MESSAGE_TYPE: &'static str = "OrderConfirmed";
}

/// The ordering key of every message about an order (its id): same key ⇒
/// delivered in commit order.
pub fn order_key(order_id: Uuid) -> String {
    order_id.to_string()
}
