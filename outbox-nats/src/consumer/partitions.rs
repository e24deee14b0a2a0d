//! Partitioned consumers: one owner per partition across processes, by
//! leases in a JetStream key-value bucket ([decisions](../../../docs/decisions.md),
//! "NATS: per-key order across consumer processes").
//!
//! - `owner.{stream}.{durable}.{partition}` holds the instance id of the process
//!   consuming that partition. It is created when absent, renewed (a
//!   compare-and-set on its revision) every `takeover_check`, and expires
//!   with the bucket's `max_age` (three checks) when its owner stops
//!   renewing. An owner that cannot renew for two checks stops consuming
//!   (fencing itself) before its lease can expire.
//! - `member.{stream}.{durable}.{replica}` shows that replica `replica` is alive;
//!   a process consuming a partition it does not own by its index hands it
//!   back as soon as the owner's member key is present.
//! - Handing back is clean: the worker stops, gives every fetched but
//!   unsettled message back to the server in stream order (`nak`), and
//!   the lease is set to [`RELEASED`]; the next owner starts at once and
//!   gets those messages first. A lease taken over because it expired (its
//!   owner died or was cut off) is not clean: unless the server shows no
//!   pull request waiting and no message unacknowledged, the next owner
//!   waits until the old owner's pull requests have expired and, if it left
//!   messages unacknowledged, until `ack_wait` has passed, so that the
//!   server delivers them again — first, in stream order — before anything
//!   later.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use outbox_api::{Error, Result};
use tokio::sync::watch;

use super::NatsConsumerBuilder;
use super::worker::{PULL_EXPIRY, Shared};

/// The value of a lease handed back cleanly.
pub(super) const RELEASED: &[u8] = b"released";

/// Checks the partition settings of `b`.
pub(super) fn validate(b: &NatsConsumerBuilder) -> Result<()> {
    let (index, replicas) = b.replica;
    outbox_api::partition::check_replica(
        index,
        replicas,
        b.partitions.is_some(),
        "NatsConsumer::partitioned",
    )?;
    let Some((filter, count)) = &b.partitions else {
        return Ok(());
    };
    outbox_api::partition::check_count("partitions", *count)?;
    if filter.split('.').any(|token| token == ">") {
        return Err(Error::config(
            "filter",
            format!(
                "`{filter}`: the partition is the subject's last token, so `>` cannot match before it; use `*` per token"
            ),
        ));
    }
    // A filter may hold `*` tokens; the rest must be literal.
    let literal: Vec<&str> = filter
        .split('.')
        .map(|t| if t == "*" { "x" } else { t })
        .collect();
    crate::subject::check(&format!("{}.0", literal.join(".")))
        .map_err(|why| Error::config("filter", format!("`{filter}`: {why}")))?;
    if b.filter_subject.is_some() {
        return Err(Error::config(
            "filter_subject",
            "a partitioned consumer filters by its partitions' subjects; give the filter to NatsConsumer::partitioned",
        ));
    }
    for (field, name) in [("durable", &b.durable), ("stream", &b.stream)] {
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(Error::config(
                field,
                format!(
                    "`{name}`: a partitioned consumer's stream and name are part of its lease keys: letters, digits, `-` and `_` only"
                ),
            ));
        }
    }
    if b.takeover_check.is_zero() {
        return Err(Error::config("takeover_check", "must be longer than zero"));
    }
    if b.ownership_bucket.is_empty()
        || !b
            .ownership_bucket
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(Error::config(
            "ownership_bucket",
            format!(
                "`{}` is not a bucket name: letters, digits, `-` and `_` only",
                b.ownership_bucket
            ),
        ));
    }
    Ok(())
}

/// The leases of one replica of a partitioned consumer.
pub(super) struct Ownership {
    kv: kv::Store,
    /// `{stream}.{durable}`: what the lease keys are about.
    scope: String,
    durable: String,
    /// This process's instance id: the value of its leases.
    me: String,
    index: u16,
    replicas: u16,
    check: Duration,
    ack_wait: Duration,
}

