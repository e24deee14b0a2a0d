//! The Ordering module (`ordering.db`, schema `ordering` on PostgreSQL, or
//! database `<db>_ordering` on MySQL):
//! places orders, follows the warehouse's answers, and confirms or cancels.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hdrhistogram::Histogram;
use outbox::sqlite::sqlx::{self, Row};
use outbox::{HandlerError, Handlers, MessageContext, NewMessage, OutboxMessage};
use serde::Serialize;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::db::{Conn, Ddl, Location, ModuleDb, now_ms};
use crate::fail::Fail;
use crate::inbox::InboxModule;
use crate::messages::{OrderConfirmed, OrderPlaced, StockRejected, StockReserved, order_key};
use crate::{with_conn, with_pool};

/// What the shop sells and at what price (cents). The warehouse keeps the
/// stock; Ordering only knows the catalogue.
pub const CATALOGUE: &[(&str, i64)] = &[
    ("apple", 120),
    ("pear", 90),
    ("teapot", 2_500),
    ("golden-ticket", 10_000),
];

/// Largest quantity one order may ask for.
pub const MAX_QTY: u32 = 1_000;

/// The `orders` table. The dialects differ in the id's collation and the
/// column types only: ids are UUID v7 text, and `saga_counts` selects a
/// run by id range, which needs byte order (SQLite's default; PostgreSQL's
/// is the locale's; MySQL's `ascii_bin`). MySQL keys and defaults need
/// `VARCHAR`s (`customer` is at most 200 bytes, see [`Ordering::validate`]).
const DDL: Ddl = Ddl {
    sqlite: &["CREATE TABLE IF NOT EXISTS orders (
        id           TEXT    PRIMARY KEY, -- UUID v7: unique across runs, ordered by time
        customer     TEXT    NOT NULL,
        sku          TEXT    NOT NULL,
        qty          INTEGER NOT NULL,
        total_cents  INTEGER NOT NULL,
        status       TEXT    NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'confirmed', 'cancelled')),
        reason       TEXT,
        created_at   INTEGER NOT NULL,
        decided_at   INTEGER,
        confirmed_at INTEGER
    )"],
    postgres: &[r#"CREATE TABLE IF NOT EXISTS orders (
        id           TEXT    COLLATE "C" PRIMARY KEY, -- UUID v7: unique across runs, ordered by time
        customer     TEXT    NOT NULL,
        sku          TEXT    NOT NULL,
        qty          BIGINT  NOT NULL,
        total_cents  BIGINT  NOT NULL,
        status       TEXT    NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'confirmed', 'cancelled')),
        reason       TEXT,
        created_at   BIGINT  NOT NULL,
        decided_at   BIGINT,
        confirmed_at BIGINT
    )"#],
    mysql: &["CREATE TABLE IF NOT EXISTS orders (
        id           VARCHAR(36)  CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY, -- UUID v7 text, byte order
        customer     VARCHAR(200) NOT NULL,
        sku          VARCHAR(64)  NOT NULL,
        qty          BIGINT       NOT NULL,
        total_cents  BIGINT       NOT NULL,
        status       VARCHAR(16)  NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'confirmed', 'cancelled')),
        reason       TEXT,
        created_at   BIGINT       NOT NULL,
        decided_at   BIGINT,
        confirmed_at BIGINT
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4"],
};

/// A request that cannot become an order.
#[derive(Debug, PartialEq, Eq)]
pub struct InvalidOrder(pub String);

/// Why placing an order failed.
#[derive(Debug)]
pub enum PlaceError {
    /// The request was wrong (HTTP 422).
    Invalid(InvalidOrder),
    /// The database failed (HTTP 503).
    Store(String),
}

/// An order as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct OrderView {
    /// Order id (UUID v7).
    pub id: String,
    /// Who ordered.
    pub customer: String,
    /// What.
    pub sku: String,
    /// How many.
    pub qty: u32,
    /// Price, in cents.
    pub total_cents: i64,
    /// `pending`, `confirmed` or `cancelled`.
    pub status: String,
    /// Why it was cancelled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was placed (ms since the epoch).
    pub created_at: i64,
    /// When the warehouse's answer was applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<i64>,
    /// When the `OrderConfirmed` handler ran (the saga's end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmed_at: Option<i64>,
}

/// How the sagas of a range of orders stand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SagaCounts {
    /// Orders in the range.
    pub total: u64,
    /// Still waiting for the warehouse.
    pub pending: u64,
    /// Confirmed (stock reserved).
    pub confirmed: u64,
    /// Confirmed and `OrderConfirmed` handled: the saga ended.
    pub confirmed_handled: u64,
    /// Cancelled (stock rejected): the saga ended.
    pub cancelled: u64,
}

