//! Opening an outbox table in a PostgreSQL schema, without ever creating or
//! migrating anything.
//!
//! [`PgStore`]'s builder validates the schema and table names and connects
//! (it creates nothing by itself); [`open`] then checks, with catalogue
//! reads only, that the schema exists and that the table exists and has
//! every outbox column — naming what is wrong otherwise, with the outbox
//! tables it did find as a hint. The URL's password never appears: the
//! store redacts it in its errors and `Debug`.

use std::time::Duration;

use outbox_postgres::sqlx::{self, PgPool};
use outbox_postgres::{DEFAULT_INBOX_TABLE, DEFAULT_OUTBOX_TABLE, PgStore};

use super::{OUTBOX_COLUMNS, missing_columns};
use crate::CliError;

/// How long connecting may take before the command fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the outbox table `schema.table` of the database at `url`.
pub async fn open(url: &str, schema: &str, table: &str) -> Result<PgStore, CliError> {
    // The CLI never touches the inbox table, but the store's names must
    // differ: give it one that is not the outbox table.
    let inbox = if table == DEFAULT_INBOX_TABLE {
        DEFAULT_OUTBOX_TABLE
    } else {
        DEFAULT_INBOX_TABLE
    };
    let store = PgStore::builder(url)
        .schema(schema)
        .table(table)
        .inbox_table(inbox)
        .max_connections(2)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect()
        .await
        .map_err(|e| {
            // Bad names or a malformed URL are usage errors; a server that
            // does not answer, or refuses the credentials, is a failure.
            if e.message().starts_with("cannot connect") {
                CliError::failed(e.to_string())
            } else {
                CliError::from(e)
            }
        })?;
    match check_outbox_table(store.pool(), schema, table).await {
        Ok(()) => Ok(store),
        Err(e) => {
            store.pool().close().await;
            Err(e)
        }
    }
}

/// Sends the `NOTIFY` relays of `store`'s table listen for.
pub async fn announce(store: &PgStore) {
    if let Err(e) = sqlx::query("SELECT pg_notify($1, '')")
        .bind(store.channel())
        .execute(store.pool())
        .await
    {
        // Relays poll as well; the change is committed either way.
        eprintln!(
            "warning: could not notify relays of `{}.{}` (they will find the change when they next poll): {e}",
            store.schema(),
            store.table()
        );
    }
}

/// Read-only: the schema exists, and `schema.table` is a table with every
/// outbox column.
async fn check_outbox_table(pool: &PgPool, schema: &str, table: &str) -> Result<(), CliError> {
    let where_ = format!("`{schema}.{table}`");
    let read = |e: sqlx::Error| {
        CliError::failed(format!("cannot read the catalogue to check {where_}: {e}"))
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
                "schemas with outbox tables: {} (choose with --schema)",
                some(&schemas)
            )
        };
        return Err(CliError::failed(format!(
            "the database has no schema `{schema}`; {hint}"
        )));
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
            format!("its outbox tables: {} (choose with --table)", some(&here))
        } else if outboxes.is_empty() {
            "the database has no outbox tables at all; is this the application's database?"
                .to_owned()
        } else {
            let elsewhere: Vec<String> = outboxes.iter().map(|(s, t)| format!("{s}.{t}")).collect();
            format!(
                "it has no outbox tables; other schemas do: {} (choose with --schema and --table)",
                some(&elsewhere)
            )
        };
        return Err(CliError::failed(format!(
            "schema `{schema}` has no outbox table `{table}`; {hint}"
        )));
    };
    if !matches!(kind.as_str(), "r" | "p") {
        return Err(CliError::failed(format!(
            "{where_} is not a table (a {}), so not an outbox table",
            relation_kind(&kind)
        )));
    }
    let missing = missing_columns(&columns);
    if !missing.is_empty() {
        return Err(CliError::failed(format!(
            "table {where_} is not an outbox table (it lacks the columns {})",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// Every table of the database (outside PostgreSQL's own schemas) that has
/// all the outbox columns, as (schema, table), sorted.
async fn outbox_tables(pool: &PgPool) -> Result<Vec<(String, String)>, sqlx::Error> {
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

/// The first few of `names`, and how many more there are.
fn some<S: AsRef<str>>(names: &[S]) -> String {
    const SHOWN: usize = 8;
    let mut text = names
        .iter()
        .take(SHOWN)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
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
