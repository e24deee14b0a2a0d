//! [`PgStoreBuilder::connect_existing`]: connecting to an outbox table
//! that must already exist, without ever creating or migrating anything —
//! for operators' tools (the `outbox` CLI), which must not leave a schema
//! or table behind a typo. The checks are catalogue reads only.

use outbox_api::backend::{OUTBOX_COLUMNS, missing_outbox_columns, some_names};
use outbox_api::{Error, ErrorKind, Result};
use sqlx::PgPool;

use crate::error::error_kind;
use crate::{PgStore, PgStoreBuilder};

impl PgStoreBuilder {
    /// Connects to the outbox table of an **existing** schema, creating and
    /// migrating nothing: the schema must exist and hold a table of this
    /// name with every outbox column. The errors say which is wrong:
    /// `ErrorKind::NotFound` (no such schema or table — naming the outbox
    /// tables the database has —, a relation that is not an outbox table),
    /// `ErrorKind::Config` (a name the stores refuse, a malformed URL,
    /// credentials or database refused), `ErrorKind::Unavailable` (the
    /// server does not answer). The password never appears in them. The
    /// inbox table is not needed and not checked.
    pub async fn connect_existing(mut self) -> Result<PgStore> {
        if self.inbox_table == self.table {
            self.inbox_table = outbox_api::backend::unused_inbox_table(&self.table).to_owned();
        }
        let (schema, table) = (self.schema.clone(), self.table.clone());
        let store = self.connect().await?;
        match check_outbox_table(store.pool(), &schema, &table).await {
            Ok(()) => Ok(store),
            Err(e) => {
                store.pool().close().await;
                Err(e)
            }
        }
    }
}

/// Read-only: the schema exists, and `schema.table` is a table with every
/// outbox column.
async fn check_outbox_table(pool: &PgPool, schema: &str, table: &str) -> Result<()> {
    let where_ = format!("`{schema}.{table}`");
    let read = |e: sqlx::Error| {
        Error::new(
            error_kind(&e),
            format!("cannot read the catalogue to check {where_}"),
        )
        .with_source(e)
    };
    let schema_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema)
            .fetch_one(pool)
            .await
            .map_err(read)?;
    let outboxes = outbox_tables(pool).await.map_err(read)?;
    if !schema_exists {
        let mut schemas: Vec<&str> = outboxes.iter().map(|(s, _)| s.as_str()).collect();
        schemas.dedup();
        let hint = if schemas.is_empty() {
            "the database has no outbox tables at all; is this the application's database?"
                .to_owned()
        } else {
            format!(
                "schemas with outbox tables: {}",
                some_names(&schemas, NAMES_SHOWN)
            )
        };
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("the database has no schema `{schema}`; {hint}"),
        ));
    }
    let relation: Option<(String, Vec<String>)> = sqlx::query_as(
        "SELECT c.relkind::text,
                COALESCE(array_agg(a.attname::text) FILTER (WHERE a.attnum > 0 AND NOT a.attisdropped), '{}')
         FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         LEFT JOIN pg_attribute a ON a.attrelid = c.oid
         WHERE n.nspname = $1 AND c.relname = $2
         GROUP BY c.relkind",
    )
    .bind(schema)
    .bind(table)
    .fetch_optional(pool)
    .await
    .map_err(read)?;
    let Some((kind, columns)) = relation else {
        let here: Vec<&str> = outboxes
            .iter()
            .filter(|(s, _)| s == schema)
            .map(|(_, t)| t.as_str())
            .collect();
        let hint = if !here.is_empty() {
            format!("its outbox tables: {}", some_names(&here, NAMES_SHOWN))
        } else if outboxes.is_empty() {
            "the database has no outbox tables at all; is this the application's database?"
                .to_owned()
        } else {
            let elsewhere: Vec<String> = outboxes.iter().map(|(s, t)| format!("{s}.{t}")).collect();
            format!(
                "it has no outbox tables; other schemas do: {}",
                some_names(&elsewhere, NAMES_SHOWN)
            )
        };
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("schema `{schema}` has no outbox table `{table}`; {hint}"),
        ));
    };
    if !matches!(kind.as_str(), "r" | "p") {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "{where_} is not a table (a {}), so not an outbox table",
                relation_kind(&kind)
            ),
        ));
    }
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

/// How many names an error lists before `and N more`.
const NAMES_SHOWN: usize = 8;

/// Every table of the database at `pool` (outside PostgreSQL's own
/// schemas) that has all the outbox columns, as (schema, table), sorted:
/// the outboxes of a database with a schema per tenant. Reads the
/// catalogue only.
pub async fn outbox_tables(pool: &PgPool) -> Result<Vec<(String, String)>, sqlx::Error> {
    let columns: Vec<String> = OUTBOX_COLUMNS.iter().map(|c| (*c).to_owned()).collect();
    sqlx::query_as(
        "SELECT n.nspname::text, c.relname::text
         FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         JOIN pg_attribute a ON a.attrelid = c.oid
         WHERE c.relkind IN ('r', 'p')
           AND n.nspname NOT LIKE 'pg\\_%' AND n.nspname <> 'information_schema'
           AND a.attnum > 0 AND NOT a.attisdropped AND a.attname::text = ANY($1)
         GROUP BY n.nspname, c.relname
         HAVING count(*) = cardinality($1)
         ORDER BY 1, 2",
    )
    .bind(&columns)
    .fetch_all(pool)
    .await
}

/// `pg_class.relkind` in words.
fn relation_kind(kind: &str) -> &'static str {
    match kind {
        "v" => "view",
        "m" => "materialized view",
        "i" | "I" => "index",
        "S" => "sequence",
        "f" => "foreign table",
        "c" => "composite type",
        _ => "relation of another kind",
    }
}
