//! Migrations: versioned, idempotent, one transaction, safe from several
//! processes at once.

use outbox_api::{Result, Timestamp};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::error::from_sqlx;
use crate::schema::{self, TableKind, VERSIONS_TABLE};
use crate::store::PgStore;

impl PgStore {
    /// Creates or upgrades the schema, the outbox and the inbox tables.
    /// Versioned (in `<schema>.outbox_schema_versions`) and idempotent: safe
    /// to call at every start, from several processes at once (they take
    /// turns on an advisory lock; the migration is one transaction).
    pub async fn migrate(&self) -> Result<()> {
        let names = &self.inner.sql.names;
        let what = "migrating";
        let table = names.outbox_display();
        let fail = |e| from_sqlx(e, what, &table);
        let mut tx = self.inner.pool.begin().await.map_err(fail)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(schema::migration_lock())
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        let s = &names.schema;
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"CREATE SCHEMA IF NOT EXISTS "{s}";
               CREATE TABLE IF NOT EXISTS "{s}"."{VERSIONS_TABLE}" (
                   table_name  text PRIMARY KEY,
                   table_kind  text NOT NULL,
                   version     integer NOT NULL,
                   applied_at  bigint NOT NULL
               )"#
        )))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
        let mut applied = 0;
        for (kind, table_name) in [
            (TableKind::Outbox, &names.outbox),
            (TableKind::Inbox, &names.inbox),
        ] {
            applied += migrate_table(&mut tx, s, kind, table_name)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        if applied > 0 {
            tracing::info!(outbox = %table, inbox = %names.inbox_display(), applied,
                "outbox schema migrated");
        }
        Ok(())
    }
}

/// Applies the missing migrations of `table`; returns how many.
async fn migrate_table(
    tx: &mut PgConnection,
    schema: &str,
    kind: TableKind,
    table: &str,
) -> std::result::Result<usize, sqlx::Error> {
    let current: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        r#"SELECT version FROM "{schema}"."{VERSIONS_TABLE}" WHERE table_name = $1"#
    )))
    .bind(table)
    .fetch_optional(&mut *tx)
    .await?;
    let current = current.unwrap_or(0);
    let migrations = kind.migrations();
    let mut applied = 0;
    for (i, sql) in migrations.iter().enumerate() {
        let version = i as i32 + 1;
        if version <= current {
            continue;
        }
        sqlx::raw_sql(AssertSqlSafe(TableKind::render(sql, schema, table)))
            .execute(&mut *tx)
            .await?;
        applied += 1;
    }
    if applied > 0 {
        sqlx::query(AssertSqlSafe(format!(
            r#"INSERT INTO "{schema}"."{VERSIONS_TABLE}" (table_name, table_kind, version, applied_at)
               VALUES ($1, $2, $3, $4)
               ON CONFLICT (table_name) DO UPDATE SET version = excluded.version,
                 applied_at = excluded.applied_at"#
        )))
        .bind(table)
        .bind(kind.label())
        .bind(migrations.len() as i32)
        .bind(Timestamp::now().as_millis())
        .execute(&mut *tx)
        .await?;
    }
    Ok(applied)
}
