//! A fleet following a catalogue of outboxes that the application names
//! (rule "Fleets" in `docs/rules.md`): outboxes that appear in it are
//! added, outboxes that disappear from it are removed.

use std::collections::BTreeSet;
use std::sync::Weak;
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::{Error, ErrorKind, Result};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::{Fleet, Inner};
use crate::RelayBuilder;

/// Where a fleet learns which outboxes exist: a table of tenants, the
/// schemas of a database that hold an outbox table
/// (`outbox_postgres::outbox_tables`), the files of a directory. The
/// fleet reads it now and then ([`Fleet::discover`]).
///
/// The contract:
/// - [`outboxes`](Self::outboxes) lists the names of the outboxes to relay
///   now. Every name must be one [`Fleet::add`] takes (non-empty, no
///   whitespace or control characters). A read that fails changes nothing:
///   the fleet keeps every outbox it has and asks again at the next reading.
///   A read that succeeds is the whole truth: an outbox the discovery added
///   and the list no longer names is removed.
/// - [`relay`](Self::relay) builds the relay of a name the list gave (its
///   store, dispatcher or transport, settings). It is asked once, when the
///   name first appears, and again at each later reading while it fails.
///   It should be cheap to fail and safe to ask again: a failure adds
///   nothing.
///
/// ```no_run
/// use std::collections::{BTreeMap, BTreeSet};
/// use std::sync::Mutex;
/// use outbox::memory::MemoryStore;
/// use outbox::{Catalogue, Error, ErrorKind, Handlers, Relay, RelayBuilder, Result};
///
/// /// The application's own register of tenants and their stores (on
/// /// PostgreSQL: a tenants table, or `outbox::postgres::outbox_tables`
/// /// filtered by a schema prefix; `relay` then builds a `PgStore` on the
/// /// fleet's shared pool).
/// struct Tenants(Mutex<BTreeMap<String, MemoryStore>>);
///
/// #[async_trait::async_trait]
/// impl Catalogue for Tenants {
///     async fn outboxes(&self) -> Result<BTreeSet<String>> {
///         Ok(self.0.lock().unwrap().keys().cloned().collect())
///     }
///
///     async fn relay(&self, tenant: &str) -> Result<RelayBuilder> {
///         let store = self.0.lock().unwrap().get(tenant).cloned().ok_or_else(|| {
///             Error::new(ErrorKind::NotFound, format!("tenant `{tenant}` is gone"))
///         })?;
///         Ok(Relay::builder(store).dispatcher(Handlers::new()))
///     }
/// }
///
/// # async fn example(tenants: Tenants) -> Result<()> {
/// let fleet = outbox::Fleet::builder().worker_id("billing-1").build()?;
/// let discovery = fleet.discover(tenants, std::time::Duration::from_secs(60))?;
/// // A tenant was just created: no need to wait for the next reading.
/// let report = discovery.refresh().await?;
/// println!("added {:?}, removed {:?}", report.added, report.removed);
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Catalogue: Send + Sync + 'static {
    /// The names of the outboxes to relay now.
    async fn outboxes(&self) -> Result<BTreeSet<String>>;

    /// The relay of the outbox `name`, which [`outboxes`](Self::outboxes)
    /// has just named and the fleet does not have.
    async fn relay(&self, name: &str) -> Result<RelayBuilder>;
}

/// A shared catalogue, so that the application keeps a handle to its
/// register while the fleet reads it.
#[async_trait]
impl<C: Catalogue + ?Sized> Catalogue for std::sync::Arc<C> {
    async fn outboxes(&self) -> Result<BTreeSet<String>> {
        (**self).outboxes().await
    }

    async fn relay(&self, name: &str) -> Result<RelayBuilder> {
        (**self).relay(name).await
    }
}

/// What one reading of a [`Catalogue`] changed in the fleet.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct DiscoveryReport {
    /// The outboxes added, in order.
    pub added: Vec<String>,
    /// The outboxes removed (ones the discovery had added that the
    /// catalogue no longer names), in order.
    pub removed: Vec<String>,
    /// The outboxes named that could not be added, with why: their relay
    /// could not be built or the fleet refused it. Tried again at the next
    /// reading.
    pub failed: Vec<(String, Error)>,
}

/// A fleet following a [`Catalogue`] ([`Fleet::discover`]). Dropping it (or
/// [`stop`](Self::stop)) stops the readings; the outboxes it added stay in
/// the fleet.
#[derive(Debug)]
pub struct Discovery {
    now: mpsc::Sender<oneshot::Sender<Result<DiscoveryReport>>>,
    task: JoinHandle<()>,
}

