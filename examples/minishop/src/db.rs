//! One module's database — a SQLite file (`<dir>/<module>.db`) or a
//! PostgreSQL schema (`<module>` in the `--postgres` database) — with the
//! pool the module writes its business rows with and the outbox/inbox
//! (`<module>_outbox`, `<module>_inbox`) its relay reads.
//!
//! The modules' logic is written once for both: business SQL uses `$1`
//! parameters and statements both dialects accept, and runs through
//! `with_conn!` / `with_pool!`, which hand the same statement to the
//! SQLite or the PostgreSQL connection. What differs by dialect — the
//! module's `CREATE TABLE`s ([`Ddl`]), how a transaction begins
//! (`BEGIN IMMEDIATE` on SQLite), the inbox transaction
//! ([`ModuleDb::receive_once`]) — stays small and side by side here.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use outbox::postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
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

/// The two modules, in the order they are opened.
pub const MODULES: [&str; 2] = ["ordering", "warehouse"];

/// Where the modules' databases live.
pub enum Location {
    /// A SQLite file per module in this directory.
    Sqlite {
        /// The data directory.
        dir: PathBuf,
    },
    /// A schema per module (`<module><suffix>`) in one PostgreSQL database.
    Postgres {
        /// The database URL (with its password: never print it).
        url: String,
        /// The URL as it may be shown.
        redacted: String,
        /// Appended to each module's schema name (empty, or unique to
        /// this run with `--isolated`).
        suffix: String,
    },
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Sqlite { dir } => f.debug_struct("Sqlite").field("dir", dir).finish(),
            Location::Postgres {
                redacted, suffix, ..
            } => f
                .debug_struct("Postgres")
                .field("url", redacted)
                .field("suffix", suffix)
                .finish(),
        }
    }
}

impl Location {
    /// The PostgreSQL database at `url`; with a `run` id, schema names
    /// of that run (`<module>_run_<id>`). A malformed URL fails here,
    /// redacted.
    pub fn postgres(url: &str, run: Option<&str>) -> Result<Location, Fail> {
        let redacted = outbox::backend::redact_url(url);
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(Fail(format!(
                "--postgres: `{redacted}` is not a PostgreSQL URL (postgres://USER:PASSWORD@HOST:PORT/DB)"
            )));
        }
        if PgConnectOptions::from_str(url).is_err() {
            return Err(Fail(format!(
                "--postgres: `{redacted}` is not a valid PostgreSQL URL"
            )));
        }
        let suffix = run.map(|id| format!("_run_{id}")).unwrap_or_default();
        Ok(Location::Postgres {
            url: url.to_owned(),
            redacted,
            suffix,
        })
    }

    /// The PostgreSQL schema of `module`, if on PostgreSQL.
    pub fn schema(&self, module: &str) -> Option<String> {
        match self {
            Location::Sqlite { .. } => None,
            Location::Postgres { suffix, .. } => Some(format!("{module}{suffix}")),
        }
    }

    /// For humans: where the data is.
    pub fn describe(&self) -> String {
        match self {
            Location::Sqlite { dir } => format!("data in `{}`", dir.display()),
            Location::Postgres { redacted, .. } => format!(
                "data in PostgreSQL at {redacted} (schemas {})",
                MODULES
                    .map(|m| format!("`{}`", self.schema(m).unwrap_or_default()))
                    .join(", ")
            ),
        }
    }

    /// For humans: where one module's data is.
    pub fn describe_module(&self, module: &str) -> String {
        match self {
            Location::Sqlite { dir } => {
                format!("data in `{}`", dir.join(format!("{module}.db")).display())
            }
            Location::Postgres { redacted, .. } => format!(
                "data in PostgreSQL at {redacted} (schema `{}`)",
                self.schema(module).unwrap_or_default()
            ),
        }
    }

    /// Prepares the place: creates the data directory, or (PostgreSQL)
    /// checks that the database answers. With `fresh`, first removes the
    /// shop's own data — its two database files, or its two schemas.
    pub async fn prepare(&self, fresh: bool) -> Result<(), Fail> {
        match self {
            Location::Sqlite { dir } => {
                if fresh {
                    remove_databases(dir)?;
                }
                std::fs::create_dir_all(dir).context(format!(
                    "cannot create the data directory `{}`",
                    dir.display()
                ))
            }
            Location::Postgres { .. } if fresh => self.drop_schemas("--fresh").await,
            Location::Postgres { .. } => Ok(()),
        }
    }

    /// PostgreSQL: drops both modules' schemas (everything in them).
    pub async fn drop_schemas(&self, why: &str) -> Result<(), Fail> {
        let Location::Postgres { url, redacted, .. } = self else {
            return Ok(());
        };
        let pool = connect_pg(url, redacted, None, 1).await?;
        for module in MODULES {
            let schema = self.schema(module).unwrap_or_default();
            // The name is ours: a module name and a hex suffix.
            sqlx::query(sqlx::AssertSqlSafe(format!(
                r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE"#
            )))
            .execute(&pool)
            .await
            .context(format!("{why}: dropping schema `{schema}`"))?;
        }
        pool.close().await;
        Ok(())
    }
}

