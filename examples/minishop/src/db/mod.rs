//! One module's database — a SQLite file (`<dir>/<module>.db`), a
//! PostgreSQL schema (`<module>` in the `--postgres` database) or a MySQL
//! database (`<db>_<module>` beside the `--mysql` database `<db>`) — with
//! the pool the module writes its business rows with and the outbox/inbox
//! (`<module>_outbox`, `<module>_inbox`) its relay reads.
//!
//! The modules' logic is written once for all three: business SQL is
//! written with `$1, $2, …` parameters, each used once and in increasing
//! order, in statements every dialect accepts, and runs through
//! `with_conn!` / `with_pool!`, which hand the same statement to the
//! SQLite, PostgreSQL or MySQL connection, passing the text through
//! [`Dialect::sql`] (MySQL takes `?` for parameters:
//! [`mysql_placeholders`](dialect::mysql_placeholders)).
//! What differs by dialect — the module's `CREATE TABLE`s ([`Ddl`]), the
//! odd statement with no common form (an upsert: match on the [`Dialect`]),
//! how a transaction begins (`BEGIN IMMEDIATE` on SQLite), the inbox
//! transaction ([`ModuleDb::receive_once`]) — stays small and side by side
//! here.

use std::sync::Arc;
use std::time::Duration;

use outbox::mysql::sqlx::mysql::MySqlPool;
use outbox::mysql::sqlx::{MySql, MySqlConnection};
use outbox::mysql::{MySqlOutbox, MySqlStore};
use outbox::postgres::sqlx::postgres::PgPool;
use outbox::postgres::sqlx::{PgConnection, Postgres};
use outbox::postgres::{PgOutbox, PgStore};
use outbox::sqlite::InboxOutcome;
use outbox::sqlite::sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use outbox::sqlite::sqlx::{self, Sqlite, SqliteConnection};
use outbox::sqlite::{SqliteOutbox, SqliteStore};
use outbox::{HandlerError, MessageId, NewMessage, OperatorStore, Store};

use crate::fail::{Context, Fail};

mod dialect;
mod location;

pub use dialect::{Ddl, Dialect};
pub use location::Location;
use location::{connect_mysql, connect_pg, with_database};

/// A module's database.
#[derive(Debug, Clone)]
pub struct ModuleDb {
    /// The module's name (`ordering`, `warehouse`); also its inbox consumer name.
    pub name: &'static str,
    backend: Backend,
}

#[derive(Debug, Clone)]
enum Backend {
    Sqlite {
        pool: SqlitePool,
        store: SqliteStore,
        outbox: SqliteOutbox,
    },
    Postgres {
        pool: PgPool,
        store: PgStore,
        outbox: PgOutbox,
    },
    MySql {
        pool: MySqlPool,
        store: MySqlStore,
        outbox: MySqlOutbox,
    },
}

/// An open transaction of a module, on either backend.
pub enum Tx<'a> {
    /// SQLite (begun with `BEGIN IMMEDIATE`).
    Sqlite(sqlx::Transaction<'static, Sqlite>, &'a SqliteOutbox),
    /// PostgreSQL.
    Postgres(sqlx::Transaction<'static, Postgres>, &'a PgOutbox),
    /// MySQL or MariaDB (at READ COMMITTED).
    MySql(sqlx::Transaction<'static, MySql>, &'a MySqlOutbox),
}

impl Tx<'_> {
    /// The transaction's connection, to run statements and enqueue with.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Sqlite(tx, outbox) => Conn::Sqlite(tx, outbox),
            Tx::Postgres(tx, outbox) => Conn::Postgres(tx, outbox),
            Tx::MySql(tx, outbox) => Conn::MySql(tx, outbox),
        }
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Sqlite(tx, _) => tx.commit().await,
            Tx::Postgres(tx, _) => tx.commit().await,
            Tx::MySql(tx, _) => tx.commit().await,
        }
    }
}

/// A connection inside a module's transaction, with the module's outbox:
/// statements run on it (`with_conn!`) and messages enqueued with
/// [`enqueue`](Conn::enqueue) commit together.
pub enum Conn<'a> {
    /// SQLite.
    Sqlite(&'a mut SqliteConnection, &'a SqliteOutbox),
    /// PostgreSQL.
    Postgres(&'a mut PgConnection, &'a PgOutbox),
    /// MySQL or MariaDB.
    MySql(&'a mut MySqlConnection, &'a MySqlOutbox),
}