impl SagaCounts {
    /// Sagas that ended (cancelled, or confirmed and `OrderConfirmed` handled).
    pub fn ended(&self) -> u64 {
        self.confirmed_handled + self.cancelled
    }
}

/// Measures commit → `OrderConfirmed` handled, for orders placed by the
/// load generator. Whichever of the two events comes second records the
/// latency, so the race between them cannot lose a sample.
#[derive(Debug)]
pub struct Latency {
    enabled: AtomicBool,
    events: Mutex<HashMap<Uuid, Event>>,
    histogram: Mutex<Histogram<u64>>,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Committed(Instant),
    Handled(Instant),
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            enabled: AtomicBool::new(false),
            events: Mutex::default(),
            // 1 µs .. 1 h, 3 significant digits.
            histogram: Mutex::new(
                Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds"),
            ),
        }
    }
}

impl Latency {
    /// Starts measuring (the load generator does; the HTTP server does not,
    /// so that it keeps no per-order state).
    pub fn enable(&self) {
        self.enabled.store(true, AtomicOrdering::SeqCst);
    }

    fn record(&self, order_id: Uuid, event: Event) {
        if !self.enabled.load(AtomicOrdering::SeqCst) {
            return;
        }
        let earlier = {
            let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
            match events.remove(&order_id) {
                Some(e) => Some(e),
                None => {
                    events.insert(order_id, event);
                    None
                }
            }
        };
        let (committed, handled) = match (earlier, event) {
            (Some(Event::Committed(c)), Event::Handled(h))
            | (Some(Event::Handled(h)), Event::Committed(c)) => (c, h),
            _ => return,
        };
        let micros = handled.saturating_duration_since(committed).as_micros();
        let micros = u64::try_from(micros).unwrap_or(u64::MAX).max(1);
        self.histogram
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .saturating_record(micros);
    }

    /// Forgets an order that will not be confirmed.
    fn forget(&self, order_id: Uuid) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&order_id);
    }

    /// (samples, p50, p99, max).
    pub fn summary(&self) -> (u64, Duration, Duration, Duration) {
        let h = self.histogram.lock().unwrap_or_else(|p| p.into_inner());
        let us = Duration::from_micros;
        (
            h.len(),
            us(h.value_at_quantile(0.50)),
            us(h.value_at_quantile(0.99)),
            us(h.max()),
        )
    }
}

/// The Ordering module.
#[derive(Debug)]
pub struct Ordering {
    db: ModuleDb,
    /// commit → confirmed latencies of tracked orders.
    pub latency: Latency,
    /// The sagas this process saw end (the load generator listens).
    pub progress: Progress,
}

/// How many sagas this process saw end — an `OrderConfirmed` handled, or
/// a cancellation recorded, each the first time — with a wake-up on each.
/// A hint, not the record: a cancellation counts before its transaction
/// commits; the `orders` table says which sagas ended.
#[derive(Debug, Default)]
pub struct Progress {
    ended: AtomicU64,
    changed: Notify,
}

impl Progress {
    fn saga_ended(&self) {
        self.ended.fetch_add(1, AtomicOrdering::Relaxed);
        self.changed.notify_one();
    }

    /// The sagas seen ending so far.
    pub fn ended(&self) -> u64 {
        self.ended.load(AtomicOrdering::Relaxed)
    }

    /// Waits for the next saga to end (at once if one ended since the last
    /// wait).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

impl Ordering {
    /// Opens the module's database at `location`.
    pub async fn open(location: &Location) -> Result<Arc<Self>, Fail> {
        let db = ModuleDb::open(location, "ordering", DDL).await?;
        Ok(Arc::new(Ordering {
            db,
            latency: Latency::default(),
            progress: Progress::default(),
        }))
    }

    /// The module's database.
    pub fn database(&self) -> &ModuleDb {
        &self.db
    }

    /// Checks a request; returns the total price in cents.
    pub fn validate(customer: &str, sku: &str, qty: u32) -> Result<i64, InvalidOrder> {
        let customer = customer.trim();
        if customer.is_empty() || customer.len() > 200 {
            return Err(InvalidOrder(
                "`customer` must be 1 to 200 characters".into(),
            ));
        }
        if qty == 0 || qty > MAX_QTY {
            return Err(InvalidOrder(format!("`qty` must be 1 to {MAX_QTY}")));
        }
        let Some((_, price)) = CATALOGUE.iter().find(|(s, _)| *s == sku) else {
            let known: Vec<&str> = CATALOGUE.iter().map(|(s, _)| *s).collect();
            return Err(InvalidOrder(format!(
                "unknown sku `{}`; the catalogue has {}",
                sku.chars().take(60).collect::<String>(),
                known.join(", ")
            )));
        };
        Ok(price * i64::from(qty))
    }

