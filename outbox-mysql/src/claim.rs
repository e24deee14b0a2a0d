//! The claim: one short transaction at READ COMMITTED.
//!
//! 1. `SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION`
//!    (one round trip). READ COMMITTED takes no gap or next-key locks for
//!    searches, so a claim walking the `(state, seq)` index never blocks
//!    an application inserting at its end, and an insert never blocks the
//!    claim; REPEATABLE READ (InnoDB's default) would lock the gaps it
//!    scanned until the claim commits.
//! 2. `SELECT … ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED` of the
//!    claimable rows, all columns: rows another claim (or a completion, or
//!    an uncommitted insert) holds are skipped, never waited for. The rows
//!    it locks are read in their newest committed version and tested
//!    against the `WHERE` again.
//! 3. The keyed rows are filtered (below), then `UPDATE … SET locked_by,
//!    locked_until WHERE seq IN (…)` (MySQL has no `UPDATE … RETURNING`,
//!    and no `LIMIT` in an `IN` subquery), corrupt rows poisoned, and
//!    `COMMIT`.
//!
//! **Per-key order.** A keyed message is claimable only if no earlier
//! message of its key is unprocessed and unclaimable now (poisoned,
//! delayed, leased, of the other kind) and no later one is leased. The
//! subqueries read the statement's snapshot, which may be older than a
//! claim running beside this one: that claim may hold a key's first
//! message, which this one skips (locked) while its snapshot still shows it
//! claimable — and would then take the key's second. So each candidate
//! carries the count of earlier pending messages of its key (`earlier`),
//! and is kept only if all of them are among the rows this claim locked: a
//! key's messages are leased by one claim, from the front, or not at all.
//!
//! Across transactions, `AUTO_INCREMENT` order is not commit order; the
//! enqueue's per-key lock makes it so for each key (see
//! [`MySqlOutbox`](crate::MySqlOutbox)).

use std::collections::HashMap;

use outbox_api::{ClaimRequest, Message, Timestamp};
use sqlx::{AssertSqlSafe, MySqlConnection, Row};

use crate::row::decode;
use crate::schema::placeholders;
use crate::store::{MySqlStore, to_i64};

/// The statement that opens every claim's transaction.
pub(crate) const BEGIN_CLAIM: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// A locked candidate: its `seq`, key, earlier pending messages of its key
/// (by the statement's snapshot), and the message with its problems.
struct Candidate {
    decoded: crate::row::Decoded,
    earlier: i64,
}

/// Which candidates (in `seq` order) a claim may lease: a keyless one
/// always; a keyed one only if every earlier pending message of its key
/// (`earlier`) is a candidate kept before it.
pub(crate) fn keep_in_key_order<'a>(
    candidates: impl IntoIterator<Item = (Option<&'a str>, i64)>,
) -> Vec<bool> {
    let mut kept_of_key: HashMap<&str, i64> = HashMap::new();
    let mut broken: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    for (key, earlier) in candidates {
        let keep = match key {
            None => true,
            Some(k) if broken.contains(&k) => false,
            Some(k) => {
                let kept = kept_of_key.entry(k).or_insert(0);
                if *kept == earlier {
                    *kept += 1;
                    true
                } else {
                    broken.push(k);
                    false
                }
            }
        };
        out.push(keep);
    }
    out
}

impl MySqlStore {
    pub(crate) async fn run_claim(&self, r: &ClaimRequest) -> outbox_api::Result<Vec<Message>> {
        let what = "claiming messages";
        let mut tx = self
            .inner
            .pool
            .begin_with(BEGIN_CLAIM)
            .await
            .map_err(|e| self.fail(e, what))?;
        match self.claim_in(&mut tx, r).await {
            Ok(claimed) => {
                tx.commit().await.map_err(|e| self.fail(e, what))?;
                Ok(claimed)
            }
            Err(e) => {
                if let Err(rollback) = tx.rollback().await {
                    tracing::debug!(error = %rollback, "rollback after a failed claim failed");
                }
                Err(self.fail(e, what))
            }
        }
    }