impl Discovery {
    /// Reads the catalogue now, rather than at the next interval, applies
    /// it and says what changed: for an application that has just created
    /// or deleted a tenant. Fails, changing nothing, if the catalogue's read
    /// fails; and if the discovery has ended because its fleet is gone.
    pub async fn refresh(&self) -> Result<DiscoveryReport> {
        let ended = || {
            Error::new(
                ErrorKind::Unavailable,
                "the discovery has ended: its fleet is gone",
            )
        };
        let (reply, report) = oneshot::channel();
        self.now.send(reply).await.map_err(|_| ended())?;
        report.await.map_err(|_| ended())?
    }

    /// Stops reading the catalogue. The outboxes it added stay in the fleet.
    pub fn stop(self) {}
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fleet {
    /// Follows `catalogue`: reads it at once and then every `every`; adds
    /// each outbox it names that the fleet does not have (with the relay
    /// [`Catalogue::relay`] builds, as [`add`](Self::add) does), and removes
    /// each outbox this discovery added that it no longer names (as
    /// [`remove`](Self::remove) does: the messages stay in the store).
    ///
    /// Outboxes added by hand are never removed by it; an outbox it added
    /// and that is removed by hand while the catalogue still names it comes
    /// back at the next reading (take it out of the catalogue instead). A
    /// failed read or a relay that cannot be built is logged (`warn`) and
    /// tried again at the next reading; nothing is removed on a failed read.
    ///
    /// Must be called within a Tokio runtime. Fails on a zero `every`. The
    /// discovery holds no reference that keeps the fleet alive: it ends
    /// when the fleet's last handle is dropped.
    pub fn discover(&self, catalogue: impl Catalogue, every: Duration) -> Result<Discovery> {
        if every.is_zero() {
            return Err(Error::config("discover every", "must be greater than zero"));
        }
        let (now, requests) = mpsc::channel(4);
        let fleet = std::sync::Arc::downgrade(&self.inner);
        let task = tokio::spawn(follow(fleet, catalogue, every, requests));
        Ok(Discovery { now, task })
    }
}

async fn follow(
    fleet: Weak<Inner>,
    catalogue: impl Catalogue,
    every: Duration,
    mut requests: mpsc::Receiver<oneshot::Sender<Result<DiscoveryReport>>>,
) {
    let mut added_here = BTreeSet::new();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let reply = tokio::select! {
            _ = ticks.tick() => None,
            request = requests.recv() => match request {
                Some(reply) => Some(reply),
                None => return,
            },
        };
        let Some(inner) = fleet.upgrade() else { return };
        let fleet = Fleet { inner };
        let outcome = read_once(&fleet, &catalogue, &mut added_here).await;
        match &outcome {
            Err(e) => {
                tracing::warn!(error = %e, "fleet discovery: reading the catalogue failed; nothing changed")
            }
            Ok(report) => {
                for (name, e) in &report.failed {
                    tracing::warn!(outbox = %name, error = %e, "fleet discovery: cannot add an outbox the catalogue names; trying again at the next reading");
                }
                if !report.added.is_empty() || !report.removed.is_empty() {
                    tracing::info!(added = ?report.added, removed = ?report.removed, "fleet discovery");
                }
            }
        }
        if let Some(reply) = reply {
            let _ = reply.send(outcome);
        }
    }
}

/// One reading: removes what this discovery added and the catalogue no
/// longer names, then adds what it names and the fleet lacks.
async fn read_once(
    fleet: &Fleet,
    catalogue: &impl Catalogue,
    added_here: &mut BTreeSet<String>,
) -> Result<DiscoveryReport> {
    let named = catalogue.outboxes().await?;
    let mut report = DiscoveryReport::default();
    let gone: Vec<String> = added_here.difference(&named).cloned().collect();
    for name in gone {
        added_here.remove(&name);
        // NotFound: removed by hand meanwhile, so nothing to do.
        if fleet.remove(&name).await.is_ok() {
            report.removed.push(name);
        }
    }
    let present: BTreeSet<String> = fleet.outboxes().into_iter().collect();
    for name in named.difference(&present) {
        let added = match catalogue.relay(name).await {
            Ok(relay) => fleet.add(name.clone(), relay).map(drop),
            Err(e) => Err(e),
        };
        match added {
            Ok(()) => {
                added_here.insert(name.clone());
                report.added.push(name.clone());
            }
            // Added by hand meanwhile: the fleet has it, and it is not ours.
            Err(e) if e.kind() == ErrorKind::Conflict && fleet.get(name).is_some() => {}
            Err(e) => report.failed.push((name.clone(), e)),
        }
    }
    Ok(report)
}
