//! Continuous scheduling (rule "Scheduling" in `docs/rules.md`).
//!
//! Up to `concurrency` deliveries are in flight; more are claimed as slots
//! free up, so a slow handler holds one slot, never the relay. Claimed
//! messages wait in `ready` in claim (commit) order. A key's message starts
//! only when no earlier message of its key is in flight, and the key's
//! later messages are given back untouched as soon as one of its messages
//! does not get through, so a key's messages are delivered in order. A
//! delivery starts only if it can end, within `handler_timeout`, before its
//! lease does. Integration messages that are ready together go out in one
//! transport send, several sends in flight at once (a continuous window).
//! Outcomes are recorded in small groups: a store round records whatever
//! finished since the last, and the next claim rides along. In a backlog,
//! while one round is in flight a second may start if it claims, so that
//! the next batch is on its way while this one is delivered.

use std::collections::{HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{Future, FutureExt, StreamExt};
use outbox_api::{ClaimRequest, Message, MessageKind, Result, Timestamp, WorkListener};

use super::budget::Slot;
use super::deliver::DeliveryOutcome;
use super::meter::TypeMeter;
use super::settle::{Round, Settlement};
use super::{DrainReport, Relay};

/// How long the scheduler goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Until nothing is claimable and everything claimed is settled.
    Drain,
    /// One claim, delivered and settled.
    OneBatch,
}

/// A claimed message waiting for a slot, and when its lease ends.
struct Ready {
    message: Message,
    lease_until: Timestamp,
}

/// Store rounds in flight at most: one recording and claiming while the
/// next claim is already on its way (rule "Scheduling").
const ROUNDS_IN_FLIGHT: usize = 2;

/// What a store round was started with, for when it ends.
struct Plan {
    /// The most messages its claim may bring, if it claims.
    claim_limit: usize,
    /// When the leases its claim asks for end, if it claims.
    lease_until: Option<Timestamp>,
    /// It records something that may make a message claimable
    /// (`Settlement::frees`).
    frees: bool,
    /// `changes` when its claim began: a commit announced or a record that
    /// frees a message ended after that may have been too late for the
    /// claim to see.
    changes_at_claim: u64,
}

/// What the scheduler waited for.
enum Event {
    Finished(Done),
    Round((Round, Plan)),
    Commit(bool),
    /// The fleet's slot this relay waited for.
    Slot(Slot),
    Nothing,
}

/// What one delivery (a handler run, or a send of several messages) ended
/// in, and how long it took.
type Done = (Vec<(Message, DeliveryOutcome)>, Duration);
type Delivery = Pin<Box<dyn Future<Output = Done> + Send>>;
type StoreRound = Pin<Box<dyn Future<Output = (Round, Plan)> + Send>>;
type SlotWait = Pin<Box<dyn Future<Output = Slot> + Send>>;

pub(super) struct Scheduler<'a> {
    relay: &'a Relay,
    mode: Mode,
    listener: Option<&'a mut Box<dyn WorkListener>>,
    ready: VecDeque<Ready>,
    /// Keys with a delivery in flight.
    busy_keys: HashSet<String>,
    deliveries: FuturesUnordered<Delivery>,
    /// Messages in flight (a send of n messages holds n slots).
    slots_used: usize,
    /// In a fleet: this relay's place in the queue for its next turn of
    /// the fleet's slots (one place at most, so the fleet's slots go round
    /// its members), and what it was handed of a turn and has not used yet.
    slot_wait: Option<SlotWait>,
    granted: Option<Slot>,
    /// Outcomes not yet handed to a store round.
    pending: Settlement,
    /// Store rounds in flight (`ROUNDS_IN_FLIGHT` at most).
    rounds: FuturesUnordered<StoreRound>,
    /// The most messages the claims in flight may bring.
    coming: usize,
    /// The last claim found less than it asked for: claim again only when
    /// a settle may have unblocked something or a commit was announced.
    exhausted: bool,
    /// The last claim came back full: a backlog, so the next claim goes
    /// out before its batch is delivered, beside a round in flight.
    backlog: bool,
    /// Commits announced by the store's listener, and ended rounds that
    /// recorded something that may make a message claimable, so far.
    changes: u64,
    /// Store rounds that carried a claim.
    claim_rounds: usize,
    claimed: usize,
    report: DrainReport,
    error: Option<outbox_api::Error>,
    /// The metrics handles of the message types met in this drain (a few:
    /// looked up without the relay-wide map's lock).
    meters: Vec<Arc<TypeMeter>>,
}

