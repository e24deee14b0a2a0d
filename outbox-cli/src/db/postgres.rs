//! Opening an outbox table in a PostgreSQL schema, without ever creating or
//! migrating anything: [`PgStoreBuilder::connect_existing`](outbox_postgres::PgStoreBuilder::connect_existing)
//! checks with catalogue reads only that the schema and table exist and
//! that the table is an outbox, naming what is wrong otherwise. The URL's
//! password never appears: the store redacts it in its errors and `Debug`.

use std::time::Duration;

use outbox_postgres::PgStore;

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
