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
//! [`Dialect::sql`] (MySQL takes `?` for parameters: [`mysql_placeholders`]).
//! What differs by dialect — the module's `CREATE TABLE`s ([`Ddl`]), the
//! odd statement with no common form (an upsert: match on the [`Dialect`]),
//! how a transaction begins (`BEGIN IMMEDIATE` on SQLite), the inbox
//! transaction ([`ModuleDb::receive_once`]) — stays small and side by side
//! here.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use outbox::mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use outbox::mysql::sqlx::{MySql, MySqlConnection};
use outbox::mysql::{MySqlOutbox, MySqlStore};
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
    /// A database per module (`<database>_<module><suffix>`) on one MySQL
    /// or MariaDB server, beside the `--mysql` URL's database.
    MySql {
        /// The URL given (with its password: never print it).
        url: String,
        /// The URL as it may be shown.
        redacted: String,
        /// The URL's database: the modules' databases are named after it
        /// (and created and dropped on a connection to it).
        database: String,
        /// Appended to each module's database name (empty, or unique to
        /// this run with `--isolated`).
        suffix: String,
    },
}

/// The longest database name MySQL and MariaDB take.
const MYSQL_NAME_MAX: usize = 64;

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
            Location::MySql {
                redacted,
                database,
                suffix,
                ..
            } => f
                .debug_struct("MySql")
                .field("url", redacted)
                .field("database", database)
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

    /// The MySQL or MariaDB server at `url` (`mysql://…` or
    /// `mariadb://…`, with a database); with a `run` id, database names of
    /// that run (`<database>_<module>_run_<id>`). A malformed URL, or a
    /// database name the modules' names cannot be made of, fails here,
    /// redacted.
    pub fn mysql(url: &str, run: Option<&str>) -> Result<Location, Fail> {
        let redacted = outbox::backend::redact_url(url);
        if !(url.starts_with("mysql://") || url.starts_with("mariadb://")) {
            return Err(Fail(format!(
                "--mysql: `{redacted}` is not a MySQL URL (mysql://USER:PASSWORD@HOST:PORT/DB or mariadb://…)"
            )));
        }
        let Ok(options) = MySqlConnectOptions::from_str(url) else {
            return Err(Fail(format!(
                "--mysql: `{redacted}` is not a valid MySQL URL"
            )));
        };
        let Some(database) = options.get_database().filter(|d| !d.is_empty()) else {
            return Err(Fail(format!(
                "--mysql: `{redacted}` names no database (mysql://USER:PASSWORD@HOST:PORT/DB): \
                 the modules' databases are named after it"
            )));
        };
        if !database
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(Fail(format!(
                "--mysql: the database `{database}` of `{redacted}` may hold letters, digits and `_` only \
                 (the modules' databases are named `{database}_<module>`)"
            )));
        }
        let suffix = run.map(|id| format!("_run_{id}")).unwrap_or_default();
        let location = Location::MySql {
            url: url.to_owned(),
            redacted,
            database: database.to_owned(),
            suffix,
        };
        for module in MODULES {
            let name = location.database(module).unwrap_or_default();
            if name.len() > MYSQL_NAME_MAX {
                return Err(Fail(format!(
                    "--mysql: the database `{database}` has too long a name: the module's database \
                     `{name}` would be {} characters, and MySQL takes at most {MYSQL_NAME_MAX}",
                    name.len()
                )));
            }
        }
        Ok(location)
    }

    /// The PostgreSQL schema of `module`, if on PostgreSQL.
    pub fn schema(&self, module: &str) -> Option<String> {
        match self {
            Location::Postgres { suffix, .. } => Some(format!("{module}{suffix}")),
            Location::Sqlite { .. } | Location::MySql { .. } => None,
        }
    }

    /// The MySQL database of `module`, if on MySQL.
    pub fn database(&self, module: &str) -> Option<String> {
        match self {
            Location::MySql {
                database, suffix, ..
            } => Some(format!("{database}_{module}{suffix}")),
            Location::Sqlite { .. } | Location::Postgres { .. } => None,
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
            Location::MySql { redacted, .. } => format!(
                "data in MySQL at {redacted} (databases {})",
                MODULES
                    .map(|m| format!("`{}`", self.database(m).unwrap_or_default()))
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
            Location::MySql { redacted, .. } => format!(
                "data in MySQL at {redacted} (database `{}`)",
                self.database(module).unwrap_or_default()
            ),
        }
    }

    /// Prepares the place: creates the data directory (SQLite; on
    /// PostgreSQL and MySQL each module creates its schema or database when
    /// it opens). With `fresh`, first removes the shop's own data — its two
    /// database files, its two schemas, or its two MySQL databases.
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
            Location::Postgres { .. } | Location::MySql { .. } if fresh => {
                self.drop_modules("--fresh").await
            }
            Location::Postgres { .. } | Location::MySql { .. } => Ok(()),
        }
    }

    /// Drops both modules' data (`why` names the flag that asked, in
    /// errors): on PostgreSQL their schemas, on MySQL their databases —
    /// everything in them. Nothing on SQLite (`--fresh` removes the files
    /// in [`prepare`](Self::prepare)).
    pub async fn drop_modules(&self, why: &str) -> Result<(), Fail> {
        match self {
            Location::Sqlite { .. } => Ok(()),
            Location::Postgres { url, redacted, .. } => {
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
            Location::MySql { url, redacted, .. } => {
                let pool = connect_mysql(url, redacted, 1).await?;
                for module in MODULES {
                    let database = self.database(module).unwrap_or_default();
                    // The name is ours: checked letters, digits and `_`.
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS `{database}`"
                    )))
                    .execute(&pool)
                    .await
                    .context(format!("{why}: dropping database `{database}`"))?;
                }
                pool.close().await;
                Ok(())
            }
        }
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
            Fail(format!(
                "connecting to PostgreSQL at {redacted}: {}",
                scrub(e.to_string(), url)
            ))
        })
}