impl Ownership {
    /// Opens (or creates) the bucket and announces this replica.
    pub(super) async fn open(js: &jetstream::Context, b: &NatsConsumerBuilder) -> Result<Self> {
        let ttl = b.takeover_check * 3;
        let scrub = |e: &dyn std::error::Error| b.config.scrub(&e.to_string());
        let kv = match js.get_key_value(&b.ownership_bucket).await {
            Ok(kv) => kv,
            Err(_) => {
                // The bucket's stream as async-nats would make it, without
                // the account query its `create_key_value` does (whose
                // answer from a 2.9 server it cannot read).
                let stream = jetstream::stream::Config {
                    name: format!("KV_{}", b.ownership_bucket),
                    description: Some("outbox-rs partition ownership leases".to_owned()),
                    subjects: vec![format!("$KV.{}.>", b.ownership_bucket)],
                    max_messages_per_subject: 1,
                    max_age: ttl,
                    allow_rollup: true,
                    deny_delete: true,
                    allow_direct: true,
                    discard: jetstream::stream::DiscardPolicy::New,
                    ..Default::default()
                };
                js.get_or_create_stream(stream).await.map_err(|e| {
                    Error::unavailable(format!(
                        "creating the ownership bucket `{}`: {}",
                        b.ownership_bucket,
                        scrub(&e)
                    ))
                })?;
                js.get_key_value(&b.ownership_bucket).await.map_err(|e| {
                    Error::unavailable(format!(
                        "opening the ownership bucket `{}`: {}",
                        b.ownership_bucket,
                        scrub(&e)
                    ))
                })?
            }
        };
        let max_age = kv.stream.cached_info().config.max_age;
        if max_age != ttl {
            return Err(Error::config(
                "takeover_check",
                format!(
                    "the ownership bucket `{}` keeps leases for {max_age:?}, and takeover_check {:?} needs {ttl:?} (three checks): give every replica the same takeover_check, or use another ownership_bucket",
                    b.ownership_bucket, b.takeover_check
                ),
            ));
        }
        let ownership = Ownership {
            kv,
            scope: format!("{}.{}", b.stream, b.durable),
            durable: b.durable.clone(),
            me: outbox_api::MessageId::new().to_string(),
            index: b.replica.0,
            replicas: b.replica.1,
            check: b.takeover_check,
            ack_wait: b.ack_wait,
        };
        ownership
            .kv
            .put(
                ownership.member_key(ownership.index),
                ownership.me.clone().into(),
            )
            .await
            .map_err(|e| Error::unavailable(format!("announcing this replica: {}", scrub(&e))))?;
        Ok(ownership)
    }

    fn owner_key(&self, partition: u16) -> String {
        format!("owner.{}.{partition}", self.scope)
    }

    fn member_key(&self, replica: u16) -> String {
        format!("member.{}.{replica}", self.scope)
    }

    /// The replica that owns `partition` by its index.
    fn owner_of(&self, partition: u16) -> u16 {
        partition % self.replicas
    }

    /// Whether replica `replica` is alive; `None` when the bucket cannot be
    /// read.
    async fn member_present(&self, replica: u16) -> Option<bool> {
        match self
            .bounded(self.kv.entry(self.member_key(replica)))
            .await?
        {
            Ok(Some(entry)) => Some(entry.operation == kv::Operation::Put),
            Ok(None) => Some(false),
            Err(_) => None,
        }
    }

    /// Tries to take the lease of `partition`: `Some((revision, clean))`
    /// when taken, `clean` when its last owner handed it back cleanly.
    async fn try_acquire(&self, partition: u16) -> Option<(u64, bool)> {
        let key = self.owner_key(partition);
        let owner = self.owner_of(partition);
        if owner != self.index && self.member_present(owner).await != Some(false) {
            // Its owner is alive (or we cannot tell): leave it alone.
            return None;
        }
        match self.bounded(self.kv.entry(key.clone())).await? {
            Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
                if entry.value.as_ref() == RELEASED {
                    let revision = self
                        .bounded(self.kv.update(&key, self.me.clone().into(), entry.revision))
                        .await?
                        .ok()?;
                    Some((revision, true))
                } else if entry.value.as_ref() == self.me.as_bytes() {
                    // Ours from before we fenced ourselves: not clean.
                    let revision = self
                        .bounded(self.kv.update(&key, self.me.clone().into(), entry.revision))
                        .await?
                        .ok()?;
                    Some((revision, false))
                } else {
                    None
                }
            }
            // Absent (expired, or never taken) or deleted.
            Ok(_) => self
                .bounded(self.kv.create(&key, self.me.clone().into()))
                .await?
                .ok()
                .map(|revision| (revision, false)),
            Err(_) => None,
        }
    }

    /// `op`, or `None` when it takes more than half a check: a lease
    /// operation must not outlast the lease it renews.
    async fn bounded<T>(&self, op: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::time::timeout(self.check / 2, op).await.ok()
    }

    /// The tick of the lease loops: `takeover_check` ±20 %.
    fn next_check(&self) -> Duration {
        self.check.mul_f64(0.8 + fastrand::f64() * 0.4)
    }
}