/// Removes the shop's own files only (never the whole directory: it may be
/// anything the user pointed at).
fn remove_databases(dir: &std::path::Path) -> Result<(), Fail> {
    for name in MODULES {
        for ext in ["db", "db-wal", "db-shm", "db-journal"] {
            let path = dir.join(format!("{name}.{ext}"));
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Fail(format!(
                        "--fresh: cannot remove `{}`: {e}",
                        path.display()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// A pool on the PostgreSQL database at `url` whose connections look up
/// unqualified names in `schema` first (so the modules' SQL needs no
/// schema prefix).
async fn connect_pg(
    url: &str,
    redacted: &str,
    schema: Option<&str>,
    max: u32,
) -> Result<PgPool, Fail> {
    let mut options = PgConnectOptions::from_str(url)
        .map_err(|_| {
            Fail(format!(
                "--postgres: `{redacted}` is not a valid PostgreSQL URL"
            ))
        })?
        .application_name("minishop");
    if let Some(schema) = schema {
        options = options.options([("search_path", schema)]);
    }
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|e| {
            let text = match password_of(url) {
                Some(p) if !p.is_empty() => e.to_string().replace(p, "***"),
                _ => e.to_string(),
            };
            Fail(format!("connecting to PostgreSQL at {redacted}: {text}"))
        })
}

/// The password of a `postgres://user:password@host/db` URL, to scrub it
/// from driver errors.
fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    userinfo.split_once(':').map(|(_, p)| p)
}

/// A module's own tables, in each dialect (kept side by side: the only
/// SQL that is written twice).
#[derive(Debug, Clone, Copy)]
pub struct Ddl {
    /// `CREATE TABLE IF NOT EXISTS …` for SQLite.
    pub sqlite: &'static [&'static str],
    /// `CREATE TABLE IF NOT EXISTS …` for PostgreSQL (in the module's schema).
    pub postgres: &'static [&'static str],
}

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
}

/// An open transaction of a module, on either backend.
pub enum Tx<'a> {
    /// SQLite (begun with `BEGIN IMMEDIATE`).
    Sqlite(sqlx::Transaction<'static, Sqlite>, &'a SqliteOutbox),
    /// PostgreSQL.
    Postgres(sqlx::Transaction<'static, Postgres>, &'a PgOutbox),
}

impl Tx<'_> {
    /// The transaction's connection, to run statements and enqueue with.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Sqlite(tx, outbox) => Conn::Sqlite(tx, outbox),
            Tx::Postgres(tx, outbox) => Conn::Postgres(tx, outbox),
        }
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Sqlite(tx, _) => tx.commit().await,
            Tx::Postgres(tx, _) => tx.commit().await,
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
}

impl Conn<'_> {
    /// Enqueues `message` in this transaction.
    pub async fn enqueue(&mut self, message: NewMessage) -> outbox::Result<MessageId> {
        match self {
            Conn::Sqlite(conn, outbox) => outbox.enqueue(&mut **conn, message).await,
            Conn::Postgres(conn, outbox) => outbox.enqueue(conn, message).await,
        }
    }
}