/// The password of a `postgres://user:password@host/db` (or `mysql://…`)
/// URL, to scrub it from driver errors.
fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    userinfo.split_once(':').map(|(_, p)| p)
}

/// `text` with the password of `url` (if it has one) replaced by `***`.
fn scrub(text: String, url: &str) -> String {
    match password_of(url) {
        Some(p) if !p.is_empty() => text.replace(p, "***"),
        _ => text,
    }
}

/// `url` (`mysql://user:password@host:port/db?options`) with `database`
/// instead of its database; user, password, host and options kept.
fn with_database(url: &str, database: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let start = scheme_end + 3;
    let rest = &url[start..];
    let authority_end = start + rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let tail = &url[authority_end..];
    let path_end = tail.find(['?', '#']).unwrap_or(tail.len());
    format!("{}/{database}{}", &url[..authority_end], &tail[path_end..])
}

/// A pool on the MySQL database at `url`. Its sessions run at READ
/// COMMITTED, as PostgreSQL's do by default (and as the outbox store's
/// own): a module's `UPDATE … WHERE` and inserts take no gap locks.
async fn connect_mysql(url: &str, redacted: &str, max: u32) -> Result<MySqlPool, Fail> {
    use outbox::mysql::sqlx::Executor as _;
    let options = MySqlConnectOptions::from_str(url)
        .map_err(|_| Fail(format!("--mysql: `{redacted}` is not a valid MySQL URL")))?;
    MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .map_err(|e| {
            Fail(format!(
                "connecting to MySQL at {redacted}: {}",
                scrub(e.to_string(), url)
            ))
        })
}

/// A module's own tables, in each dialect (kept side by side: the only
/// SQL that is written once per dialect).
#[derive(Debug, Clone, Copy)]
pub struct Ddl {
    /// `CREATE TABLE IF NOT EXISTS …` for SQLite.
    pub sqlite: &'static [&'static str],
    /// `CREATE TABLE IF NOT EXISTS …` for PostgreSQL (in the module's schema).
    pub postgres: &'static [&'static str],
    /// `CREATE TABLE IF NOT EXISTS …` for MySQL/MariaDB (InnoDB, in the
    /// module's database).
    pub mysql: &'static [&'static str],
}

/// The SQL dialect of a module's database: what `with_conn!` and
/// `with_pool!` hand their body beside the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    MySql,
}

impl Dialect {
    /// The statement `text`, written with `$1, $2, …` parameters (each once,
    /// in increasing order), as this dialect takes it: unchanged on SQLite
    /// and PostgreSQL, with `?` placeholders on MySQL
    /// ([`mysql_placeholders`]).
    ///
    /// # Panics
    ///
    /// If `text` breaks that rule (a mistake in the program's own SQL): on
    /// MySQL always, elsewhere in debug builds, so that the SQLite tests
    /// catch it too.
    pub fn sql(self, text: &'static str) -> sqlx::SqlStr {
        match self {
            Dialect::Sqlite | Dialect::Postgres => {
                #[cfg(debug_assertions)]
                mysql_placeholders(text);
                sqlx::SqlStr::from_static(text)
            }
            // The text is the program's own (`&'static`), only its
            // placeholders rewritten.
            Dialect::MySql => {
                sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(mysql_placeholders(text)))
            }
        }
    }
}