/// A worker consuming one partition.
struct Running {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<bool>,
}

impl Running {
    /// Starts consuming `partition`; after an unclean takeover, only once
    /// the old owner's deliveries can no longer overtake (see the module).
    fn start(
        shared: &Shared,
        consumer: jetstream::consumer::PullConsumer,
        ack_wait: Duration,
        clean: bool,
    ) -> Running {
        let (stop, mut stopped) = watch::channel(false);
        let worker = shared.worker(stopped.clone());
        let task = tokio::spawn(async move {
            if !clean && !wait_for_old_deliveries(&consumer, ack_wait, &mut stopped).await {
                // Stopped while waiting: the old deliveries may still be
                // out there, so this is no clean hand-back.
                return false;
            }
            worker.run(consumer).await
        });
        Running { stop, task }
    }

    /// Stops the worker; `true` when it handed everything back.
    async fn stop(self) -> bool {
        self.stop.send_replace(true);
        self.task.await.unwrap_or(false)
    }
}

/// Waits until the previous owner's pull requests have expired and, if it
/// left messages unacknowledged, until `ack_wait` has passed so that the
/// server delivers them again (first, in stream order); at once when the
/// server shows neither. `false` when stopped meanwhile.
async fn wait_for_old_deliveries(
    consumer: &jetstream::consumer::PullConsumer,
    ack_wait: Duration,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let sleep = |d: Duration, stop: &mut watch::Receiver<bool>| {
        let mut stop = stop.clone();
        async move {
            let stopped = tokio::select! {
                _ = tokio::time::sleep(d) => false,
                _ = stop.wait_for(|s| *s) => true,
            };
            !stopped && !*stop.borrow()
        }
    };
    // (pull requests waiting, messages unacknowledged); cannot tell: the worst.
    let state = || async {
        consumer
            .get_info()
            .await
            .map(|i| (i.num_waiting, i.num_ack_pending))
            .unwrap_or((1, 1))
    };
    let (waiting, mut unacknowledged) = state().await;
    if waiting > 0 {
        if !sleep(PULL_EXPIRY + Duration::from_millis(200), stop).await {
            return false;
        }
        unacknowledged = state().await.1;
    }
    if unacknowledged > 0 {
        tracing::info!(
            consumer = %consumer.cached_info().name,
            unacknowledged,
            wait_ms = ack_wait.as_millis() as u64,
            "taking over a partition whose last owner left messages unacknowledged; waiting for the server to deliver them again"
        );
        return sleep(ack_wait + Duration::from_millis(200), stop).await;
    }
    true
}

/// Runs the lease loops of every partition and this replica's membership
/// until `stop`, then hands back what it owns.
pub(super) async fn run(
    shared: Shared,
    consumers: Vec<jetstream::consumer::PullConsumer>,
    ownership: Ownership,
    stop: watch::Receiver<bool>,
    owned: Arc<Mutex<BTreeSet<u16>>>,
) {
    let ownership = Arc::new(ownership);
    let shared = Arc::new(shared);
    let loops = consumers.into_iter().enumerate().map(|(i, consumer)| {
        partition_loop(
            i as u16,
            consumer,
            shared.clone(),
            ownership.clone(),
            stop.clone(),
            owned.clone(),
        )
    });
    let membership = async {
        let mut stop = stop.clone();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(ownership.next_check()) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let put = ownership.kv.put(
                ownership.member_key(ownership.index),
                ownership.me.clone().into(),
            );
            if !matches!(ownership.bounded(put).await, Some(Ok(_))) {
                tracing::debug!("renewing this replica's presence failed");
            }
        }
    };
    futures_util::future::join(membership, futures_util::future::join_all(loops)).await;
    // Gone: a standby may take this replica's partitions at once.
    let _ = ownership
        .bounded(ownership.kv.delete(ownership.member_key(ownership.index)))
        .await;
}

