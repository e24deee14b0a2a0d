//! Finding and opening the outbox table an operator names, without ever
//! creating or migrating anything. This is the only part of the CLI that
//! differs by backend: [`open`] checks read-only that the table exists and
//! is an outbox, then hands the commands an [`Outbox`] whose store is an
//! `OperatorStore` trait object. [`open_all`] finds and opens the outboxes
//! of many schemas at once, over one pool.

mod mysql;
mod postgres;
mod sqlite;

use std::path::PathBuf;
use std::sync::Arc;

use outbox_api::OperatorStore;
use outbox_api::backend::{redact_url, some_names};
use outbox_mysql::MySqlStore;
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::PgPool;

use crate::CliError;
use crate::glob::Glob;

pub use postgres::SHARED_POOL_SIZE;

/// The outbox table an operator named: where it is, not yet opened.
pub enum Target {
    /// A table in a SQLite file.
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// The outbox table.
        table: String,
    },
    /// A table in a PostgreSQL schema.
    Postgres {
        /// The connection URL, password included (never shown: see `Debug`).
        url: String,
        /// The schema.
        schema: String,
        /// The outbox table.
        table: String,
    },
    /// A table in a MySQL/MariaDB database (the URL names the database).
    MySql {
        /// The connection URL, password included (never shown: see `Debug`).
        url: String,
        /// The outbox table.
        table: String,
    },
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Sqlite { path, table } => f
                .debug_struct("Sqlite")
                .field("path", path)
                .field("table", table)
                .finish(),
            Target::Postgres { url, schema, table } => f
                .debug_struct("Postgres")
                .field("url", &redact_url(url))
                .field("schema", schema)
                .field("table", table)
                .finish(),
            Target::MySql { url, table } => f
                .debug_struct("MySql")
                .field("url", &redact_url(url))
                .field("table", table)
                .finish(),
        }
    }
}

impl Target {
    /// Reads `--database` (`sqlite:PATH`, `postgres://…`, `postgresql://…`,
    /// `mysql://…`, `mariadb://…`) with `--schema` (PostgreSQL only; default
    /// `public`) and `--table`.
    pub fn parse(url: &str, schema: Option<&str>, table: &str) -> Result<Target, CliError> {
        let no_schema = |what: &str| {
            CliError::usage(format!(
                "--schema `{}` applies to PostgreSQL only; {what} \
                 (unset --schema / OUTBOX_SCHEMA)",
                schema.unwrap_or_default().escape_debug()
            ))
        };
        if let Some(rest) = url.strip_prefix("sqlite:") {
            if schema.is_some() {
                return Err(no_schema("a SQLite database has no schemas"));
            }
            return Ok(Target::Sqlite {
                path: sqlite::parse_path(url, rest)?,
                table: table.to_owned(),
            });
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Target::Postgres {
                url: url.to_owned(),
                schema: schema.unwrap_or(outbox_postgres::DEFAULT_SCHEMA).to_owned(),
                table: table.to_owned(),
            });
        }
        if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            if schema.is_some() {
                return Err(no_schema(
                    "on MySQL/MariaDB the URL names the database (mysql://USER@HOST/DATABASE)",
                ));
            }
            return Ok(Target::MySql {
                url: url.to_owned(),
                table: table.to_owned(),
            });
        }
        Err(CliError::usage(format!(
            "database `{}` is not a `sqlite:PATH`, `postgres://USER@HOST/DB` or \
             `mysql://USER@HOST/DB` URL",
            redact_url(url).escape_debug()
        )))
    }
}

/// An opened outbox table: its store, and how to name it.
pub struct Outbox {
    store: Arc<dyn OperatorStore>,
    name: String,
    backend: Backend,
}

/// What only some backends need after the store's own work.
enum Backend {
    Sqlite,
    Postgres(PgStore),
    MySql(MySqlStore),
}

impl Outbox {
    /// The store the commands work on.
    pub fn store(&self) -> &dyn OperatorStore {
        &*self.store
    }

    /// The store, shared (for the console, which keeps it while it serves).
    pub fn shared_store(&self) -> Arc<dyn OperatorStore> {
        self.store.clone()
    }

    /// The name the console shows the outbox under (its URLs allow letters,
    /// digits, `-` and `_`): the table, or `schema-table` on PostgreSQL
    /// outside `public` (the table alone if that would pass 64 bytes).
    pub fn console_name(&self) -> String {
        match self.name.split_once('.') {
            Some(("public", table)) => table.to_owned(),
            Some((schema, table)) if schema.len() + table.len() < 64 => {
                format!("{schema}-{table}")
            }
            Some((_, table)) => table.to_owned(),
            None => self.name.clone(),
        }
    }

