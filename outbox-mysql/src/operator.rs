//! The operators' view of a [`MySqlStore`]: list, inspect, retry, discard,
//! activity.

use async_trait::async_trait;
use outbox_api::activity::{ActivityCounts, ActivityWindow};
use outbox_api::{
    ListQuery, Message, MessageId, MessageState, OperatorAction, OperatorStore, Result, Timestamp,
};
use sqlx::{AssertSqlSafe, MySqlConnection, Row};

use crate::row::decode_annotated;
use crate::store::{MySqlStore, to_i64};

impl MySqlStore {
    /// One operator action in one transaction: the row is locked, checked
    /// by the shared precondition ([`OperatorAction::check`]), updated, and
    /// this process's relays woken once it commits.
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
            Ok(Ok(())) => tx.commit().await.map_err(|e| self.fail(e, what))?,
            Ok(Err(refusal)) => {
                let _ = tx.rollback().await;
                return Err(refusal);
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(self.fail(e, what));
            }
        }
        self.inner.signals.wakeup.notify();
        Ok(())
    }

    /// The action inside its transaction: `Ok(Err(_))` is a refusal
    /// (unknown id, wrong state) that changed nothing.
    async fn operator_action_in(
        &self,
        tx: &mut MySqlConnection,
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
            return Ok(Err(OperatorAction::not_found(id, &sql.names.outbox)));
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
            .bind(note)
            .bind(id.as_uuid())
            .execute(&mut *tx)
            .await?;
        Ok(Ok(()))
    }
}

#[async_trait]
impl OperatorStore for MySqlStore {
    async fn list(&self, q: &ListQuery) -> Result<Vec<Message>> {
        let what = "listing messages";
        let limit = to_i64(if q.limit == 0 { 100 } else { q.limit });
        let state = q.state.map(MessageState::as_str);
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.list.as_str()))
            .bind(state)
            .bind(state)
            .bind(q.message_type.as_deref())
            .bind(q.message_type.as_deref())
            .bind(q.trace_id.as_deref())
            .bind(q.trace_id.as_deref())
            .bind(limit)
            .bind(to_i64(q.offset))
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

    async fn activity_counts(&self, w: &ActivityWindow) -> Result<ActivityCounts> {
        let what = "counting the outbox's activity";
        let sql = &self.inner.sql;
        let (since, bucket) = (w.since.as_millis(), w.bucket_ms());
        let fail = |e| self.fail(e, what);
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        // One snapshot for the four counts.
        let mut tx = self.begin_snapshot(what).await?;
        let mut grouped = async |text: &str| {
            sqlx::query(AssertSqlSafe(text))
                .bind(since)
                .bind(bucket)
                .fetch_all(&mut *tx)
                .await
                .map_err(fail)
        };
        let mut delivered = Vec::new();
        for r in grouped(&sql.activity_delivered).await? {
            let class: i64 = r.try_get(1).map_err(fail)?;
            delivered.push((
                r.try_get(0).map_err(fail)?,
                usize::try_from(class).unwrap_or(0),
                n(r.try_get(2).map_err(fail)?),
            ));
        }
        let mut failed = Vec::new();
        for r in grouped(&sql.activity_failed).await? {
            let state: String = r.try_get(1).map_err(fail)?;
            if let Ok(state) = state.parse() {
                failed.push((
                    r.try_get(0).map_err(fail)?,
                    state,
                    n(r.try_get(2).map_err(fail)?),
                ));
            }
        }
        let mut created = Vec::new();
        for r in grouped(&sql.activity_created).await? {
            created.push((r.try_get(0).map_err(fail)?, n(r.try_get(1).map_err(fail)?)));
        }
        let pending = self.count_state(&mut tx, "pending").await.map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(ActivityCounts::new(delivered, failed, created, pending))
    }
}
