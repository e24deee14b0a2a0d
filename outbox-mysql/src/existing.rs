//! [`MySqlStoreBuilder::connect_existing`]: connecting to an outbox table
//! that must already exist, without ever creating or migrating anything —
//! for operators' tools (the `outbox` CLI), which must not leave a table
//! behind a typo. The checks read `information_schema` only.

use outbox_api::backend::{OUTBOX_COLUMNS, missing_outbox_columns, some_names};
use outbox_api::{Error, ErrorKind, Result};
use sqlx::MySqlPool;

use crate::error::error_kind;
use crate::{MySqlStore, MySqlStoreBuilder};

/// How many names an error lists before `and N more`.
const NAMES_SHOWN: usize = 8;

impl MySqlStoreBuilder {
    /// Connects to the outbox table of the URL's database, creating and
    /// migrating nothing: the URL must name a database holding a table of
    /// this name with every outbox column. The errors say which is wrong:
    /// `ErrorKind::NotFound` (no such table — naming the outbox tables the
    /// database has —, a view, a table that is not an outbox),
    /// `ErrorKind::Config` (a name the stores refuse, a URL that is not
    /// MySQL's or names no database, credentials refused),
    /// `ErrorKind::Unavailable` (the server does not answer). The password
    /// never appears in them. The inbox table is not needed and not
    /// checked.
    pub async fn connect_existing(mut self) -> Result<MySqlStore> {
        if self.inbox_table == self.table {
            self.inbox_table = outbox_api::backend::unused_inbox_table(&self.table).to_owned();
        }
        let table = self.table.clone();
        let store = self.connect().await?;
        match check_outbox_table(store.pool(), &table).await {
            Ok(()) => Ok(store),
            Err(e) => {
                store.pool().close().await;
                Err(e)
            }
        }
    }
}

/// Read-only: the connection's database holds `table`, a base table with
/// every outbox column.
async fn check_outbox_table(pool: &MySqlPool, table: &str) -> Result<()> {
    let read = |e: sqlx::Error| {
        Error::new(
            error_kind(&e),
            format!("cannot read information_schema to check the table `{table}`"),
        )
        .with_source(e)
    };
    let database: Option<String> = sqlx::query_scalar("SELECT CAST(DATABASE() AS CHAR)")
        .fetch_one(pool)
        .await
        .map_err(read)?;
    let Some(database) = database else {
        return Err(Error::config(
            "url",
            "the URL names no database: write mysql://USER@HOST/DATABASE",
        ));
    };
    let relation: Option<(String, String)> = sqlx::query_as(
        "SELECT CAST(t.table_type AS CHAR),
                CAST(COALESCE(GROUP_CONCAT(c.column_name SEPARATOR ','), '') AS CHAR)
         FROM information_schema.tables t
         LEFT JOIN information_schema.columns c
           ON c.table_schema = t.table_schema AND c.table_name = t.table_name
         WHERE t.table_schema = DATABASE() AND t.table_name = ?
         GROUP BY t.table_type",
    )
    .bind(table)
    .fetch_optional(pool)
    .await
    .map_err(read)?;
    let where_ = format!("`{database}`.`{table}`");
    let Some((kind, columns)) = relation else {
        let outboxes = outbox_tables(pool).await.map_err(read)?;
        let hint = if outboxes.is_empty() {
            "the database has no outbox tables at all; is this the application's database?"
                .to_owned()
        } else {
            format!("its outbox tables: {}", some_names(&outboxes, NAMES_SHOWN))
        };
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("database `{database}` has no outbox table `{table}`; {hint}"),
        ));
    };
    if kind != "BASE TABLE" {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "{where_} is not a table (a {}), so not an outbox table",
                kind.to_lowercase()
            ),
        ));
    }
    let columns: Vec<String> = columns.split(',').map(str::to_owned).collect();
    let missing = missing_outbox_columns(&columns);
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "table {where_} is not an outbox table (it lacks the columns {})",
                missing.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Every base table of the connection's database that has all the outbox
/// columns, sorted: the hint when the one asked for is missing. Reads
/// `information_schema` only.
pub async fn outbox_tables(pool: &MySqlPool) -> Result<Vec<String>, sqlx::Error> {
    let list = OUTBOX_COLUMNS
        .iter()
        .map(|c| format!("'{c}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let text = format!(
        "SELECT CAST(t.table_name AS CHAR)
         FROM information_schema.tables t
         JOIN information_schema.columns c
           ON c.table_schema = t.table_schema AND c.table_name = t.table_name
         WHERE t.table_schema = DATABASE() AND t.table_type = 'BASE TABLE'
           AND c.column_name IN ({list})
         GROUP BY t.table_name
         HAVING COUNT(*) = {}
         ORDER BY CAST(t.table_name AS BINARY)",
        OUTBOX_COLUMNS.len()
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(text))
        .fetch_all(pool)
        .await
}