/// Acquires, renews, fences and hands back the lease of `partition`, and
/// runs its worker while it is held.
async fn partition_loop(
    partition: u16,
    consumer: jetstream::consumer::PullConsumer,
    shared: Arc<Shared>,
    own: Arc<Ownership>,
    mut stop: watch::Receiver<bool>,
    owned: Arc<Mutex<BTreeSet<u16>>>,
) {
    struct Lease {
        revision: u64,
        renewed: Instant,
        worker: Running,
    }
    let key = own.owner_key(partition);
    let mine = own.owner_of(partition) == own.index;
    let set = |on: bool| {
        if let Ok(mut owned) = owned.lock() {
            if on {
                owned.insert(partition);
            } else {
                owned.remove(&partition);
            }
        }
    };
    let mut lease: Option<Lease> = None;
    // Partitions of other replicas: give their owners a first chance.
    let mut wait = if mine { Duration::ZERO } else { own.check };
    loop {
        // An owner that could not renew for two checks stops consuming
        // before its lease (three checks) can expire and be taken.
        let fence = lease.as_ref().map(|l| l.renewed + own.check * 2);
        let fenced = tokio::select! {
            _ = tokio::time::sleep(wait) => false,
            _ = async {
                match fence {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => true,
            _ = stop.wait_for(|s| *s) => break,
        };
        if fenced {
            if let Some(held) = lease.take() {
                tracing::warn!(consumer = %own.durable, partition,
                    "cannot renew the lease of a partition; stopping it before the lease expires");
                held.worker.stop().await;
                set(false);
            }
            continue;
        }
        wait = own.next_check();
        let Some(mut held) = lease.take() else {
            if let Some((revision, clean)) = own.try_acquire(partition).await {
                tracing::info!(consumer = %own.durable, partition, clean, "took partition");
                if !mine {
                    outbox_api::receive::bump(&shared.counters.takeovers);
                }
                set(true);
                lease = Some(Lease {
                    revision,
                    renewed: Instant::now(),
                    worker: Running::start(&shared, consumer.clone(), own.ack_wait, clean),
                });
            }
            continue;
        };
        let asked = Instant::now();
        match own
            .bounded(own.kv.update(&key, own.me.clone().into(), held.revision))
            .await
        {
            Some(Ok(revision)) => {
                held.revision = revision;
                held.renewed = asked;
            }
            Some(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                tracing::warn!(consumer = %own.durable, partition, "lost the lease of a partition to another process; stopping it");
                held.worker.stop().await;
                set(false);
                continue;
            }
            // Not renewed this time: the fence above decides.
            Some(Err(_)) | None => {}
        }
        if !mine && own.member_present(own.owner_of(partition)).await == Some(true) {
            tracing::info!(consumer = %own.durable, partition, "the owner of a partition is back; handing it back");
            outbox_api::receive::bump(&shared.counters.handovers);
            hand_back(&own, &key, held.revision, held.worker).await;
            set(false);
            continue;
        }
        lease = Some(held);
    }
    if let Some(held) = lease {
        hand_back(&own, &key, held.revision, held.worker).await;
        set(false);
    }
}

/// Stops the worker and, when it gave everything back, marks the lease
/// [`RELEASED`] so that the next owner starts at once; otherwise deletes it,
/// so that the next owner need not wait for it to expire but still takes
/// it as unclean (see the module).
async fn hand_back(own: &Ownership, key: &str, revision: u64, worker: Running) {
    let done = if worker.stop().await {
        let release = own.kv.update(key, RELEASED.into(), revision);
        matches!(own.bounded(release).await, Some(Ok(_)))
    } else {
        let delete = own.kv.delete_expect_revision(key, Some(revision));
        matches!(own.bounded(delete).await, Some(Ok(())))
    };
    if !done {
        tracing::debug!(key, "handing a lease back failed; it expires instead");
    }
}
