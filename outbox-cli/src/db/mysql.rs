//! Opening an outbox table in a MySQL/MariaDB database, without ever
//! creating or migrating anything: [`MySqlStoreBuilder::connect_existing`](outbox_mysql::MySqlStoreBuilder::connect_existing)
//! checks with `information_schema` reads only that the table exists and
//! is an outbox, naming what is wrong otherwise. The URL's password never
//! appears: the store redacts it in its errors and `Debug`.

use std::time::Duration;

use outbox_mysql::MySqlStore;

use crate::CliError;

/// How long connecting may take before the command fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens the outbox table `table` of the database the URL names.
pub async fn open(url: &str, table: &str) -> Result<MySqlStore, CliError> {
    MySqlStore::builder(url)
        .table(table)
        .max_connections(2)
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_existing()
        .await
        .map_err(CliError::from)
}
