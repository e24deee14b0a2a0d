//! Where the modules' databases live ([`Location`]): the `--data-dir`,
//! `--postgres` and `--mysql` arguments checked (their passwords never
//! shown), the places prepared and dropped, and the server pools the
//! modules open.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use outbox::mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use outbox::postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use outbox::sqlite::sqlx;

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
pub(super) async fn connect_pg(
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

/// `text` with the password of `url` (if it has one) replaced by `***`.
fn scrub(text: String, url: &str) -> String {
    match outbox::backend::password_of(url) {
        Some(p) if !p.is_empty() => text.replace(p, "***"),
        _ => text,
    }
}

/// `url` (`mysql://user:password@host:port/db?options`) with `database`
/// instead of its database; user, password, host and options kept.
pub(super) fn with_database(url: &str, database: &str) -> String {
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
pub(super) async fn connect_mysql(url: &str, redacted: &str, max: u32) -> Result<MySqlPool, Fail> {
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
}
