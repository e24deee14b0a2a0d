//! The operators' view of a [`PgStore`]: list, inspect, retry, discard.

use async_trait::async_trait;
use outbox_api::{
    ListQuery, Message, MessageId, MessageState, OperatorAction, OperatorStore, Result, Timestamp,
};
use sqlx::{AssertSqlSafe, PgConnection, Row};

use crate::error::storable;
use crate::row::decode_annotated;
use crate::store::{PgStore, to_i64};

impl PgStore {
    /// One operator action in one transaction: the row is locked, checked,
    /// updated, and the change announced (`NOTIFY` in the same transaction)
    /// so that relays everywhere pick it up when it commits.
    async fn operator_action(
        &self,
        action: OperatorAction,
        id: MessageId,
        by: &str,
        now: Timestamp,
    ) -> Result<()> {
        let what = action.doing();
        let mut tx = self
            .inner
            .pool
            .begin()
            .await
            .map_err(|e| self.fail(e, what))?;
        match self.operator_action_in(&mut tx, action, id, by, now).await {
            Ok(Ok(())) => self.finish(tx, Ok(()), what).await?,
            Ok(Err(refusal)) => {
                let _ = tx.rollback().await;
                return Err(refusal);
            }
            Err(e) => return self.finish(tx, Err(e), what).await,
        }
        self.inner.announcer.committed_and_notified();
        Ok(())
    }
}

impl PgStore {
    /// The action inside its transaction: `Ok(Err(_))` is a refusal
    /// (unknown id, wrong state) that changed nothing.
    async fn operator_action_in(
        &self,
        tx: &mut PgConnection,
        action: OperatorAction,
        id: MessageId,
        by: &str,
        now: Timestamp,
    ) -> std::result::Result<Result<()>, sqlx::Error> {
        let sql = &self.inner.sql;
        let row = sqlx::query(AssertSqlSafe(sql.state_of.as_str()))
            .bind(id.as_uuid())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Ok(Err(OperatorAction::not_found(
                id,
                &sql.names.outbox_display(),
            )));
        };
        let state: String = row.try_get(0)?;
        let last_error: Option<String> = row.try_get(1)?;
        let checked = state
            .parse::<MessageState>()
            .and_then(|state| action.check(id, state));
        if let Err(refusal) = checked {
            return Ok(Err(refusal));
        }
        let note = action.audit_note(by, now, last_error.as_deref());
        let update = match action {
            OperatorAction::Retry => &sql.retry,
            OperatorAction::Discard => &sql.discard,
        };
        sqlx::query(AssertSqlSafe(update.as_str()))
            .bind(now.as_millis())
            .bind(storable(&note))
            .bind(id.as_uuid())
            .execute(&mut *tx)
            .await?;
        // Relays in every process hear of it when it commits: announced in
        // its own transaction, so a short-lived caller (the CLI) that exits
        // right after cannot lose the announcement.
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(self.channel())
            .execute(&mut *tx)
            .await?;
        Ok(Ok(()))
    }
}

#[async_trait]
impl OperatorStore for PgStore {
    async fn list(&self, q: &ListQuery) -> Result<Vec<Message>> {
        let what = "listing messages";
        let limit = to_i64(if q.limit == 0 { 100 } else { q.limit });
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.list.as_str()))
            .bind(q.state.map(MessageState::as_str))
            .bind(q.message_type.as_deref())
            .bind(limit)
            .bind(to_i64(q.offset))
            .bind(q.trace_id.as_deref())
            .fetch_all(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, what))?;
        rows.iter()
            .map(decode_annotated)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| self.fail(e, what))
    }

    async fn get(&self, id: MessageId) -> Result<Option<Message>> {
        let what = "reading a message";
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.get.as_str()))
            .bind(id.as_uuid())
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(|e| self.fail(e, what))?;
        row.as_ref()
            .map(decode_annotated)
            .transpose()
            .map_err(|e| self.fail(e, what))
    }

    async fn retry(&self, id: MessageId, by: &str, now: Timestamp) -> Result<()> {
        self.operator_action(OperatorAction::Retry, id, by, now)
            .await
    }

    async fn discard(&self, id: MessageId, by: &str, now: Timestamp) -> Result<()> {
        self.operator_action(OperatorAction::Discard, id, by, now)
            .await
    }
}