    /// The table as an operator names it: `outbox`, or `schema.outbox` on
    /// PostgreSQL.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Closes the store's connections (PostgreSQL, MySQL: politely, so the
    /// server logs no broken connection).
    pub async fn close(self) {
        match &self.backend {
            Backend::Sqlite => {}
            Backend::Postgres(pg) => pg.pool().close().await,
            Backend::MySql(my) => my.pool().close().await,
        }
    }
}

/// Opens `target` after checking, read-only, that it is an existing outbox
/// table; never creates or migrates anything.
pub async fn open(target: &Target) -> Result<Outbox, CliError> {
    match target {
        Target::Sqlite { path, table } => {
            let store = sqlite::open(path, table).await?;
            Ok(Outbox {
                name: store.table().to_owned(),
                store: Arc::new(store),
                backend: Backend::Sqlite,
            })
        }
        Target::Postgres { url, schema, table } => {
            let store = postgres::open(url, schema, table).await?;
            Ok(Outbox {
                name: format!("{}.{}", store.schema(), store.table()),
                store: Arc::new(store.clone()),
                backend: Backend::Postgres(store),
            })
        }
        Target::MySql { url, table } => {
            let store = mysql::open(url, table).await?;
            Ok(Outbox {
                name: store.table().to_owned(),
                store: Arc::new(store.clone()),
                backend: Backend::MySql(store),
            })
        }
    }
}

/// The outboxes of a database that `outbox outboxes` and `outbox serve
/// --matching` work on.
pub struct Found {
    /// Each outbox under its name (the schema on PostgreSQL, the table on
    /// SQLite), sorted by name.
    pub outboxes: Vec<Entry>,
    /// What to close when done.
    closing: Closing,
}

/// One outbox [`open_all`] found: its name, and its store — or why it
/// cannot be opened (a schema name the stores refuse).
pub struct Entry {
    /// The schema on PostgreSQL, the table on SQLite.
    pub name: String,
    /// The opened store, or the reason it is not.
    pub store: Result<Arc<dyn OperatorStore>, String>,
}

enum Closing {
    /// The one outbox of a SQLite file or a MySQL database.
    One(Outbox),
    Postgres(PgPool),
}

impl Found {
    /// The pool they were found on (PostgreSQL), to look again.
    pub fn pool(&self) -> Option<&PgPool> {
        match &self.closing {
            Closing::Postgres(pool) => Some(pool),
            Closing::One(_) => None,
        }
    }

    /// Closes the connections (PostgreSQL: politely, the one shared pool).
    pub async fn close(self) {
        match self.closing {
            Closing::One(outbox) => outbox.close().await,
            Closing::Postgres(pool) => pool.close().await,
        }
    }
}

/// Finds, read-only, the outboxes named `--table` whose name matches
/// `matching` (all without one), and opens them. On PostgreSQL: every
/// schema of the database holding an outbox table of that name, all
/// opened over one pool of [`SHARED_POOL_SIZE`] connections; on
/// SQLite: the one table of the file. None at all, or none matching, is an
/// error naming what there is.
pub async fn open_all(target: &Target, matching: Option<&Glob>) -> Result<Found, CliError> {
    match target {
        Target::Sqlite { table, .. } | Target::MySql { table, .. } => {
            let outbox = open(target).await?;
            if let Some(glob) = matching.filter(|g| !g.matches(table)) {
                outbox.close().await;
                let (what, where_) = match target {
                    Target::Sqlite { path, .. } => ("SQLite", format!("`{}`", path.display())),
                    _ => ("MySQL/MariaDB", "the database".to_owned()),
                };
                return Err(CliError::failed(format!(
                    "the outbox table `{table}` of {where_} does not match `{glob}` (a {what} \
                     database has one outbox per --table)"
                )));
            }
            Ok(Found {
                outboxes: vec![Entry {
                    name: table.clone(),
                    store: Ok(outbox.shared_store()),
                }],
                closing: Closing::One(outbox),
            })
        }
        Target::Postgres { url, table, .. } => {
            let pool = postgres::shared_pool(url).await?;
            match find_schemas(&pool, table, matching).await {
                Ok(schemas) => {
                    let mut outboxes = Vec::with_capacity(schemas.len());
                    for schema in schemas {
                        let store = open_schema(&pool, &schema, table).await;
                        outboxes.push(Entry {
                            name: schema,
                            store,
                        });
                    }
                    Ok(Found {
                        outboxes,
                        closing: Closing::Postgres(pool),
                    })
                }
                Err(e) => {
                    pool.close().await;
                    Err(e)
                }
            }
        }
    }
}

/// Opens the outbox table `table` of `schema` on `pool` (no statement: the
/// names are checked, the table was found), or says why it cannot.
pub async fn open_schema(
    pool: &PgPool,
    schema: &str,
    table: &str,
) -> Result<Arc<dyn OperatorStore>, String> {
    postgres::on_pool(pool, schema, table)
        .await
        .map(|s| Arc::new(s) as Arc<dyn OperatorStore>)
        .map_err(|e| e.message)
}

