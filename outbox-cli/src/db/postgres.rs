//! Opening an outbox table in a PostgreSQL schema, without ever creating or
//! migrating anything: [`PgStoreBuilder::connect_existing`](outbox_postgres::PgStoreBuilder::connect_existing)
//! checks with catalogue reads only that the schema and table exist and
//! that the table is an outbox, naming what is wrong otherwise. The URL's
//! password never appears: the store redacts it in its errors and `Debug`.

use std::time::Duration;

use outbox_api::backend::OUTBOX_COLUMNS;
use outbox_postgres::sqlx::{self, PgPool};
use outbox_postgres::{PgStore, error_kind};

use crate::CliError;

/// How long connecting may take before the command fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the outbox table `schema.table` of the database at `url`.
pub async fn open(url: &str, schema: &str, table: &str) -> Result<PgStore, CliError> {
    PgStore::builder(url)
        .schema(schema)
        .table(table)
        .max_connections(2)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_existing()
        .await
        .map_err(CliError::from)
}

/// Connections of the one pool that the stores of many schemas share
/// (`outbox outboxes`, `serve --matching`): as many as the schemas read at
/// a time, whatever their number.
pub const SHARED_POOL_SIZE: u32 = 8;

/// Opens the pool that the outboxes of many schemas share. It is the pool
/// of a store on `public` (whose builder connects and redacts the password
/// in its errors); that store itself is never used.
pub async fn shared_pool(url: &str) -> Result<PgPool, CliError> {
    let store = PgStore::builder(url)
        .max_connections(SHARED_POOL_SIZE)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect()
        .await
        .map_err(CliError::from)?;
    Ok(store.pool().clone())
}

/// The schemas of the database holding an outbox table named `table` (a
/// table, not a view, with every outbox column), sorted byte by byte
/// whatever the database's collation; catalogue reads only. PostgreSQL's
/// own schemas are left out.
pub async fn schemas_with(pool: &PgPool, table: &str) -> Result<Vec<String>, CliError> {
    let columns: Vec<String> = OUTBOX_COLUMNS.iter().map(|c| (*c).to_owned()).collect();
    sqlx::query_scalar(
        "SELECT n.nspname::text
         FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         JOIN pg_attribute a ON a.attrelid = c.oid
         WHERE c.relname = $2 AND c.relkind IN ('r', 'p')
           AND n.nspname NOT LIKE 'pg\\_%' AND n.nspname <> 'information_schema'
           AND a.attnum > 0 AND NOT a.attisdropped AND a.attname::text = ANY($1)
         GROUP BY n.nspname
         HAVING count(*) = cardinality($1)
         ORDER BY n.nspname COLLATE \"C\"",
    )
    .bind(&columns)
    .bind(table)
    .fetch_all(pool)
    .await
    .map_err(catalogue_error)
}

/// Every outbox table of the database (any name), as `schema.table`,
/// sorted: the hint when no schema holds the one asked for.
pub async fn outbox_tables(pool: &PgPool) -> Result<Vec<String>, CliError> {
    let tables = outbox_postgres::outbox_tables(pool)
        .await
        .map_err(catalogue_error)?;
    Ok(tables
        .into_iter()
        .map(|(schema, table)| format!("{schema}.{table}"))
        .collect())
}

fn catalogue_error(e: sqlx::Error) -> CliError {
    outbox_api::Error::new(error_kind(&e), "cannot read the database's catalogue")
        .with_source(e)
        .into()
}

/// The store of the outbox table `schema.table` over the shared `pool`.
/// It checks the names only: the table was found in the catalogue.
pub async fn on_pool(pool: &PgPool, schema: &str, table: &str) -> Result<PgStore, CliError> {
    PgStore::builder_with_pool(pool.clone())
        .schema(schema)
        .table(table)
        .connect()
        .await
        .map_err(CliError::from)
}
