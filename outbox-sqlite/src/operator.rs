//! Operator functions over a SQLite outbox table: list, get, retry and
//! discard ([`OperatorStore`]).

use async_trait::async_trait;
use outbox_api::activity::{ActivityCounts, ActivityWindow};
use outbox_api::{
    ListQuery, Message, MessageId, MessageState, OperatorAction, OperatorStore, Result, Timestamp,
};
use rusqlite::{Connection, TransactionBehavior, params};

use crate::row::{Decoded, decode};
use crate::schema::COLUMNS;
use crate::store::{SqliteStore, count_state, to_i64};

fn state_of(
    conn: &Connection,
    t: &str,
    id: MessageId,
) -> rusqlite::Result<Option<(String, Option<String>)>> {
    let mut stmt =
        conn.prepare_cached(&format!("SELECT state, last_error FROM {t} WHERE id = ?1"))?;
    let mut rows = stmt.query([id.to_string()])?;
    match rows.next()? {
        Some(row) => Ok(Some((row.get(0)?, row.get(1)?))),
        None => Ok(None),
    }
}

enum OpOutcome {
    Done,
    Refused(outbox_api::Error),
}

impl SqliteStore {
    async fn operator_action(
        &self,
        action: OperatorAction,
        id: MessageId,
        by: &str,
        now: Timestamp,
    ) -> Result<()> {
        let by = by.to_owned();
        let outcome = self
            .run(action.doing(), move |conn, sql| {
                let t = &sql.outbox;
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let Some((state, last_error)) = state_of(&tx, t, id)? else {
                    return Ok(OpOutcome::Refused(OperatorAction::not_found(id, t)));
                };
                let checked = state
                    .parse::<MessageState>()
                    .and_then(|state| action.check(id, state));
                if let Err(refusal) = checked {
                    return Ok(OpOutcome::Refused(refusal));
                }
                let retry = action == OperatorAction::Retry;
                let note = action.audit_note(&by, now, last_error.as_deref());
                let update = if retry {
                    format!(
                        "UPDATE {t} SET state = 'pending', attempts = 0, available_at = ?1, last_error = ?2,
                           locked_by = NULL, locked_until = NULL, processed_at = NULL WHERE id = ?3"
                    )
                } else {
                    format!(
                        "UPDATE {t} SET state = 'processed', processed_at = ?1, last_error = ?2,
                           locked_by = NULL, locked_until = NULL WHERE id = ?3"
                    )
                };
                tx.execute(&update, params![now.as_millis(), note, id.to_string()])?;
                tx.commit()?;
                Ok(OpOutcome::Done)
            })
            .await?;
        match outcome {
            OpOutcome::Done => {
                self.announce_change();
                Ok(())
            }
            OpOutcome::Refused(refusal) => Err(refusal),
        }
    }
}

#[async_trait]
impl OperatorStore for SqliteStore {
    async fn list(&self, q: &ListQuery) -> Result<Vec<Message>> {
        let state = q.state.map(MessageState::as_str);
        let message_type = q.message_type.clone();
        let trace_id = q.trace_id.clone();
        let limit = to_i64(if q.limit == 0 { 100 } else { q.limit });
        let offset = to_i64(q.offset);
        self.run("listing messages", move |conn, sql| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM {} WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR message_type = ?2)
                 AND (?5 IS NULL OR substr(trace_parent, 4, 32) = ?5)
                 ORDER BY seq LIMIT ?3 OFFSET ?4",
                sql.outbox
            ))?;
            let rows = stmt.query_map(params![state, message_type, limit, offset, trace_id], decode)?;
            rows.map(|r| r.map(Decoded::annotated)).collect()
        })
        .await
    }

    async fn get(&self, id: MessageId) -> Result<Option<Message>> {
        self.run("reading a message", move |conn, sql| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM {} WHERE id = ?1",
                sql.outbox
            ))?;
            let mut rows = stmt.query([id.to_string()])?;
            match rows.next()? {
                Some(row) => Ok(Some(decode(row)?.annotated())),
                None => Ok(None),
            }
        })
        .await
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
        let (since, bucket) = (w.since.as_millis(), w.bucket_ms());
        self.run("counting the outbox's activity", move |conn, sql| {
            let q = &sql.activity;
            // One snapshot for the four counts.
            let tx = conn.transaction()?;
            let delivered = tx
                .prepare_cached(&q.delivered)?
                .query_map(params![since, bucket], |r| {
                    Ok((
                        r.get(0)?,
                        usize::try_from(r.get::<_, i64>(1)?).unwrap_or(0),
                        to_u64(r.get(2)?),
                    ))
                })?
                .collect::<rusqlite::Result<_>>()?;
            let failed = tx
                .prepare_cached(&q.failed)?
                .query_map(params![since, bucket], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        to_u64(r.get(2)?),
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?
                .into_iter()
                .filter_map(|(b, state, n)| Some((b, state.parse().ok()?, n)))
                .collect();
            let created = tx
                .prepare_cached(&q.created)?
                .query_map(params![since, bucket], |r| {
                    Ok((r.get(0)?, to_u64(r.get(1)?)))
                })?
                .collect::<rusqlite::Result<_>>()?;
            let pending = count_state(&tx, &sql.outbox, "pending")?;
            tx.commit()?;
            Ok(ActivityCounts::new(delivered, failed, created, pending))
        })
        .await
    }
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