impl Conn<'_> {
    /// Enqueues `message` in this transaction.
    pub async fn enqueue(&mut self, message: NewMessage) -> outbox::Result<MessageId> {
        match self {
            Conn::Sqlite(conn, outbox) => outbox.enqueue(&mut **conn, message).await,
            Conn::Postgres(conn, outbox) => outbox.enqueue(conn, message).await,
            Conn::MySql(conn, outbox) => outbox.enqueue(conn, message).await,
        }
    }
}

/// A module's pool, on either backend (for statements outside a transaction).
pub enum Pool<'a> {
    /// SQLite.
    Sqlite(&'a SqlitePool),
    /// PostgreSQL.
    Postgres(&'a PgPool),
    /// MySQL or MariaDB.
    MySql(&'a MySqlPool),
}

/// `with_conn!(conn, |c, d| body)`: runs `body` with `c` bound to the
/// `&mut SqliteConnection`, `&mut PgConnection` or `&mut MySqlConnection`
/// inside `conn` (a `&mut Conn`), and `d` to its [`Dialect`]. The body is
/// written once and compiled for each backend, so its SQL must suit all
/// three and go through `d.sql("…")` (`$1, $2, …` parameters, each once and
/// in increasing order, become `?` on MySQL), and it must end in a type they
/// share (e.g. `.map(|r| r.rows_affected())`).
#[macro_export]
macro_rules! with_conn {
    ($conn:expr, |$c:ident, $d:ident| $body:expr) => {
        match $conn {
            $crate::db::Conn::Sqlite(conn, _) => {
                let $c = &mut **conn;
                let $d = $crate::db::Dialect::Sqlite;
                $body
            }
            $crate::db::Conn::Postgres(conn, _) => {
                let $c = &mut **conn;
                let $d = $crate::db::Dialect::Postgres;
                $body
            }
            $crate::db::Conn::MySql(conn, _) => {
                let $c = &mut **conn;
                let $d = $crate::db::Dialect::MySql;
                $body
            }
        }
    };
}

/// `with_pool!(db.pool(), |p, d| body)`: as `with_conn!`, with `p` the
/// `&SqlitePool`, `&PgPool` or `&MySqlPool` and `d` its [`Dialect`].
#[macro_export]
macro_rules! with_pool {
    ($pool:expr, |$p:ident, $d:ident| $body:expr) => {
        match $pool {
            $crate::db::Pool::Sqlite($p) => {
                let $d = $crate::db::Dialect::Sqlite;
                $body
            }
            $crate::db::Pool::Postgres($p) => {
                let $d = $crate::db::Dialect::Postgres;
                $body
            }
            $crate::db::Pool::MySql($p) => {
                let $d = $crate::db::Dialect::MySql;
                $body
            }
        }
    };
}

impl ModuleDb {
    /// Opens (creating if needed) the module's database at `location`,
    /// migrates its outbox and inbox tables, then creates its own tables
    /// (`ddl`).
    pub async fn open(location: &Location, name: &'static str, ddl: Ddl) -> Result<Self, Fail> {
        let backend = match location {
            Location::Sqlite { dir } => open_sqlite(dir, name).await?,
            Location::Postgres { url, redacted, .. } => {
                let schema = location.schema(name).unwrap_or_default();
                open_postgres(url, redacted, &schema, name).await?
            }
            Location::MySql { url, redacted, .. } => {
                let database = location.database(name).unwrap_or_default();
                open_mysql(url, redacted, &database, name).await?
            }
        };
        let db = ModuleDb { name, backend };
        match &db.backend {
            Backend::Sqlite { pool, .. } => {
                for statement in ddl.sqlite {
                    sqlx::query(*statement)
                        .execute(pool)
                        .await
                        .context(format!("creating the {name} tables"))?;
                }
            }
            Backend::Postgres { pool, .. } => {
                // Several processes may open the module at once (warehouse
                // replicas): concurrent `CREATE TABLE IF NOT EXISTS` of one
                // table can fail on PostgreSQL, so they take turns.
                let mut tx = pool
                    .begin()
                    .await
                    .context(format!("creating the {name} tables"))?;
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext(current_schema()))")
                    .execute(&mut *tx)
                    .await
                    .context(format!("creating the {name} tables"))?;
                for statement in ddl.postgres {
                    sqlx::query(*statement)
                        .execute(&mut *tx)
                        .await
                        .context(format!("creating the {name} tables"))?;
                }
                tx.commit()
                    .await
                    .context(format!("creating the {name} tables"))?;
            }
            Backend::MySql { pool, .. } => {
                // Each `CREATE TABLE IF NOT EXISTS` is atomic on MySQL
                // (under the table's metadata lock), so processes opening
                // the module at once need not take turns; DDL commits
                // implicitly, so there is no transaction to hold either.
                for statement in ddl.mysql {
                    sqlx::query(*statement)
                        .execute(pool)
                        .await
                        .context(format!("creating the {name} tables"))?;
                }
            }
        }
        Ok(db)
    }

    /// The relay's view of the outbox table.
    pub fn store(&self) -> Arc<dyn Store> {
        match &self.backend {
            Backend::Sqlite { store, .. } => Arc::new(store.clone()),
            Backend::Postgres { store, .. } => Arc::new(store.clone()),
            Backend::MySql { store, .. } => Arc::new(store.clone()),
        }
    }

    /// The operator's view of the outbox table (for the console).
    pub fn operator_store(&self) -> Arc<dyn OperatorStore> {
        match &self.backend {
            Backend::Sqlite { store, .. } => Arc::new(store.clone()),
            Backend::Postgres { store, .. } => Arc::new(store.clone()),
            Backend::MySql { store, .. } => Arc::new(store.clone()),
        }
    }

    /// The application's pool.
    pub fn pool(&self) -> Pool<'_> {
        match &self.backend {
            Backend::Sqlite { pool, .. } => Pool::Sqlite(pool),
            Backend::Postgres { pool, .. } => Pool::Postgres(pool),
            Backend::MySql { pool, .. } => Pool::MySql(pool),
        }
    }

    /// The SQLite outbox and pool, when on SQLite (for `RabbitConsumer`'s
    /// SQLite inbox).
    pub fn sqlite(&self) -> Option<(&SqliteOutbox, &SqlitePool)> {
        match &self.backend {
            Backend::Sqlite { outbox, pool, .. } => Some((outbox, pool)),
            Backend::Postgres { .. } | Backend::MySql { .. } => None,
        }
    }

    /// The PostgreSQL outbox and pool, when on PostgreSQL (for
    /// `RabbitConsumer`'s PostgreSQL inbox).
    pub fn postgres(&self) -> Option<(&PgOutbox, &PgPool)> {
        match &self.backend {
            Backend::Postgres { outbox, pool, .. } => Some((outbox, pool)),
            Backend::Sqlite { .. } | Backend::MySql { .. } => None,
        }
    }

    /// The MySQL outbox and pool, when on MySQL (for the broker consumers'
    /// MySQL inbox).
    pub fn mysql(&self) -> Option<(&MySqlOutbox, &MySqlPool)> {
        match &self.backend {
            Backend::MySql { outbox, pool, .. } => Some((outbox, pool)),
            Backend::Sqlite { .. } | Backend::Postgres { .. } => None,
        }
    }

    /// Begins a write transaction.
    pub async fn begin(&self) -> Result<Tx<'_>, sqlx::Error> {
        Ok(match &self.backend {
            // Immediate: a deferred transaction that reads and then writes
            // fails at once with SQLITE_BUSY beside another writer.
            Backend::Sqlite { pool, outbox, .. } => {
                Tx::Sqlite(pool.begin_with("BEGIN IMMEDIATE").await?, outbox)
            }
            Backend::Postgres { pool, outbox, .. } => Tx::Postgres(pool.begin().await?, outbox),
            Backend::MySql { pool, outbox, .. } => Tx::MySql(pool.begin().await?, outbox),
        })
    }

    /// The inbox transaction: records `(self.name, id)` in the inbox (a
    /// duplicate: the handler does not run), runs `handler` guarded (error,
    /// panic or timeout: roll back), commits. On SQLite this is
    /// `SqliteOutbox::receive_once`; on PostgreSQL `PgOutbox::receive_once`;
    /// on MySQL `MySqlOutbox::receive_once`.
    pub async fn receive_once<F>(
        &self,
        id: MessageId,
        timeout: Duration,
        handler: F,
    ) -> InboxOutcome
    where
        F: AsyncFnOnce(&mut Conn<'_>) -> Result<(), HandlerError>,
    {
        match &self.backend {
            Backend::Sqlite { pool, outbox, .. } => {
                outbox
                    .receive_once(pool, self.name, id, timeout, async move |tx| {
                        handler(&mut Conn::Sqlite(tx, outbox)).await
                    })
                    .await
            }
            Backend::Postgres { pool, outbox, .. } => {
                outbox
                    .receive_once(pool, self.name, id, timeout, async move |tx| {
                        handler(&mut Conn::Postgres(tx, outbox)).await
                    })
                    .await
            }
            Backend::MySql { pool, outbox, .. } => {
                outbox
                    .receive_once(pool, self.name, id, timeout, async move |tx| {
                        handler(&mut Conn::MySql(tx, outbox)).await
                    })
                    .await
            }
        }
    }

    /// Whether every connection of the application's pool is in use: none
    /// idle and none left to open (what `--sample-pools` counts).
    pub fn pool_saturated(&self) -> bool {
        fn saturated<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> bool {
            pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections()
        }
        match &self.backend {
            Backend::Sqlite { pool, .. } => saturated(pool),
            Backend::Postgres { pool, .. } => saturated(pool),
            Backend::MySql { pool, .. } => saturated(pool),
        }
    }

    /// Closes the application's connections (the store's go with it).
    pub async fn close(&self) {
        match &self.backend {
            Backend::Sqlite { pool, .. } => pool.close().await,
            Backend::Postgres { pool, store, .. } => {
                pool.close().await;
                store.pool().close().await;
            }
            Backend::MySql { pool, store, .. } => {
                pool.close().await;
                store.pool().close().await;
            }
        }
    }
}