/// The schemas holding an outbox table `table` whose names match `glob`
/// now; none is no error (`serve --matching` looks again while it runs,
/// and every tenant may have gone).
pub async fn schemas_matching(
    pool: &PgPool,
    table: &str,
    glob: &Glob,
) -> Result<Vec<String>, CliError> {
    let all = postgres::schemas_with(pool, table).await?;
    Ok(all.into_iter().filter(|s| glob.matches(s)).collect())
}

/// How many names an error lists before `and N more`.
const NAMES_SHOWN: usize = 8;

/// The schemas holding an outbox table `table` whose names match.
async fn find_schemas(
    pool: &PgPool,
    table: &str,
    matching: Option<&Glob>,
) -> Result<Vec<String>, CliError> {
    let all = postgres::schemas_with(pool, table).await?;
    if all.is_empty() {
        let tables = postgres::outbox_tables(pool).await?;
        let hint = if tables.is_empty() {
            "the database has no outbox tables at all; is this the application's database?"
                .to_owned()
        } else {
            format!(
                "its outbox tables: {} (choose with --table)",
                some_names(&tables, NAMES_SHOWN)
            )
        };
        return Err(CliError::failed(format!(
            "no schema of the database has an outbox table `{table}`; {hint}"
        )));
    }
    let Some(glob) = matching else {
        return Ok(all);
    };
    let matched: Vec<String> = all.iter().filter(|s| glob.matches(s)).cloned().collect();
    if matched.is_empty() {
        return Err(CliError::failed(format!(
            "no schema matching `{glob}` has an outbox table `{table}`; schemas that have one: {}",
            some_names(&all, NAMES_SHOWN)
        )));
    }
    Ok(matched)
}

/// Checks that `name` is a table name the stores accept (clap value
/// parser): the rules of every store, `outbox_api::backend::validate_table_name`.
pub fn parse_table_name(name: &str) -> Result<String, String> {
    outbox_api::backend::validate_table_name("table", name)
        .map(|()| name.to_owned())
        .map_err(|e| e.message().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqlite_path(url: &str) -> PathBuf {
        match Target::parse(url, None, "outbox").unwrap() {
            Target::Sqlite { path, .. } => path,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn database_urls() {
        assert_eq!(sqlite_path("sqlite:a.db"), PathBuf::from("a.db"));
        assert_eq!(sqlite_path("sqlite://a.db"), PathBuf::from("a.db"));
        assert_eq!(sqlite_path("sqlite:///x/a.db"), PathBuf::from("/x/a.db"));
        for bad in ["a.db", "mssql://h/db", "sqlite:", "sqlite::memory:"] {
            assert!(Target::parse(bad, None, "outbox").is_err(), "{bad}");
        }
        for pg in ["postgres://u@h/db", "postgresql://u:pw@h:5433/db"] {
            match Target::parse(pg, None, "outbox").unwrap() {
                Target::Postgres { url, schema, table } => {
                    assert_eq!(
                        (url.as_str(), schema.as_str(), table.as_str()),
                        (pg, "public", "outbox")
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        match Target::parse("postgres://u@h/db", Some("shop"), "t").unwrap() {
            Target::Postgres { schema, .. } => assert_eq!(schema, "shop"),
            other => panic!("{other:?}"),
        }
        let e = Target::parse("sqlite:a.db", Some("shop"), "outbox").unwrap_err();
        assert!(e.message.contains("--schema"), "{}", e.message);
        for my in ["mysql://u@h/db", "mariadb://u:pw@h:3307/db"] {
            match Target::parse(my, None, "t").unwrap() {
                Target::MySql { url, table } => {
                    assert_eq!((url.as_str(), table.as_str()), (my, "t"))
                }
                other => panic!("{other:?}"),
            }
        }
        let e = Target::parse("mysql://u@h/db", Some("shop"), "outbox").unwrap_err();
        assert!(
            e.message.contains("the URL names the database"),
            "{}",
            e.message
        );
    }

    #[test]
    fn passwords_are_never_shown() {
        let e = Target::parse("mssql://u:s3cret@h/db", None, "outbox").unwrap_err();
        assert!(!e.message.contains("s3cret"), "{}", e.message);
        assert!(e.message.contains("mssql://u:***@h/db"), "{}", e.message);
        let t = Target::parse("mysql://u:s3cret@h/db", None, "outbox").unwrap();
        let shown = format!("{t:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        let t = Target::parse("postgres://u:s3cret@h/db", None, "outbox").unwrap();
        let shown = format!("{t:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }

    #[test]
    fn table_names() {
        assert!(parse_table_name("orders_outbox").is_ok());
        for bad in ["", "1x", "a-b", "x; DROP TABLE y", &"a".repeat(64)] {
            assert!(parse_table_name(bad).is_err(), "{bad}");
        }
    }
}
