//! The scheduler's claim-again decision when two rounds overlap (the
//! end-to-end scheduling tests are in `relay/tests.rs`).

use outbox_api::Handlers;
use outbox_memory::MemoryStore;

use super::*;

/// A round that ended: `claimed` if it carried a claim.
fn ended(claimed: Option<Vec<Message>>) -> Round {
    Round {
        report: DrainReport::default(),
        claimed,
        error: None,
    }
}

/// A plan begun now: a claim of `claim_limit` (0: none), recording
/// something that frees a message if `frees`.
fn plan(s: &Scheduler<'_>, claim_limit: usize, frees: bool) -> Plan {
    Plan {
        claim_limit,
        lease_until: (claim_limit > 0).then(|| s.relay.now()),
        frees,
        changes_at_claim: s.changes,
    }
}

#[tokio::test]
async fn a_short_claim_is_not_taken_for_nothing_more_when_a_freeing_round_ended_while_it_ran() {
    let relay = Relay::builder(MemoryStore::new())
        .dispatcher(Handlers::new())
        .batch_size(2)
        .build()
        .unwrap();
    let mut s = Scheduler::new(&relay, Mode::Drain, None);

    // A claim goes out beside a round recording a failure (say); the
    // failure is recorded and its round ends, then the claim comes back
    // short: it may have looked before the failed message was free.
    let (claim, record) = (plan(&s, 2, false), plan(&s, 0, true));
    s.coming = 2;
    s.round_done(ended(None), record);
    s.round_done(ended(Some(Vec::new())), claim);
    assert!(!s.exhausted, "a short claim beside a freeing round");
    assert!(s.wants_claim(), "so it claims again at once");

    // A short claim that began after the freeing round ended saw what
    // it freed: nothing more to claim until something changes.
    let claim = plan(&s, 2, false);
    s.coming = 2;
    s.round_done(ended(Some(Vec::new())), claim);
    assert!(s.exhausted, "a short claim with nothing beside it");
    assert!(!s.wants_claim(), "it waits for a commit");

    // Beside a round that only records completions of unkeyed
    // messages (which free nothing), a short claim is the end.
    s.exhausted = false;
    let (claim, record) = (plan(&s, 2, false), plan(&s, 0, false));
    s.coming = 2;
    s.round_done(ended(None), record);
    s.round_done(ended(Some(Vec::new())), claim);
    assert!(s.exhausted, "completions of unkeyed messages free nothing");
}
