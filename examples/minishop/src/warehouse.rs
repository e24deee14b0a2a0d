//! The Warehouse module (`warehouse.db`, schema `warehouse` on PostgreSQL,
//! or database `<db>_warehouse` on MySQL): reserves stock for placed orders
//! and answers `StockReserved` or `StockRejected`.

use std::sync::Arc;

use async_trait::async_trait;
use outbox::sqlite::sqlx;
use outbox::{HandlerError, NewMessage, OutboxMessage};

use crate::db::{Conn, Ddl, Dialect, Location, ModuleDb, now_ms};
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

/// The warehouse's tables; the dialects differ in the column types only
/// (MySQL keys need `VARCHAR`s; order ids are UUID text, skus the
/// catalogue's).
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
    mysql: &[
        "CREATE TABLE IF NOT EXISTS stock (
            sku       VARCHAR(64) PRIMARY KEY,
            available BIGINT NOT NULL CHECK (available >= 0)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
        "CREATE TABLE IF NOT EXISTS reservations (
            order_id    VARCHAR(36) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
            sku         VARCHAR(64) NOT NULL,
            qty         BIGINT      NOT NULL,
            reserved_at BIGINT      NOT NULL
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    ],
};

/// Adds a sku's initial stock unless the sku is there already (another
/// process may stock it at the same moment): an upsert, which has no form
/// all three dialects take.
fn stock_sql(d: Dialect) -> &'static str {
    match d {
        Dialect::Sqlite | Dialect::Postgres => {
            "INSERT INTO stock (sku, available) VALUES ($1, $2) ON CONFLICT (sku) DO NOTHING"
        }
        // Not `INSERT IGNORE`, which would also turn other errors (a
        // failed CHECK) into warnings.
        Dialect::MySql => {
            "INSERT INTO stock (sku, available) VALUES ($1, $2) ON DUPLICATE KEY UPDATE sku = sku"
        }
    }
}

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
            with_pool!(db.pool(), |p, d| sqlx::query(d.sql(stock_sql(d)))
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
    /// never a read then a write. PostgreSQL (and InnoDB alike) makes a
    /// second `UPDATE` of the row wait for the first transaction and then
    /// re-checks the condition on the committed value; SQLite has one
    /// writer at a time. The
    /// reservation's primary key (the order id) refuses a second
    /// reservation of an order, and the inbox a second handling.
    async fn on_order_placed(&self, e: OrderPlaced, tx: &mut Conn<'_>) -> Result<(), HandlerError> {
        let qty = i64::from(e.qty);
        // `qty` bound twice: MySQL's placeholders are positional.
        let reserved = with_conn!(tx, |c, d| sqlx::query(d.sql(
            "UPDATE stock SET available = available - $1 WHERE sku = $2 AND available >= $3",
        ))
        .bind(qty)
        .bind(&e.sku)
        .bind(qty)
        .execute(c)
        .await
        .map(|r| r.rows_affected()))?
            == 1;
        let answer = if reserved {
            with_conn!(tx, |c, d| {
                sqlx::query(d.sql(
                "INSERT INTO reservations (order_id, sku, qty, reserved_at) VALUES ($1, $2, $3, $4)",
            ))
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
            let available: Option<i64> = with_conn!(tx, |c, d| sqlx::query_scalar(
                d.sql("SELECT available FROM stock WHERE sku = $1")
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