    /// Places an order: the `orders` row (status `pending`) and the
    /// `OrderPlaced` integration message commit in ONE transaction.
    /// Returns the order id and the instant the commit returned. With
    /// `track`, the order's commit → confirmed latency is measured.
    pub async fn place_order(
        &self,
        customer: &str,
        sku: &str,
        qty: u32,
        track: bool,
    ) -> Result<(Uuid, Instant), PlaceError> {
        let total_cents = Self::validate(customer, sku, qty).map_err(PlaceError::Invalid)?;
        let customer = customer.trim();
        let store =
            |what: &str, e: &dyn std::fmt::Display| PlaceError::Store(format!("{what}: {e}"));
        let mut tx = self
            .db
            .begin()
            .await
            .map_err(|e| store("beginning the order transaction", &e))?;
        let mut conn = tx.conn();
        let order_id = Uuid::now_v7();
        with_conn!(&mut conn, |c, d| sqlx::query(d.sql(
            "INSERT INTO orders (id, customer, sku, qty, total_cents, status, created_at)
             VALUES ($1, $2, $3, $4, $5, 'pending', $6)",
        ))
        .bind(order_id.to_string())
        .bind(customer)
        .bind(sku)
        .bind(i64::from(qty))
        .bind(total_cents)
        .bind(now_ms())
        .execute(c)
        .await
        .map(|_| ()))
        .map_err(|e| store("inserting the order", &e))?;
        let event = OrderPlaced {
            order_id,
            customer: customer.to_owned(),
            sku: sku.to_owned(),
            qty,
            total_cents,
        };
        let message = NewMessage::integration(&event)
            .map_err(|e| store("encoding OrderPlaced", &e))?
            .key(order_key(order_id));
        conn.enqueue(message)
            .await
            .map_err(|e| store("enqueuing OrderPlaced", &e))?;
        tx.commit()
            .await
            .map_err(|e| store("committing the order", &e))?;
        let committed = Instant::now();
        if track {
            self.latency.record(order_id, Event::Committed(committed));
        }
        Ok((order_id, committed))
    }

    /// One order, if it exists.
    pub async fn get_order(&self, id: Uuid) -> Result<Option<OrderView>, String> {
        const SQL: &str = "SELECT id, customer, sku, qty, total_cents, status, reason, created_at, decided_at, confirmed_at
             FROM orders WHERE id = $1";
        let view = with_pool!(self.db.pool(), |p, d| sqlx::query(d.sql(SQL))
            .bind(id.to_string())
            .fetch_optional(p)
            .await
            .and_then(|row| {
                row.map(|r| {
                    Ok(OrderView {
                        id: r.try_get(0)?,
                        customer: r.try_get(1)?,
                        sku: r.try_get(2)?,
                        qty: u32::try_from(r.try_get::<i64, _>(3)?).unwrap_or(u32::MAX),
                        total_cents: r.try_get(4)?,
                        status: r.try_get(5)?,
                        reason: r.try_get(6)?,
                        created_at: r.try_get(7)?,
                        decided_at: r.try_get(8)?,
                        confirmed_at: r.try_get(9)?,
                    })
                })
                .transpose()
            }))
        .map_err(|e| format!("reading order {id}: {e}"))?;
        Ok(view)
    }

    /// How the sagas of orders `first..=last` stand (committed state; ids
    /// are UUID v7, so the range is the orders placed in between).
    pub async fn saga_counts(&self, first: Uuid, last: Uuid) -> Result<SagaCounts, String> {
        const SQL: &str = "SELECT COUNT(*),
                    COUNT(CASE WHEN status = 'pending' THEN 1 END),
                    COUNT(CASE WHEN status = 'confirmed' THEN 1 END),
                    COUNT(CASE WHEN status = 'confirmed' AND confirmed_at IS NOT NULL THEN 1 END),
                    COUNT(CASE WHEN status = 'cancelled' THEN 1 END)
             FROM orders WHERE id BETWEEN $1 AND $2";
        let counts: [i64; 5] = with_pool!(self.db.pool(), |p, d| sqlx::query(d.sql(SQL))
            .bind(first.to_string())
            .bind(last.to_string())
            .fetch_one(p)
            .await
            .and_then(|r| {
                Ok([
                    r.try_get(0)?,
                    r.try_get(1)?,
                    r.try_get(2)?,
                    r.try_get(3)?,
                    r.try_get(4)?,
                ])
            }))
        .map_err(|e| format!("counting orders: {e}"))?;
        let n = |i: usize| u64::try_from(counts[i]).unwrap_or(0);
        Ok(SagaCounts {
            total: n(0),
            pending: n(1),
            confirmed: n(2),
            confirmed_handled: n(3),
            cancelled: n(4),
        })
    }

    /// The in-process handlers of Ordering's domain messages, for its relay.
    pub fn handlers(self: &Arc<Self>) -> Handlers {
        let me = Arc::clone(self);
        Handlers::new().on::<OrderConfirmed>(move |e: OrderConfirmed, _ctx: MessageContext| {
            let me = Arc::clone(&me);
            async move { me.on_order_confirmed(e).await }
        })
    }

