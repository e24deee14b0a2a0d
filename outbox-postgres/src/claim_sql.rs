//! The claim statement and the floor it walks from: the one statement
//! every relay's claim runs (see [`claim_sql`]), the settings it runs
//! under, and the pieces of it the other statements of `schema.rs` share
//! (the floor's common table, the retry generation).

use sqlx::postgres::PgConnectOptions;

use crate::schema::{COLUMNS, Names};

/// The generation of the `_retries` sequence `r`: how many times it was
/// advanced.
pub(crate) const RETRIES_GENERATION: &str =
    "CASE WHEN r.is_called THEN r.last_value ELSE r.last_value - 1 END";

/// The retry-generation sequence and the `seq` column's sequence, quoted.
pub(crate) fn sequences(names: &Names) -> (String, String) {
    let (s, t) = (&names.schema, &names.outbox);
    (
        format!(r#""{s}"."{t}_retries""#),
        format!(r#""{s}"."{t}_seq_seq""#),
    )
}

/// The claim statement (`$1` worker, `$2` locked_until, `$3` now, `$4` kind
/// or NULL, `$5` limit, `$6` the floor's `seq`, `$7` the retry generation
/// it holds under). It runs in a transaction of its own (opened by
/// `begin_claim`) beside any number of other claims, completions,
/// failures and releases: it takes no lock but the rows it leases.
///
/// It walks the pending index from the floor (src/floor.rs) — from the
/// start when the retry generation moved since the floor was set — so a
/// long transaction that keeps vacuum from removing completed messages'
/// index entries does not make every claim step over all of them.
///
/// A message is claimable when it is pending, available, its lease is free
/// or expired, its kind matches, and no other message of its key stands in
/// its way:
/// * no earlier one (by `seq`) that is not processed and not claimable now
///   (those that are come first in `seq` order and are claimed by this same
///   statement) — one step of the key index per earlier message, and
///   claims take a key's messages from its front, so few;
/// * and the next later one that is not processed holds no live lease. A
///   key's leases cover a run of its messages from the front, so that one
///   step stands for the whole run. With the per-key enqueue lock no
///   message commits behind a leased one of its key; this guards rows
///   written past it (raw SQL), at the cost of one index step, where
///   looking at every later message would cost the key's whole backlog.
///
/// `FOR UPDATE SKIP LOCKED` keeps the claim from waiting on rows another
/// claim or a completion is writing, and re-checks each row it locks on
/// the row's newest version. The snapshot the tests above judge earlier
/// messages by may be older than another claim running beside this one:
/// that claim may hold (or have just leased) a key's first message, which
/// this statement then skips while its snapshot still shows it claimable.
/// So a keyed message is leased only if **every** earlier pending message
/// of its key is among the rows this statement locked (the final `NOT
/// EXISTS`): a key's messages are leased by one claim, from the front, or
/// not at all (docs/decisions.md, "PostgreSQL: claims run side by side").
/// The outer `WHERE` repeats the lease condition.
///
/// The `UPDATE` finds its rows by `seq = ANY(ARRAY(…picked…))`, an index
/// lookup per picked row whatever the statistics say, not by a join with
/// `picked`: the claim runs a generic plan, made once per connection
/// (see `begin_claim` in `schema.rs`), and a join planned while the table
/// was empty and never analysed walked the whole pending index for every
/// picked row once it had filled (docs/decisions.md, "the claim's plan is
/// generic").
///
/// The earlier-message tests say "pending" as `state NOT IN ('processed',
/// 'poisoned')` (the same, by the table's CHECK): that implies the key
/// index's predicate but not the pending index's, so they can only look a
/// key up. Written `state = 'pending'`, a table without statistics (one
/// that grew in seconds) let the planner walk the pending index from the
/// floor up to each candidate instead, filtering by key: work in
/// proportion to the backlog for every candidate, claims of 200 taking
/// 13–42 s under a backlog of a few thousand in MiniShop
/// (docs/decisions.md, "the claim's plan is pinned").
///
/// `no_flush` (a condition, true) ends the `UPDATE`'s test: it makes the
/// claim commit without waiting for a WAL flush when it runs as its own
/// transaction (on a connection with the claim's settings for its session,
/// [`claims_in_session`]), as its transaction's `SET LOCAL` does
/// otherwise.
pub(crate) fn claim_sql(names: &Names, no_flush: &str) -> String {
    let t = format!(r#""{}"."{}""#, names.schema, names.outbox);
    format!(
        "WITH {floor},
         picked AS (
           SELECT m.seq, m.key FROM {t} AS m
           WHERE m.state = 'pending'
             AND m.seq >= (SELECT seq FROM floor)
             AND m.available_at <= $3
             AND (m.locked_until IS NULL OR m.locked_until <= $3)
             AND ($4::text IS NULL OR m.kind = $4)
             AND (m.key IS NULL OR (
               NOT EXISTS (
                 SELECT 1 FROM {t} AS b
                 WHERE b.key = m.key AND b.seq < m.seq AND b.seq >= (SELECT seq FROM floor)
                   AND b.state NOT IN ('processed', 'poisoned')
                   AND (b.available_at > $3
                        OR b.locked_until > $3
                        OR ($4::text IS NOT NULL AND b.kind <> $4)))
               AND NOT EXISTS (
                 SELECT 1 FROM {t} AS p
                 WHERE p.key = m.key AND p.seq < m.seq AND p.state = 'poisoned')
               AND NOT COALESCE((
                 SELECT a.locked_until > $3 FROM {t} AS a
                 WHERE a.key = m.key AND a.seq > m.seq AND a.state <> 'processed'
                 ORDER BY a.seq LIMIT 1), false)))
           ORDER BY m.seq
           LIMIT $5
           FOR UPDATE OF m SKIP LOCKED)
         UPDATE {t} AS u SET locked_by = $1, locked_until = $2
         WHERE u.seq = ANY(ARRAY(SELECT seq FROM picked)) AND u.state = 'pending'
           AND (u.locked_until IS NULL OR u.locked_until <= $3)
           AND (u.key IS NULL OR NOT EXISTS (
             SELECT 1 FROM {t} AS e
             WHERE e.key = u.key AND e.seq < u.seq
               AND e.seq >= (SELECT seq FROM floor)
               AND e.state NOT IN ('processed', 'poisoned')
               AND e.seq NOT IN (SELECT seq FROM picked)))
           AND {no_flush}
         RETURNING {}",
        COLUMNS
            .split(", ")
            .map(|c| format!("u.{c}"))
            .collect::<Vec<_>>()
            .join(", "),
        floor = floor_cte(names, 6)
    )
}

/// The common table `floor` (one row, column `seq`): the claim's floor
/// bound at `$n` while the retry generation is the one bound at `$n+1`,
/// else 0 (src/floor.rs).
pub(crate) fn floor_cte(names: &Names, n: usize) -> String {
    let (retries, _) = sequences(names);
    format!(
        "floor AS MATERIALIZED (
           SELECT CASE WHEN {RETRIES_GENERATION} = ${} THEN ${n}::int8 ELSE 0 END AS seq
           FROM {retries} AS r)",
        n + 1
    )
}

/// The settings every claim runs under (see `begin_claim` in `Sql::new`,
/// `schema.rs`, for why each). A claim on a connection that has them for its whole
/// session ([`claims_in_session`]) runs as one statement, its own
/// transaction, instead of three round trips.
pub(crate) const CLAIM_SETTINGS: [(&str, &str); 6] = [
    ("lock_timeout", "10s"),
    ("enable_sort", "off"),
    ("enable_bitmapscan", "off"),
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
    ("jit", "off"),
];

/// `options` with [`CLAIM_SETTINGS`] for the whole session of each
/// connection (startup options, after any the options had).
pub(crate) fn with_claim_settings(options: PgConnectOptions) -> PgConnectOptions {
    options.options(CLAIM_SETTINGS)
}

/// Whether connections made with `options` run under [`CLAIM_SETTINGS`] for
/// their whole session: the last startup options they carry are those of
/// [`with_claim_settings`], so none given later overrides them.
pub(crate) fn claims_in_session(options: &PgConnectOptions) -> bool {
    let ours = with_claim_settings(PgConnectOptions::new_without_pgpass());
    match (options.get_options(), ours.get_options()) {
        (Some(given), Some(ours)) => given.ends_with(ours),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_run_in_session_only_when_the_claim_settings_come_last() {
        let bare = PgConnectOptions::new_without_pgpass();
        assert!(!claims_in_session(&bare), "no startup options");
        assert!(claims_in_session(&with_claim_settings(bare.clone())));
        let after_others = with_claim_settings(bare.clone().options([("geqo", "off")]));
        assert!(claims_in_session(&after_others), "other options before");
        let overridden = with_claim_settings(bare).options([("plan_cache_mode", "auto")]);
        assert!(!claims_in_session(&overridden), "a later option overrides");
    }
}