async fn open_sqlite(dir: &std::path::Path, name: &'static str) -> Result<Backend, Fail> {
    let path = dir.join(format!("{name}.db"));
    let store = SqliteStore::builder(&path)
        .table(format!("{name}_outbox"))
        .inbox_table(format!("{name}_inbox"))
        .connect()
        .await
        .context(format!("opening the {name} database"))?;
    store
        .migrate()
        .await
        .context(format!("migrating the {name} outbox"))?;
    let outbox = store.outbox();
    let hooks = outbox.clone();
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5));
    // One connection: the module's writers queue in-process (fairly, no
    // SQLite busy-sleeps) instead of racing for the write lock.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        // No test before each acquire: a file connection is not lost the
        // way a network one is, and the test was a round trip to sqlx's
        // worker thread per transaction on the connection that bounds the
        // shop (docs/decisions.md, "MiniShop on SQLite: its bound is
        // Ordering's one connection").
        .test_before_acquire(false)
        .after_connect(move |conn, _meta| {
            let hooks = hooks.clone();
            Box::pin(async move {
                // Commits that enqueued wake this process's relay at once.
                hooks
                    .attach(conn)
                    .await
                    .map_err(|e| sqlx::Error::Protocol(e.to_string()))
            })
        })
        .connect_with(options)
        .await
        .context(format!("opening the {name} database `{}`", path.display()))?;
    Ok(Backend::Sqlite {
        pool,
        store,
        outbox,
    })
}

