//! One module's database: the application's sqlx pool and its outbox store.

use std::path::Path;
use std::time::Duration;

use outbox::sqlite::sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use outbox::sqlite::{SqliteOutbox, SqliteStore, sqlx};

use crate::fail::{Context, Fail};

/// A module's SQLite database (`<name>.db`): the pool the module writes its
/// business rows with, and the outbox/inbox (`<name>_outbox`, `<name>_inbox`)
/// its relay reads.
#[derive(Debug, Clone)]
pub struct ModuleDb {
    /// The module's name (`ordering`, `warehouse`); also its inbox consumer name.
    pub name: &'static str,
    /// The application's connections.
    pub pool: SqlitePool,
    /// The relay's view of the outbox table.
    pub store: SqliteStore,
    /// Enqueue and inbox, inside the application's transactions.
    pub outbox: SqliteOutbox,
}

impl ModuleDb {
    /// Opens (creating if needed) `<dir>/<name>.db`, migrates the outbox and
    /// inbox tables, then runs `schema` (the module's own `CREATE TABLE IF
    /// NOT EXISTS …` statements).
    pub async fn open(
        dir: &Path,
        name: &'static str,
        schema: &[&'static str],
    ) -> Result<Self, Fail> {
        let path = dir.join(format!("{name}.db"));
        let store = SqliteStore::builder(&path)
            .table(format!("{name}_outbox"))
            .inbox_table(format!("{name}_inbox"))
            .open()
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
        for statement in schema {
            sqlx::query(*statement)
                .execute(&pool)
                .await
                .context(format!("creating the {name} tables"))?;
        }
        Ok(ModuleDb {
            name,
            pool,
            store,
            outbox,
        })
    }
}

/// Milliseconds since the Unix epoch (what the tables store).
pub fn now_ms() -> i64 {
    outbox::Timestamp::now().as_millis()
}
