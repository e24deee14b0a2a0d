//! Migrations: versioned, idempotent, safe from several processes at once.

use outbox_api::backend::MIGRATIONS_TABLE;
use outbox_api::{Result, Timestamp};
use sqlx::{AssertSqlSafe, MySqlConnection};

use crate::error::from_sqlx;
use crate::schema::{TableKind, VERSIONS_TABLE};
use crate::store::MySqlStore;

/// The named lock migrations take turns on (per database and table).
fn lock_name(table: &str) -> String {
    format!("outbox-rs migrate {table}")
}

impl MySqlStore {
    /// Creates or upgrades the outbox table (with its key-lock table
    /// `<table>_keys`) and the inbox table. Versioned (in
    /// `outbox_schema_versions`) and idempotent: safe to call at every
    /// start, from several processes at once (they take turns on a named
    /// lock, `GET_LOCK`). MySQL commits each DDL statement by itself, so a
    /// migration interrupted half-way is finished by the next call: every
    /// statement is written to run again harmlessly.
    pub async fn migrate(&self) -> Result<()> {
        let names = &self.inner.sql.names;
        let what = "migrating";
        let fail = |e| from_sqlx(e, what, &names.outbox);
        let mut conn = self.conn(what).await?;
        let lock = lock_name(&names.outbox);
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await
            .map_err(fail)?;
        if got != Some(1) {
            return Err(outbox_api::Error::unavailable(format!(
                "migrating `{}`: another process held the migration lock for 60 s",
                names.outbox
            )));
        }
        let result = migrate_all(&mut conn, &names.outbox, &names.inbox).await;
        let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        let applied = result.map_err(fail)?;
        if applied > 0 {
            tracing::info!(outbox = %names.outbox, inbox = %names.inbox, applied,
                "outbox schema migrated");
        }
        Ok(())
    }
}

async fn migrate_all(
    conn: &mut MySqlConnection,
    outbox: &str,
    inbox: &str,
) -> std::result::Result<usize, sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS `{MIGRATIONS_TABLE}` (
             table_name  VARCHAR(64) NOT NULL PRIMARY KEY,
             table_kind  VARCHAR(16) NOT NULL,
             version     INT NOT NULL,
             applied_at  BIGINT NOT NULL
         ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    )))
    .execute(&mut *conn)
    .await?;
    let mut applied = 0;
    for (kind, table) in [(TableKind::Outbox, outbox), (TableKind::Inbox, inbox)] {
        applied += migrate_table(conn, kind, table).await?;
    }
    Ok(applied)
}

/// Applies the missing migrations of `table`, recording each version as
/// it completes; returns how many.
async fn migrate_table(
    conn: &mut MySqlConnection,
    kind: TableKind,
    table: &str,
) -> std::result::Result<usize, sqlx::Error> {
    let current: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM `{VERSIONS_TABLE}` WHERE table_name = ?"
    )))
    .bind(table)
    .fetch_optional(&mut *conn)
    .await?;
    let current = current.unwrap_or(0);
    let mut applied = 0;
    for (i, statements) in kind.migrations().iter().enumerate() {
        let version = i as i32 + 1;
        if version <= current {
            continue;
        }
        for sql in statements {
            sqlx::raw_sql(AssertSqlSafe(TableKind::render(sql, table)))
                .execute(&mut *conn)
                .await?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{VERSIONS_TABLE}` (table_name, table_kind, version, applied_at)
             VALUES (?, ?, ?, ?)
             ON DUPLICATE KEY UPDATE version = VALUES(version), applied_at = VALUES(applied_at)"
        )))
        .bind(table)
        .bind(kind.label())
        .bind(version)
        .bind(Timestamp::now().as_millis())
        .execute(&mut *conn)
        .await?;
        applied += 1;
    }
    Ok(applied)
}