/// A module's pool, on either backend (for statements outside a transaction).
pub enum Pool<'a> {
    /// SQLite.
    Sqlite(&'a SqlitePool),
    /// PostgreSQL.
    Postgres(&'a PgPool),
}

/// `with_conn!(conn, |c| body)`: runs `body` with `c` bound to the
/// `&mut SqliteConnection` or `&mut PgConnection` inside `conn` (a
/// `&mut Conn`). The body is written once and compiled for each backend, so
/// its SQL must suit both (`$1` parameters work on both) and it must end in
/// a type both share (e.g. `.map(|r| r.rows_affected())`).
#[macro_export]
macro_rules! with_conn {
    ($conn:expr, |$c:ident| $body:expr) => {
        match $conn {
            $crate::db::Conn::Sqlite(conn, _) => {
                let $c = &mut **conn;
                $body
            }
            $crate::db::Conn::Postgres(conn, _) => {
                let $c = &mut **conn;
                $body
            }
        }
    };
}

/// `with_pool!(db.pool(), |p| body)`: as `with_conn!`, with `p` the
/// `&SqlitePool` or `&PgPool`.
#[macro_export]
macro_rules! with_pool {
    ($pool:expr, |$p:ident| $body:expr) => {
        match $pool {
            $crate::db::Pool::Sqlite($p) => $body,
            $crate::db::Pool::Postgres($p) => $body,
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
        }
        Ok(db)
    }

    /// The relay's view of the outbox table.
    pub fn store(&self) -> Arc<dyn Store> {
        match &self.backend {
            Backend::Sqlite { store, .. } => Arc::new(store.clone()),
            Backend::Postgres { store, .. } => Arc::new(store.clone()),
        }
    }

    /// The operator's view of the outbox table (for the console).
    pub fn operator_store(&self) -> Arc<dyn OperatorStore> {
        match &self.backend {
            Backend::Sqlite { store, .. } => Arc::new(store.clone()),
            Backend::Postgres { store, .. } => Arc::new(store.clone()),
        }
    }

    /// The application's pool.
    pub fn pool(&self) -> Pool<'_> {
        match &self.backend {
            Backend::Sqlite { pool, .. } => Pool::Sqlite(pool),
            Backend::Postgres { pool, .. } => Pool::Postgres(pool),
        }
    }

    /// The SQLite outbox and pool, when on SQLite (for `RabbitConsumer`'s
    /// SQLite inbox).
    pub fn sqlite(&self) -> Option<(&SqliteOutbox, &SqlitePool)> {
        match &self.backend {
            Backend::Sqlite { outbox, pool, .. } => Some((outbox, pool)),
            Backend::Postgres { .. } => None,
        }
    }

    /// The PostgreSQL outbox and pool, when on PostgreSQL (for
    /// `RabbitConsumer`'s PostgreSQL inbox).
    pub fn postgres(&self) -> Option<(&PgOutbox, &PgPool)> {
        match &self.backend {
            Backend::Postgres { outbox, pool, .. } => Some((outbox, pool)),
            Backend::Sqlite { .. } => None,
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
        })
    }

    /// The inbox transaction: records `(self.name, id)` in the inbox (a
    /// duplicate: the handler does not run), runs `handler` guarded (error,
    /// panic or timeout: roll back), commits. On SQLite this is
    /// `SqliteOutbox::receive_once`; on PostgreSQL `PgOutbox::receive_once`.
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

/// Milliseconds since the Unix epoch (what the tables store).
pub fn now_ms() -> i64 {
    outbox::Timestamp::now().as_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_urls_are_checked_and_never_shown_with_their_password() {
        let e = Location::postgres("mysql://u:s3cret@h/db", None).unwrap_err();
        assert!(!e.0.contains("s3cret") && e.0.contains("u:***@h"), "{e}");
        let e = Location::postgres("postgres://u:s3cret@h:notaport/db", None).unwrap_err();
        assert!(
            !e.0.contains("s3cret") && e.0.contains("not a valid"),
            "{e}"
        );
        let l = Location::postgres("postgres://u:s3cret@h/db", None).unwrap();
        assert_eq!(l.schema("ordering").as_deref(), Some("ordering"));
        assert!(!format!("{l:?}").contains("s3cret"));
        assert!(!l.describe().contains("s3cret"));
        let l = Location::postgres("postgresql://u@h/db", Some("0123456789ab")).unwrap();
        let schema = l.schema("warehouse").unwrap();
        assert!(
            schema.starts_with("warehouse_run_") && schema.len() == 26,
            "{schema}"
        );
    }
}
