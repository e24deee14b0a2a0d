//! The lock an enqueuing transaction holds on its own id until it ends,
//! taken by the insert statements (`schema.rs`) and waited for by the
//! commit watcher (`announce.rs`), which so learns of a commit as it
//! happens.

/// The class (first key) of the advisory lock every enqueuing transaction
/// takes on its own id ([`OWN_LOCK`]), the same for every outbox table.
macro_rules! own_lock_class {
    () => {
        "1868723320"
    };
}

/// The lock an enqueuing transaction holds on itself until it ends: an
/// advisory lock (class `own_lock_class!()`, key the low 31 bits of its
/// id), taken with its id before its first row. The commit watcher waits
/// for it ([`WAIT_LOOK`]) and so learns of the commit as it happens,
/// without asking again and again. No two live transactions share it
/// (their ids would have to be 2³¹ apart), so writers never wait for each
/// other on it. Only this crate's enqueues take locks of this class.
const OWN_LOCK: &str = concat!(
    "pg_advisory_xact_lock(",
    own_lock_class!(),
    ", (pg_current_xact_id()::text::int8 % 2147483648)::int4)"
);

/// The commit watcher's look that first waits for one transaction to end
/// (src/announce.rs): `$4` its [`own_lock_key`], `$5` how long to wait
/// (a `lock_timeout`; past it the statement fails with `55P03` and the
/// watcher asks as before), `$6` its id; then as
/// [`LOOK`](crate::announce::LOOK) (`$1` to `$3`), except that when the
/// transaction held its lock as the statement began (`held`), its status
/// is taken as the commit log gives it. The snapshot of this statement was
/// taken before the wait and still lists it as running, but a transaction
/// gives up its locks only after it has left the list of running ones, so
/// a relay woken now sees its messages. A lock that was not held (a
/// savepoint rolled back, an older release's enqueue) proves nothing: that
/// transaction is judged by the snapshot.
pub(crate) const WAIT_LOOK: &str = concat!(
    "WITH w AS MATERIALIZED (
       SELECT held, pg_advisory_xact_lock_shared(",
    own_lock_class!(),
    ", $4::int4) AS waited
       FROM (SELECT set_config('lock_timeout', $5, true) AS timeout,
                    NOT pg_try_advisory_xact_lock_shared(",
    own_lock_class!(),
    ", $4::int4) AS held) AS t),
     s AS MATERIALIZED (
       SELECT x, ch, tok, CASE
         WHEN st = 'committed' AND NOT (x = $6 AND l.held)
          AND NOT pg_visible_in_snapshot(x::xid8, pg_current_snapshot())
         THEN 'in progress' ELSE st END AS status
       FROM unnest($1::text[], $2::text[], $3::text[]) AS u(x, ch, tok),
            LATERAL (SELECT pg_xact_status(x::xid8) AS st, held FROM w) AS l),",
    crate::announce::notify_committed!()
);

/// The column that takes [`OWN_LOCK`] in an insert's first step, or
/// nothing.
pub(crate) fn own_lock_column(take: bool) -> String {
    if take {
        format!(", {OWN_LOCK} AS own_lock")
    } else {
        String::new()
    }
}

/// The key of [`OWN_LOCK`] for transaction `xid`.
pub(crate) fn own_lock_key(xid: u64) -> i32 {
    (xid % (1 << 31)) as i32
}