    /// The saga's last step: records when the confirmation was handled
    /// (idempotent: a redelivery changes nothing and is not counted twice).
    async fn on_order_confirmed(&self, e: OrderConfirmed) -> Result<(), HandlerError> {
        const SQL: &str =
            "UPDATE orders SET confirmed_at = $1 WHERE id = $2 AND confirmed_at IS NULL";
        let done = with_pool!(self.db.pool(), |p, d| sqlx::query(d.sql(SQL))
            .bind(now_ms())
            .bind(e.order_id.to_string())
            .execute(p)
            .await
            .map(|r| r.rows_affected()))?;
        if done == 1 {
            self.latency
                .record(e.order_id, Event::Handled(Instant::now()));
            tracing::debug!(order = %e.order_id, "order confirmed");
            self.progress.saga_ended();
        }
        Ok(())
    }

    async fn on_stock_reserved(
        &self,
        e: StockReserved,
        tx: &mut Conn<'_>,
    ) -> Result<(), HandlerError> {
        let changed = with_conn!(tx, |c, d| {
            sqlx::query(d.sql(
            "UPDATE orders SET status = 'confirmed', decided_at = $1 WHERE id = $2 AND status = 'pending'",
        ))
        .bind(now_ms())
        .bind(e.order_id.to_string())
        .execute(c)
        .await
        .map(|r| r.rows_affected())
        })?;
        if changed == 0 {
            tracing::warn!(order = %e.order_id, "StockReserved for an order that is not pending; ignored");
            return Ok(());
        }
        let confirmed = OrderConfirmed {
            order_id: e.order_id,
        };
        let message = NewMessage::domain(&confirmed)?.key(order_key(e.order_id));
        tx.enqueue(message).await?;
        Ok(())
    }

    async fn on_stock_rejected(
        &self,
        e: StockRejected,
        tx: &mut Conn<'_>,
    ) -> Result<(), HandlerError> {
        let changed = with_conn!(tx, |c, d| sqlx::query(d.sql(
            "UPDATE orders SET status = 'cancelled', reason = $1, decided_at = $2
             WHERE id = $3 AND status = 'pending'",
        ))
        .bind(&e.reason)
        .bind(now_ms())
        .bind(e.order_id.to_string())
        .execute(c)
        .await
        .map(|r| r.rows_affected()))?;
        if changed == 0 {
            tracing::warn!(order = %e.order_id, "StockRejected for an order that is not pending; ignored");
        } else {
            self.progress.saga_ended();
        }
        self.latency.forget(e.order_id);
        Ok(())
    }
}

#[async_trait]
impl InboxModule for Ordering {
    fn db(&self) -> &ModuleDb {
        &self.db
    }

    fn subscribes(&self) -> &'static [&'static str] {
        &[StockReserved::MESSAGE_TYPE, StockRejected::MESSAGE_TYPE]
    }

    async fn handle(
        &self,
        message_type: &str,
        payload: &[u8],
        tx: &mut Conn<'_>,
    ) -> Result<(), HandlerError> {
        match message_type {
            StockReserved::MESSAGE_TYPE => {
                self.on_stock_reserved(serde_json::from_slice(payload)?, tx)
                    .await
            }
            StockRejected::MESSAGE_TYPE => {
                self.on_stock_rejected(serde_json::from_slice(payload)?, tx)
                    .await
            }
            other => Err(format!("ordering does not handle message type `{other}`").into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        assert_eq!(Ordering::validate("ann", "teapot", 2), Ok(5_000));
        assert!(
            Ordering::validate(" ", "teapot", 1)
                .unwrap_err()
                .0
                .contains("customer")
        );
        assert!(
            Ordering::validate("ann", "teapot", 0)
                .unwrap_err()
                .0
                .contains("qty")
        );
        let e = Ordering::validate("ann", "spaceship", 1).unwrap_err().0;
        assert!(
            e.contains("unknown sku `spaceship`") && e.contains("teapot"),
            "{e}"
        );
    }

    #[test]
    fn latency_is_recorded_whichever_event_comes_first() {
        let l = Latency::default();
        l.enable();
        let t0 = Instant::now();
        let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        l.record(a, Event::Committed(t0));
        l.record(a, Event::Handled(t0 + Duration::from_millis(2)));
        l.record(b, Event::Handled(t0 + Duration::from_millis(4)));
        l.record(b, Event::Committed(t0));
        l.record(c, Event::Committed(t0));
        l.forget(c);
        let (n, p50, _, max) = l.summary();
        assert_eq!(n, 2);
        assert!(
            p50 >= Duration::from_millis(2) && max <= Duration::from_millis(5),
            "{p50:?} {max:?}"
        );
    }
}