/// `text` with its `$1, $2, …` parameters as MySQL's `?`.
///
/// MySQL binds `?` placeholders by position, so this is right only when
/// each parameter appears once and in increasing order (`$1` … `$N`):
/// a statement that needs a value twice binds it twice (`$1` and `$3`).
/// `$` inside quoted strings or identifiers (`'…'`, `"…"`, `` `…` ``) is
/// left alone.
///
/// # Panics
///
/// If a parameter appears out of that order (naming it and the
/// statement): the modules' SQL is fixed text, so this is a programming
/// error that the first run of the statement reveals.
pub fn mysql_placeholders(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut expected = 1u32;
    let mut quote: Option<char> = None;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None if matches!(c, '\'' | '"' | '`') => {
                quote = Some(c);
                out.push(c);
            }
            None if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) => {
                let mut n = 0u32;
                while let Some(d) = chars.next_if(char::is_ascii_digit) {
                    n = n
                        .saturating_mul(10)
                        .saturating_add(d.to_digit(10).unwrap_or(0));
                }
                assert!(
                    n == expected,
                    "SQL parameter ${n} where ${expected} was expected: MiniShop's statements \
                     use each parameter once, in increasing order (MySQL binds `?` by position), \
                     in: {text}"
                );
                expected += 1;
                out.push('?');
            }
            None => out.push(c),
        }
    }
    out
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

    #[test]
    fn mysql_urls_are_checked_and_never_shown_with_their_password() {
        let e = Location::mysql("postgres://u:s3cret@h/db", None).unwrap_err();
        assert!(!e.0.contains("s3cret") && e.0.contains("u:***@h"), "{e}");
        assert!(
            e.0.contains("--mysql") && e.0.contains("not a MySQL URL"),
            "{e}"
        );
        let e = Location::mysql("mysql://u:s3cret@h:notaport/db", None).unwrap_err();
        assert!(
            !e.0.contains("s3cret") && e.0.contains("not a valid"),
            "{e}"
        );
        let e = Location::mysql("mysql://u:s3cret@h:3306", None).unwrap_err();
        assert!(
            !e.0.contains("s3cret") && e.0.contains("names no database"),
            "{e}"
        );
        let e = Location::mysql("mysql://u:s3cret@h/my-shop", None).unwrap_err();
        assert!(
            !e.0.contains("s3cret") && e.0.contains("letters, digits and `_`"),
            "{e}"
        );
        let long = "d".repeat(40);
        let e = Location::mysql(&format!("mysql://u:s3cret@h/{long}"), Some("0123456789ab"))
            .unwrap_err();
        assert!(!e.0.contains("s3cret") && e.0.contains("at most 64"), "{e}");
        let l = Location::mysql("mysql://u:s3cret@h/shop", None).unwrap();
        assert_eq!(l.database("ordering").as_deref(), Some("shop_ordering"));
        assert_eq!(l.schema("ordering"), None);
        assert!(!format!("{l:?}").contains("s3cret"));
        assert!(!l.describe().contains("s3cret"));
        assert!(!l.describe_module("warehouse").contains("s3cret"));
        assert!(l.describe().contains("`shop_ordering`, `shop_warehouse`"));
        let l = Location::mysql("mariadb://u@h/test", Some("0123456789ab")).unwrap();
        let database = l.database("warehouse").unwrap();
        assert_eq!(database, "test_warehouse_run_0123456789ab");
    }

    #[test]
    fn module_urls_keep_everything_but_the_database() {
        assert_eq!(
            with_database("mysql://u:p@h:3306/test?ssl-mode=DISABLED", "test_ordering"),
            "mysql://u:p@h:3306/test_ordering?ssl-mode=DISABLED"
        );
        assert_eq!(
            with_database("mariadb://u@h/test", "test_warehouse"),
            "mariadb://u@h/test_warehouse"
        );
        assert_eq!(with_database("mysql://h", "x"), "mysql://h/x");
    }

    #[test]
    fn placeholders_become_question_marks_for_mysql_only() {
        assert_eq!(
            mysql_placeholders("UPDATE t SET a = $1, b = 'x$2' WHERE c = $2 AND d >= $3"),
            "UPDATE t SET a = ?, b = 'x$2' WHERE c = ? AND d >= ?"
        );
        let ten = (1..=10)
            .map(|i| format!("${i}"))
            .collect::<Vec<_>>()
            .join(", ");
        assert_eq!(mysql_placeholders(&ten), ["?"; 10].join(", "));
        assert_eq!(
            Dialect::MySql.sql("SELECT 1 WHERE a = $1").as_str(),
            "SELECT 1 WHERE a = ?"
        );
        assert_eq!(
            Dialect::Postgres.sql("SELECT 1 WHERE a = $1").as_str(),
            "SELECT 1 WHERE a = $1"
        );
        assert_eq!(
            Dialect::Sqlite.sql("SELECT $ FROM t").as_str(),
            "SELECT $ FROM t"
        );
        for bad in [
            "UPDATE t SET a = a - $1 WHERE b = $2 AND a >= $1",
            "SELECT 1 WHERE a = $2 AND b = $1",
        ] {
            let e = std::panic::catch_unwind(|| mysql_placeholders(bad)).unwrap_err();
            let text = e.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(
                text.contains("increasing order") && text.contains(bad),
                "{text}"
            );
        }
    }
}