async fn open_postgres(
    url: &str,
    redacted: &str,
    schema: &str,
    name: &'static str,
) -> Result<Backend, Fail> {
    // The store has its own small pool (claims, completions, the commit
    // watcher) and a LISTEN connection per relay beside it.
    let store = PgStore::builder(url)
        .schema(schema)
        .table(format!("{name}_outbox"))
        .inbox_table(format!("{name}_inbox"))
        .max_connections(4)
        .connect()
        .await
        .context(format!("opening the {name} outbox (schema `{schema}`)"))?;
    store
        .migrate()
        .await
        .context(format!("migrating the {name} outbox (schema `{schema}`)"))?;
    // Several connections: PostgreSQL lets writers run concurrently.
    let pool = connect_pg(url, redacted, Some(schema), 8).await?;
    Ok(Backend::Postgres {
        outbox: store.outbox(),
        pool,
        store,
    })
}

async fn open_mysql(
    url: &str,
    redacted: &str,
    database: &str,
    name: &'static str,
) -> Result<Backend, Fail> {
    // The module's database, made on a connection to the URL's own.
    let server = connect_mysql(url, redacted, 1).await?;
    // The name is ours: checked letters, digits and `_`.
    let created = sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE IF NOT EXISTS `{database}` CHARACTER SET utf8mb4"
    )))
    .execute(&server)
    .await
    .context(format!("creating the {name} database `{database}`"));
    server.close().await;
    created?;
    let module_url = with_database(url, database);
    let module_redacted = outbox::backend::redact_url(&module_url);
    // As on PostgreSQL: the store has its own small pool (claims,
    // completions, the commit watcher) beside the application's.
    let store = MySqlStore::builder(&module_url)
        .table(format!("{name}_outbox"))
        .inbox_table(format!("{name}_inbox"))
        .max_connections(4)
        .connect()
        .await
        .context(format!("opening the {name} outbox (database `{database}`)"))?;
    store.migrate().await.context(format!(
        "migrating the {name} outbox (database `{database}`)"
    ))?;
    // Several connections: InnoDB lets writers run concurrently.
    let pool = connect_mysql(&module_url, &module_redacted, 8).await?;
    Ok(Backend::MySql {
        outbox: store.outbox(),
        pool,
        store,
    })
}

/// Milliseconds since the Unix epoch (what the tables store).
pub fn now_ms() -> i64 {
    outbox::Timestamp::now().as_millis()
}
