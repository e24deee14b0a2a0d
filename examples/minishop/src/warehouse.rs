//! The Warehouse module (`warehouse.db`, or schema `warehouse` on
//! PostgreSQL): reserves stock for placed orders and answers
//! `StockReserved` or `StockRejected`.

use std::sync::Arc;

use async_trait::async_trait;
use outbox::sqlite::sqlx;
use outbox::{HandlerError, NewMessage, OutboxMessage};

use crate::db::{Conn, Ddl, Location, ModuleDb, now_ms};
use crate::fail::Fail;
use crate::inbox::InboxModule;
use crate::messages::{OrderPlaced, StockRejected, StockReserved, order_key};
use crate::{with_conn, with_pool};

/// Stock a new warehouse starts with: plenty of fruit, few teapots and
/// golden tickets — so a run both confirms and cancels orders.
pub const INITIAL_STOCK: &[(&str, i64)] = &[
    ("apple", 1_000_000),
    ("pear", 1_000_000),
    ("teapot", 40),
    ("golden-ticket", 10),
];

/// The warehouse's tables; the dialects differ in the integer types only.
const DDL: Ddl = Ddl {
    sqlite: &[
        "CREATE TABLE IF NOT EXISTS stock (
            sku       TEXT PRIMARY KEY,
            available INTEGER NOT NULL CHECK (available >= 0)
        )",
        "CREATE TABLE IF NOT EXISTS reservations (
            order_id    TEXT    PRIMARY KEY,
            sku         TEXT    NOT NULL,
            qty         INTEGER NOT NULL,
            reserved_at INTEGER NOT NULL
        )",
    ],
    postgres: &[
        "CREATE TABLE IF NOT EXISTS stock (
            sku       TEXT PRIMARY KEY,
            available BIGINT NOT NULL CHECK (available >= 0)
        )",
        "CREATE TABLE IF NOT EXISTS reservations (
            order_id    TEXT    PRIMARY KEY,
            sku         TEXT    NOT NULL,
            qty         BIGINT  NOT NULL,
            reserved_at BIGINT  NOT NULL
        )",
    ],
};

/// The Warehouse module.
#[derive(Debug)]
pub struct Warehouse {
    db: ModuleDb,
}

impl Warehouse {
    /// Opens the module's database at `location`; a new database gets
    /// [`INITIAL_STOCK`].
    pub async fn open(location: &Location) -> Result<Arc<Self>, Fail> {
        let db = ModuleDb::open(location, "warehouse", DDL).await?;
        for (sku, qty) in INITIAL_STOCK {
            with_pool!(db.pool(), |p| sqlx::query(
                "INSERT INTO stock (sku, available) VALUES ($1, $2) ON CONFLICT (sku) DO NOTHING"
            )
            .bind(*sku)
            .bind(*qty)
            .execute(p)
            .await
            .map(|_| ()))
            .map_err(|e| Fail(format!("stocking the warehouse: {e}")))?;
        }
        Ok(Arc::new(Warehouse { db }))
    }

    /// The module's database.
    pub fn database(&self) -> &ModuleDb {
        &self.db
    }

    /// Reserves the order's stock if there is enough, and answers — the
    /// stock change, the reservation and the answer commit together with
    /// the inbox row.
    ///
    /// Right under concurrent receivers (several warehouse replicas): the
    /// reservation is one conditional `UPDATE … WHERE available >= qty`,
    /// never a read then a write. PostgreSQL makes a second `UPDATE` of the
    /// row wait for the first transaction and then re-checks the condition
    /// on the committed value; SQLite has one writer at a time. The
    /// reservation's primary key (the order id) refuses a second
    /// reservation of an order, and the inbox a second handling.
    async fn on_order_placed(&self, e: OrderPlaced, tx: &mut Conn<'_>) -> Result<(), HandlerError> {
        let qty = i64::from(e.qty);
        let reserved = with_conn!(tx, |c| sqlx::query(
            "UPDATE stock SET available = available - $1 WHERE sku = $2 AND available >= $1",
        )
        .bind(qty)
        .bind(&e.sku)
        .execute(c)
        .await
        .map(|r| r.rows_affected()))?
            == 1;
        let answer = if reserved {
            with_conn!(tx, |c| {
                sqlx::query(
                "INSERT INTO reservations (order_id, sku, qty, reserved_at) VALUES ($1, $2, $3, $4)",
            )
            .bind(e.order_id.to_string())
            .bind(&e.sku)
            .bind(qty)
            .bind(now_ms())
            .execute(c)
            .await
            .map(|_| ())
            })?;
            NewMessage::integration(&StockReserved {
                order_id: e.order_id,
                sku: e.sku,
                qty: e.qty,
            })?
        } else {
            let available: Option<i64> = with_conn!(tx, |c| sqlx::query_scalar(
                "SELECT available FROM stock WHERE sku = $1"
            )
            .bind(&e.sku)
            .fetch_optional(c)
            .await)?;
            let reason = match available {
                None => format!("unknown sku `{}`", e.sku),
                Some(n) => format!("only {n} {} left, {} asked", e.sku, e.qty),
            };
            NewMessage::integration(&StockRejected {
                order_id: e.order_id,
                sku: e.sku,
                qty: e.qty,
                reason,
            })?
        };
        tx.enqueue(answer.key(order_key(e.order_id))).await?;
        Ok(())
    }
}

#[async_trait]
impl InboxModule for Warehouse {
    fn db(&self) -> &ModuleDb {
        &self.db
    }

    fn subscribes(&self) -> &'static [&'static str] {
        &[OrderPlaced::MESSAGE_TYPE]
    }

    async fn handle(
        &self,
        message_type: &str,
        payload: &[u8],
        tx: &mut Conn<'_>,
    ) -> Result<(), HandlerError> {
        match message_type {
            OrderPlaced::MESSAGE_TYPE => {
                self.on_order_placed(serde_json::from_slice(payload)?, tx)
                    .await
            }
            other => Err(format!("warehouse does not handle message type `{other}`").into()),
        }
    }
}