impl<'a> Scheduler<'a> {
    pub(super) fn new(
        relay: &'a Relay,
        mode: Mode,
        listener: Option<&'a mut Box<dyn WorkListener>>,
    ) -> Self {
        Scheduler {
            relay,
            mode,
            listener,
            ready: VecDeque::new(),
            busy_keys: HashSet::new(),
            deliveries: FuturesUnordered::new(),
            slots_used: 0,
            slot_wait: None,
            granted: None,
            pending: Settlement::default(),
            rounds: FuturesUnordered::new(),
            coming: 0,
            exhausted: false,
            backlog: false,
            changes: 0,
            claim_rounds: 0,
            claimed: 0,
            report: DrainReport::default(),
            error: None,
            meters: Vec::new(),
        }
    }

    /// Messages claimed so far.
    pub(super) fn claimed(&self) -> usize {
        self.claimed
    }

    pub(super) async fn run(&mut self) -> Result<DrainReport> {
        loop {
            if self.relay.stopping() || self.error.is_some() {
                self.give_back_ready();
            }
            // In a backlog the next batch's claim goes out before this one
            // is delivered, beside the round in flight if there is one.
            if self.backlog && !self.ready.is_empty() {
                self.start_round();
            }
            self.start_ready();
            // Deliveries that end at once (quick in-process handlers) are
            // taken in now, so that their completion rides with the next
            // claim instead of a claim going out alone before them.
            while self.take_finished_at_once() {
                self.start_ready();
            }
            if self.ready.is_empty() {
                // Nothing waits for a slot: give the place (and a slot
                // handed over unused) to the fleet's other members.
                self.slot_wait = None;
                self.granted = None;
            }
            self.start_round();
            if self.rounds.is_empty() && self.deliveries.is_empty() && self.ready.is_empty() {
                break;
            }
            // Listen while a round is in flight too: a commit announced
            // meanwhile makes the next claim worth making.
            let listen = self.exhausted
                && self.mode == Mode::Drain
                && !self.relay.stopping()
                && self.listener.is_some();
            match self.next_event(listen).await {
                Event::Finished(done) => {
                    let now = self.relay.now();
                    self.finished_all(done, now);
                    // Take in whatever else finished meanwhile, so the next
                    // store round records it too.
                    self.take_finished_at_once();
                }
                Event::Round((round, plan)) => self.round_done(round, plan),
                Event::Commit(changed) => {
                    // A commit, or a poll interval gone by (retries and
                    // expired leases come due without a commit): claim again.
                    if changed {
                        self.changes += 1;
                    }
                    self.exhausted = false;
                }
                Event::Slot(slot) => {
                    self.slot_wait = None;
                    self.granted = Some(slot);
                }
                Event::Nothing => {
                    self.give_back_ready();
                    if self.pending.is_empty() {
                        break;
                    }
                }
            }
        }
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(self.report),
        }
    }

    /// Takes in every delivery that has ended or ends when polled once;
    /// returns whether there was any.
    fn take_finished_at_once(&mut self) -> bool {
        let mut now = None;
        while let Some(Some(done)) = self.deliveries.next().now_or_never() {
            // One clock reading for all that ended at once.
            let at = *now.get_or_insert_with(|| self.relay.now());
            self.finished_all(done, at);
        }
        now.is_some()
    }

    /// Waits for a delivery to end, a store round to end, or (with
    /// `listen`) a commit announced by the store: while work is in flight, a
    /// commit makes the next claim worth making.
    async fn next_event(&mut self, listen: bool) -> Event {
        let poll_interval = self.relay.inner.config.poll_interval;
        let has_deliveries = !self.deliveries.is_empty();
        let has_round = !self.rounds.is_empty();
        let has_slot_wait = self.slot_wait.is_some();
        let deliveries = &mut self.deliveries;
        let rounds = &mut self.rounds;
        let listener = &mut self.listener;
        let slot_wait = &mut self.slot_wait;
        tokio::select! {
            Some(done) = deliveries.next(), if has_deliveries => Event::Finished(done),
            Some(done) = rounds.next(), if has_round => Event::Round(done),
            slot = async { slot_wait.as_mut().expect("guarded").await }, if has_slot_wait => Event::Slot(slot),
            changed = async { listener.as_mut().expect("guarded").wait(poll_interval).await }, if listen => Event::Commit(changed),
            else => Event::Nothing,
        }
    }

    fn config(&self) -> &crate::RelayConfig {
        &self.relay.inner.config
    }

    /// Whether a claim is worth making now.
    fn wants_claim(&self) -> bool {
        let cfg = self.config();
        if self.relay.stopping() || self.error.is_some() {
            return false;
        }
        if self.mode == Mode::OneBatch && self.claim_rounds > 0 {
            return false;
        }
        // At most one batch waits for slots beyond those in flight, and two
        // batches wait or are on their way.
        let waiting = self.ready.len() + self.coming;
        let room = waiting < 2 * cfg.batch_size
            && self.slots_used + waiting < cfg.concurrency + cfg.batch_size;
        // Completions of keyed messages and releases may unblock a key's
        // later messages; an unkeyed completion unblocks nothing, so after
        // a short claim it waits for a commit to be announced instead of
        // claiming again (a quiet outbox's message costs a claim and a
        // completion, not a second, empty claim).
        let unblocked = self.pending.keyed_done || !self.pending.untouched.is_empty();
        room && (!self.exhausted || unblocked)
    }

    /// The claim for what this relay can deliver now, if anything.
    fn claim_request(&self, now: Timestamp) -> Option<ClaimRequest> {
        let inner = &self.relay.inner;
        let transport_up = inner.transport.is_some() && inner.gate.is_up();
        let kind = match (inner.dispatcher.is_some(), transport_up) {
            (true, true) => None,
            (true, false) => Some(MessageKind::Domain),
            (false, true) => Some(MessageKind::Integration),
            (false, false) => return None,
        };
        let cfg = self.config();
        Some(
            ClaimRequest::new(cfg.worker_id.clone(), cfg.batch_size, cfg.lease, now)
                .with_kind(kind),
        )
    }

    /// Starts a store round if there is anything to record or claim: with
    /// no round in flight, for either; beside one, only in a backlog and
    /// only to claim (what it has to record rides along), so that the next
    /// batch is on its way while this one is delivered. Completions that
    /// could wait for the round in flight cost no round of their own, and
    /// claims that would find a few messages each (a busy outbox without a
    /// backlog) still ride with the completions.
    fn start_round(&mut self) {
        if self.rounds.len() >= ROUNDS_IN_FLIGHT || (!self.rounds.is_empty() && !self.backlog) {
            return;
        }
        let now = self.relay.now();
        let claim = if self.wants_claim() {
            let request = self.claim_request(now);
            if request.is_none() {
                // Nothing this relay can deliver now (no transport up and
                // no dispatcher): as good as an empty claim.
                self.exhausted = true;
            }
            request
        } else {
            None
        };
        if claim.is_none() && (self.pending.is_empty() || !self.rounds.is_empty()) {
            return;
        }
        let plan = Plan {
            claim_limit: claim.as_ref().map_or(0, |c| c.limit),
            lease_until: claim.as_ref().map(|c| now.saturating_add(c.lease)),
            frees: self.pending.frees(),
            changes_at_claim: self.changes,
        };
        if claim.is_some() {
            self.claim_rounds += 1;
        }
        self.coming += plan.claim_limit;
        let settlement = std::mem::take(&mut self.pending);
        let relay = self.relay.clone();
        self.rounds.push(Box::pin(async move {
            (relay.settle_and_claim(settlement, claim).await, plan)
        }));
    }

    fn round_done(&mut self, round: Round, plan: Plan) {
        self.report.add(round.report);
        self.coming -= plan.claim_limit;
        match round.claimed {
            Some(messages) => {
                self.relay.inner.meter.claimed(messages.len());
                // A commit announced, or a message freed by another round,
                // while the claim ran may not be in it.
                self.exhausted =
                    messages.len() < plan.claim_limit && self.changes == plan.changes_at_claim;
                self.backlog = messages.len() == plan.claim_limit;
                self.claimed += messages.len();
                let lease_until = plan.lease_until.expect("a claim has a lease");
                self.ready.extend(messages.into_iter().map(|message| Ready {
                    message,
                    lease_until,
                }));
            }
            // Only records: what they unblock is claimed next round
            // (unkeyed completions unblock nothing).
            None if round.error.is_none() && plan.frees => {
                self.exhausted = false;
            }
            None => {}
        }
        if plan.frees {
            // A claim beside this round may not have seen what it freed.
            self.changes += 1;
        }
        if let Some(e) = round.error {
            self.error.get_or_insert(e);
        }
    }

    /// Starts what can start: in claim order, while slots are free; skips
    /// keys with a delivery in flight; gives back what may not start.
    fn start_ready(&mut self) {
        let concurrency = self.config().concurrency;
        if self.ready.is_empty() || self.slots_used >= concurrency {
            return;
        }
        let timeout = self.config().handler_timeout;
        let now = self.relay.now();
        let transport_up = self.relay.inner.gate.is_up();
        let mut group: Vec<Message> = Vec::new();
        let mut group_slots: Vec<Slot> = Vec::new();
        let group_max = send_group_size(concurrency);
        let mut i = 0;
        while i < self.ready.len() && self.slots_used + group.len() < concurrency {
            let entry = &self.ready[i];
            let key = entry.message.key.as_deref();
            if let Some(k) = key {
                if self.busy_keys.contains(k) {
                    i += 1;
                    continue;
                }
            }
            let integration = entry.message.kind == MessageKind::Integration;
            let lease_holds = now.saturating_add(timeout) <= entry.lease_until;
            if !lease_holds || (integration && !transport_up) {
                // It cannot start on this claim: back, with its key's rest.
                let entry = self.ready.remove(i).expect("in range");
                if !lease_holds {
                    tracing::debug!(message.id = %entry.message.id, "lease too short to start; giving it back");
                }
                self.give_back_key(entry.message.key.clone());
                self.pending.untouched.push(entry.message.id);
                continue;
            }
            let Some(slot) = self.fleet_slot(self.ready.len() - i) else {
                // The fleet has no slot free: this relay waits its turn.
                break;
            };
            let entry = self.ready.remove(i).expect("in range");
            if let Some(k) = &entry.message.key {
                self.busy_keys.insert(k.clone());
            }
            if integration {
                group.push(entry.message);
                group_slots.extend(slot);
                if group.len() >= group_max {
                    let slots = std::mem::take(&mut group_slots);
                    self.start_send(std::mem::take(&mut group), slots);
                }
            } else {
                self.start_dispatch(entry.message, slot);
            }
        }
        if !group.is_empty() {
            self.start_send(group, group_slots);
        }
        // What is left of a turn (its messages' keys are busy) goes back to
        // the fleet's other members.
        self.granted = None;
    }

    /// A slot of the fleet's for one more delivery, of the `wanted` this
    /// relay could start now: `Some(None)` outside a fleet; `None` when the
    /// fleet has none free now, and then this relay takes (or keeps) its
    /// place in the queue for its next turn, of up to its weight in slots.
    fn fleet_slot(&mut self, wanted: usize) -> Option<Option<Slot>> {
        let Some(member) = &self.relay.inner.fleet else {
            return Some(None);
        };
        if let Some(turn) = &mut self.granted {
            if turn.num_permits() > 1 {
                return Some(turn.split(1));
            }
            return Some(self.granted.take());
        }
        if self.slot_wait.is_none() {
            if let Some(slot) = member.budget().try_take() {
                return Some(Some(slot));
            }
            let turn = member.turn().min(wanted);
            self.slot_wait = Some(Box::pin(member.budget().wait(turn)));
        }
        None
    }

    fn start_dispatch(&mut self, m: Message, slot: Option<Slot>) {
        self.slots_used += 1;
        let relay = self.relay.clone();
        self.deliveries.push(Box::pin(async move {
            // The fleet's slot is given back when the delivery ends.
            let _slot = slot;
            let started = Instant::now();
            let outcome = relay.dispatch_one(&m).await;
            (vec![(m, outcome)], started.elapsed())
        }));
    }

    fn start_send(&mut self, group: Vec<Message>, slots: Vec<Slot>) {
        self.slots_used += group.len();
        let relay = self.relay.clone();
        self.deliveries.push(Box::pin(async move {
            let _slots = slots;
            let started = Instant::now();
            let outcomes = relay.send(&group).await;
            (group.into_iter().zip(outcomes).collect(), started.elapsed())
        }));
    }

    /// A delivery ended (at `now`, for the lag metric).
    fn finished_all(&mut self, (results, took): Done, now: Timestamp) {
        // One duration per operation: a handler run, or a send (once per
        // message type it carried).
        let mut timed: Vec<usize> = Vec::new();
        for (m, outcome) in results {
            let i = self.meter_index(&m);
            if !timed.contains(&i) {
                timed.push(i);
                self.meters[i].duration.record(took.as_secs_f64());
            }
            self.meter(i, &m, &outcome, now);
            self.finished(m, outcome);
        }
    }

    /// The position in `meters` of the handles of `m`'s kind and type.
    fn meter_index(&mut self, m: &Message) -> usize {
        match self.meters.iter().position(|t| t.is(m)) {
            Some(i) => i,
            None => {
                self.meters.push(self.relay.inner.meter.of(m));
                self.meters.len() - 1
            }
        }
    }

    /// Records one message's delivery outcome in the metrics, and on
    /// delivery the lag since its commit.
    fn meter(&self, i: usize, m: &Message, outcome: &DeliveryOutcome, now: Timestamp) {
        let t = &self.meters[i];
        match outcome {
            DeliveryOutcome::Delivered => {
                t.delivered.increment(1);
                t.lag.record(now.since(m.created_at).as_secs_f64());
            }
            DeliveryOutcome::Failed(_) => t.failed.increment(1),
            DeliveryOutcome::Rejected(_) => {
                t.failed.increment(1);
                t.rejected.increment(1);
            }
            DeliveryOutcome::HandlerUnavailable { .. } => t.released_unavailable.increment(1),
            DeliveryOutcome::TransportUnavailable(_) => t.released_outage.increment(1),
        }
    }

    /// One message's delivery ended.
    fn finished(&mut self, m: Message, outcome: DeliveryOutcome) {
        self.slots_used -= 1;
        if let Some(k) = &m.key {
            self.busy_keys.remove(k);
        }
        if !matches!(outcome, DeliveryOutcome::Delivered) {
            // The key's later messages must not overtake this one.
            self.give_back_key(m.key.clone());
        }
        match outcome {
            DeliveryOutcome::Delivered => {
                if m.kind == MessageKind::Domain
                    && self.relay.inner.unavailable.available(&m.message_type)
                {
                    tracing::info!(message.type = %m.message_type, "handler is available again");
                }
                self.pending.keyed_done |= m.key.is_some();
                self.pending.done.push(m.id);
            }
            DeliveryOutcome::Failed(error) | DeliveryOutcome::Rejected(error) => {
                self.pending.failed.push((m, error))
            }
            DeliveryOutcome::HandlerUnavailable {
                reason,
                retry_after,
            } => {
                let now = self.relay.now();
                let until =
                    self.relay
                        .inner
                        .unavailable
                        .defer(&m.message_type, &reason, retry_after, now);
                tracing::warn!(message.id = %m.id, message.type = %m.message_type, %reason, "handler temporarily unavailable; tried again later, not counted");
                let error = format!("handler temporarily unavailable (not counted): {reason}");
                self.pending.deferred.push((m.id, error, until));
            }
            DeliveryOutcome::TransportUnavailable(reason) => {
                self.relay.transport_went_down(reason.clone());
                self.pending.outage.push(m.id);
                self.pending.outage_reason = Some(reason);
                // What waits for the broker waits for the probe instead.
                self.give_back_integration();
            }
        }
    }

    /// Gives back, untouched, every waiting message of `key`.
    fn give_back_key(&mut self, key: Option<String>) {
        let Some(key) = key else { return };
        let pending = &mut self.pending;
        self.ready.retain(|r| {
            let same = r.message.key.as_deref() == Some(key.as_str());
            if same {
                pending.untouched.push(r.message.id);
            }
            !same
        });
    }

    /// Gives back every waiting integration message (the broker is down),
    /// with the later messages of their keys.
    fn give_back_integration(&mut self) {
        let keys: HashSet<String> = self
            .ready
            .iter()
            .filter(|r| r.message.kind == MessageKind::Integration)
            .filter_map(|r| r.message.key.clone())
            .collect();
        let pending = &mut self.pending;
        self.ready.retain(|r| {
            let back = r.message.kind == MessageKind::Integration
                || r.message.key.as_ref().is_some_and(|k| keys.contains(k));
            if back {
                pending.untouched.push(r.message.id);
            }
            !back
        });
    }

    /// Gives back everything waiting (shutdown, or the store failed).
    fn give_back_ready(&mut self) {
        let pending = &mut self.pending;
        pending
            .untouched
            .extend(self.ready.drain(..).map(|r| r.message.id));
    }
}

/// Messages per transport send: a quarter of the window, so that while
/// some sends wait for their confirms others go out, and the window stays
/// full (a continuous window rather than send-a-batch-then-wait).
pub(super) fn send_group_size(concurrency: usize) -> usize {
    concurrency.div_ceil(4).max(1)
}

#[cfg(test)]
mod tests;