    async fn claim_in(
        &self,
        conn: &mut MySqlConnection,
        r: &ClaimRequest,
    ) -> Result<Vec<Message>, sqlx::Error> {
        let sql = &self.inner.sql;
        let now = r.now.as_millis();
        let until = r.now.saturating_add(r.lease);
        let kind = r.kind.map(|k| k.as_str());
        let rows = sqlx::query(AssertSqlSafe(sql.claim_select.as_str()))
            .bind(now)
            .bind(now)
            .bind(kind)
            .bind(kind)
            .bind(now)
            .bind(now)
            .bind(kind)
            .bind(kind)
            .bind(now)
            .bind(to_i64(r.limit))
            .fetch_all(&mut *conn)
            .await?;
        let mut candidates = Vec::with_capacity(rows.len());
        for row in &rows {
            candidates.push(Candidate {
                decoded: decode(row)?,
                earlier: row.try_get("earlier")?,
            });
        }
        let keep = keep_in_key_order(
            candidates
                .iter()
                .map(|c| (c.decoded.row.message.key.as_deref(), c.earlier)),
        );
        let kept: Vec<Candidate> = candidates
            .into_iter()
            .zip(keep)
            .filter_map(|(c, keep)| keep.then_some(c))
            .collect();
        if kept.is_empty() {
            return Ok(Vec::new());
        }
        let text = format!("{}{}", sql.lease_head, placeholders(kept.len()));
        let mut lease = sqlx::query(AssertSqlSafe(text))
            .bind(&r.worker)
            .bind(until.as_millis());
        for c in &kept {
            lease = lease.bind(c.decoded.seq);
        }
        lease.execute(&mut *conn).await?;
        self.settle_corrupt(conn, kept, &r.worker, until, r.now)
            .await
    }

    /// The leased rows as messages; a row that does not decode is poisoned
    /// with a note saying what was wrong, and its key's later rows of this
    /// claim given back, so the relay goes on with the rest.
    async fn settle_corrupt(
        &self,
        conn: &mut MySqlConnection,
        kept: Vec<Candidate>,
        worker: &str,
        until: Timestamp,
        now: Timestamp,
    ) -> Result<Vec<Message>, sqlx::Error> {
        let sql = &self.inner.sql;
        let mut out = Vec::with_capacity(kept.len());
        let mut parked: Vec<String> = Vec::new();
        for c in kept {
            let seq = c.decoded.seq;
            let row = c.decoded.row;
            let key = row.message.key.clone();
            if !row.problems.is_empty() {
                let problem = format!("corrupt row: {}", row.problems.join("; "));
                tracing::error!(table = %sql.names.outbox, seq, %problem,
                    "poisoning an undecodable outbox row");
                sqlx::query(AssertSqlSafe(sql.poison_seq.as_str()))
                    .bind(problem)
                    .bind(now.as_millis())
                    .bind(seq)
                    .execute(&mut *conn)
                    .await?;
                parked.extend(key);
            } else if key.as_ref().is_some_and(|k| parked.contains(k)) {
                sqlx::query(AssertSqlSafe(sql.unlock_seq.as_str()))
                    .bind(seq)
                    .execute(&mut *conn)
                    .await?;
            } else {
                let mut m = row.message;
                m.locked_by = Some(worker.to_owned());
                m.locked_until = Some(until);
                out.push(m);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_leased_from_its_front_or_not_at_all() {
        // k's first message is held by another claim (not a candidate):
        // its second (one earlier pending) is not kept, nor its third.
        let keep = keep_in_key_order([
            (None, 0),
            (Some("k"), 1),
            (Some("j"), 0),
            (Some("k"), 2),
            (Some("j"), 1),
        ]);
        assert_eq!(keep, [true, false, true, false, true]);
        // Once a key breaks, its later candidates stay out even if their
        // counts would line up.
        assert_eq!(
            keep_in_key_order([(Some("k"), 1), (Some("k"), 0)]),
            [false, false]
        );
    }
}
