//! [`PgSharedListener`]: one `LISTEN` connection for the outboxes of many
//! schemas (or tables) of one database, such as a fleet's tenants. Each
//! store built with it hears its own table's channel only, so a commit
//! wakes exactly its outbox's relay.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::announce::{Watcher, lock};

/// How long the listener waits before connecting again after a failure,
/// at first and at most.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// One `LISTEN` connection shared by every [`PgStore`](crate::PgStore)
/// built with it ([`PgStoreBuilder::listen_through`](crate::PgStoreBuilder::listen_through)):
/// a fleet of a thousand tenant schemas holds one connection for its
/// wake-ups instead of a thousand. A notification on a table's channel
/// wakes the listeners of that table only.
///
/// The connection is opened with the options of the pool given to
/// [`new`](Self::new), beside that pool (never taken from it), when the
/// first relay listens, and closed when the last clone of this handle and
/// the last store built with it are gone. A channel is listened to while
/// some relay listens on it; when the connection breaks, every relay
/// listening through it is told (to claim once and catch up) and polls
/// until the connection is back, as with a connection of its own
/// ([`PgWorkListener`](crate::PgWorkListener)). The connection's task runs
/// on the runtime of the relay that first listened; if that runtime shuts
/// down, the next relay that listens or waits starts it again on its own.
///
/// The stores built with it also share one commit watcher (the task that
/// learns when an enqueuing transaction has committed, wakes the relays
/// and sends the `NOTIFY` after it): it holds a second connection, opened
/// with the same options when one of them first enqueues, and looks at
/// all their open transactions in one statement, so that the stores' own
/// pools serve their relays only. A fleet so holds two connections
/// beside its stores' pools.
#[derive(Clone)]
pub struct PgSharedListener {
    inner: Arc<Inner>,
}

struct Inner {
    options: PgConnectOptions,
    registry: Arc<Registry>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// The commit watcher of the stores built with it, while any lives.
    watcher: Mutex<Weak<Watcher>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// The channels listened for, and who listens.
#[derive(Default)]
struct Registry {
    channels: Mutex<HashMap<String, Channel>>,
    /// A channel was added or dropped: the connection's task listens or
    /// stops listening.
    changed: Notify,
    /// Counts the changes to the set of channels, so that the connection's
    /// task compares the channels it listens on with those wanted only
    /// after one: doing it for every notification cost a copy of every
    /// channel's name each time (in a fleet of 1,000 tenants at 1,000
    /// notifications a second, about a quarter of the process's CPU).
    version: AtomicU64,
    listening: Arc<AtomicBool>,
}

struct Channel {
    changes: watch::Sender<u64>,
    /// The announcer tokens of the stores listening, one per listener: a
    /// notification carrying a token that every listener has is its own
    /// store's, whose relays were woken in-process already.
    own: Vec<String>,
    /// `LISTEN` on it has taken effect on the connection that is up.
    listened: bool,
}

impl Channel {
    /// Tells its listeners of a change.
    fn bump(&self) {
        self.changes.send_modify(|v| *v = v.wrapping_add(1));
    }
}

impl std::fmt::Debug for PgSharedListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSharedListener")
            .field("channels", &self.channels())
            .field("listening", &self.is_listening())
            .finish()
    }
}

impl PgSharedListener {
    /// A shared listener for the database of `pool` (its connect options;
    /// no connection is opened yet).
    pub fn new(pool: &PgPool) -> Self {
        Self::with_options(&pool.connect_options())
    }

    /// A listener for the database `options` connect to: shared by a
    /// fleet's stores, or one relay's own.
    pub(crate) fn with_options(options: &PgConnectOptions) -> Self {
        PgSharedListener {
            inner: Arc::new(Inner {
                options: options.clone(),
                registry: Arc::default(),
                task: Mutex::new(None),
                watcher: Mutex::new(Weak::new()),
            }),
        }
    }

    /// The commit watcher shared by the stores built with this listener:
    /// one while any of them lives, on a connection of its own opened with
    /// this listener's options when one of them first enqueues. It looks
    /// at every store's enqueuing transactions in one statement, instead
    /// of each store looking at its own on its pool: on a fleet's pinned
    /// pools, those looks took about a third of each connection's round
    /// trips (the tenants bench).
    pub(crate) fn watcher(&self) -> Arc<Watcher> {
        let mut slot = lock(&self.inner.watcher);
        if let Some(watcher) = slot.upgrade() {
            return watcher;
        }
        // One connection: the watcher only looks, never holds it in a
        // wait for one transaction (that needs a spare connection).
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_lazy_with(self.inner.options.clone());
        let watcher = Watcher::new(pool);
        *slot = Arc::downgrade(&watcher);
        watcher
    }

    /// Whether its `LISTEN` connection is up.
    pub fn is_listening(&self) -> bool {
        self.inner.registry.listening.load(Ordering::SeqCst)
    }

    /// How many channels some relay listens on now.
    pub fn channels(&self) -> usize {
        lock(&self.inner.registry.channels).len()
    }

    /// Subscribes to `channel`: the receiver changes on each notification
    /// on it and on each (re)connection. `None` outside a tokio runtime.
    pub(crate) fn subscribe(&self, channel: &str, own: &str) -> Option<Subscription> {
        if !self.keep_running() {
            return None;
        }
        let changes = {
            let mut channels = lock(&self.inner.registry.channels);
            let entry = channels
                .entry(channel.to_owned())
                .or_insert_with(|| Channel {
                    changes: watch::channel(0).0,
                    own: Vec::new(),
                    listened: false,
                });
            entry.own.push(own.to_owned());
            entry.changes.subscribe()
        };
        self.inner.registry.changed_channels();
        Some(Subscription {
            shared: self.clone(),
            channel: channel.to_owned(),
            own: own.to_owned(),
            changes,
        })
    }

    /// Starts the connection's task on the current runtime unless it runs:
    /// at the first subscription, and again after the runtime it ran on
    /// shut down (an application that built its first relays on a runtime
    /// it then dropped), so that the relays of a later runtime listen
    /// instead of only polling. False outside a tokio runtime.
    fn keep_running(&self) -> bool {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let mut task = lock(&self.inner.task);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return true;
        }
        if task.is_some() {
            // Nothing is listened to now, and what was sent meanwhile was
            // missed: the relays still subscribed claim once.
            tracing::warn!(
                "outbox listener's task had ended (its runtime shut down); starting it again on this runtime"
            );
            self.inner.registry.lost();
        }
        *task = Some(rt.spawn(listen_loop(
            self.inner.options.clone(),
            Arc::clone(&self.inner.registry),
        )));
        true
    }
}

/// One relay's interest in one channel; dropping it gives it up.
pub(crate) struct Subscription {
    shared: PgSharedListener,
    channel: String,
    /// Its store's announcer token (see [`Channel::own`]).
    own: String,
    pub(crate) changes: watch::Receiver<u64>,
}

impl Subscription {
    /// Starts the shared connection's task again if it has ended (see
    /// [`PgSharedListener::keep_running`]).
    pub(crate) fn keep_running(&self) {
        self.shared.keep_running();
    }

    /// Whether its channel is listened to on a connection that is up.
    pub(crate) fn is_listening(&self) -> bool {
        let registry = &self.shared.inner.registry;
        registry.listening.load(Ordering::SeqCst)
            && lock(&registry.channels)
                .get(&self.channel)
                .is_some_and(|c| c.listened)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let registry = &self.shared.inner.registry;
        let mut channels = lock(&registry.channels);
        if let Some(entry) = channels.get_mut(&self.channel) {
            if let Some(i) = entry.own.iter().position(|t| *t == self.own) {
                entry.own.swap_remove(i);
            }
            if entry.own.is_empty() {
                channels.remove(&self.channel);
                registry.changed_channels();
            }
        }
    }
}

impl Registry {
    /// The set of channels changed: the connection's task catches up.
    fn changed_channels(&self) {
        self.version.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_one();
    }

    /// `LISTEN` on `channel` took effect.
    fn listened(&self, channel: &str) {
        if let Some(c) = lock(&self.channels).get_mut(channel) {
            c.listened = true;
        }
        self.bump(channel);
    }

    /// The connection is down: no channel is listened to.
    fn lost(&self) {
        self.listening.store(false, Ordering::SeqCst);
        for c in lock(&self.channels).values_mut() {
            c.listened = false;
        }
        self.bump_all();
    }

    /// A notification on `channel` with `payload`: tells its listeners,
    /// unless it is their own store's (every one of them has the token).
    fn notified(&self, channel: &str, payload: &str) {
        if let Some(c) = lock(&self.channels).get(channel) {
            let own = !payload.is_empty() && c.own.iter().all(|t| t == payload);
            if !own {
                c.bump();
            }
        }
    }

    fn bump(&self, channel: &str) {
        if let Some(c) = lock(&self.channels).get(channel) {
            c.bump();
        }
    }

    fn bump_all(&self) {
        lock(&self.channels).values().for_each(Channel::bump);
    }

    /// The channels wanted, if they changed since version `caught_up`
    /// (which becomes the version they are read at); `None` if not.
    fn wanted_since(&self, caught_up: &mut Option<u64>) -> Option<HashSet<String>> {
        let version = self.version.load(Ordering::SeqCst);
        if *caught_up == Some(version) {
            return None;
        }
        *caught_up = Some(version);
        Some(lock(&self.channels).keys().cloned().collect())
    }
}

/// Holds the `LISTEN` connection open on every channel some relay wants,
/// reporting each notification to its channel's relays and each
/// (re)connection to all; reconnects with growing pauses when it breaks.
async fn listen_loop(options: PgConnectOptions, registry: Arc<Registry>) {
    let mut pause = RECONNECT_FIRST;
    let mut failures = 0u32;
    loop {
        match connect(&options).await {
            Ok(mut listener) => {
                if failures > 0 {
                    tracing::info!("outbox listener connected again");
                }
                failures = 0;
                pause = RECONNECT_FIRST;
                registry.listening.store(true, Ordering::SeqCst);
                let Err(e) = serve(&mut listener, &registry).await;
                tracing::warn!(error = %e,
                    "outbox listener lost its connection; its relays poll until it is back");
            }
            Err(e) => {
                failures += 1;
                if failures == 1 {
                    tracing::warn!(error = %e, "outbox listener cannot LISTEN; its relays poll until it can");
                }
            }
        }
        registry.lost();
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// Listens on one connection until it fails: keeps its channels those the
/// registry wants, and reports what arrives.
async fn serve(
    listener: &mut PgListener,
    registry: &Registry,
) -> Result<std::convert::Infallible, sqlx::Error> {
    let mut listened: HashSet<String> = HashSet::new();
    // The registry's version `listened` matches (none yet).
    let mut caught_up = None;
    loop {
        // Catch up with the channels wanted, when they changed: a channel
        // newly listened to may have missed commits made before, so its
        // relays claim once. The version is read first, so a change made
        // while catching up is caught up with at the next turn. (`try_recv`
        // is cancel-safe: a notification half read stays buffered for the
        // next call.)
        if let Some(wanted) = registry.wanted_since(&mut caught_up) {
            for channel in wanted.difference(&listened) {
                listener.listen(channel).await?;
                registry.listened(channel);
            }
            for channel in listened.difference(&wanted) {
                listener.unlisten(channel).await?;
            }
            listened = wanted;
        }
        tokio::select! {
            received = listener.try_recv() => match received? {
                Some(n) => registry.notified(n.channel(), n.payload()),
                // The connection was lost. It is made again here, not by
                // sqlx, so that the channels listened to are this loop's.
                None => return Err(sqlx::Error::PoolClosed),
            },
            _ = registry.changed.notified() => {}
        }
    }
}

/// A listener on its own connection (a pool of one).
async fn connect(options: &PgConnectOptions) -> Result<PgListener, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(10))
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options.clone());
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.ignore_pool_close_event(true);
    listener.eager_reconnect(false);
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry with channel `c` listened to by stores with `own` tokens,
    /// and a receiver of its changes.
    fn listened_by(own: &[&str]) -> (Registry, watch::Receiver<u64>) {
        let registry = Registry::default();
        let (changes, seen) = watch::channel(0);
        lock(&registry.channels).insert(
            "c".to_owned(),
            Channel {
                changes,
                own: own.iter().map(|t| (*t).to_owned()).collect(),
                listened: true,
            },
        );
        (registry, seen)
    }

    #[test]
    fn the_channels_wanted_are_read_again_only_after_they_changed() {
        let (registry, _seen) = listened_by(&["a"]);
        let mut caught_up = None;
        let first = registry.wanted_since(&mut caught_up);
        assert_eq!(first, Some(HashSet::from(["c".to_owned()])));
        for _ in 0..3 {
            // Notifications come and go; the channels stay.
            registry.notified("c", "b");
            assert_eq!(registry.wanted_since(&mut caught_up), None);
        }
        lock(&registry.channels).remove("c");
        registry.changed_channels();
        assert_eq!(registry.wanted_since(&mut caught_up), Some(HashSet::new()));
        assert_eq!(registry.wanted_since(&mut caught_up), None);
    }

    #[test]
    fn a_stores_own_notification_is_skipped_and_every_other_one_told() {
        let (registry, mut seen) = listened_by(&["a"]);
        registry.notified("c", "a");
        assert!(!seen.has_changed().unwrap(), "its own store's: skipped");
        for other in ["", "b"] {
            registry.notified("c", other);
            assert!(seen.has_changed().unwrap(), "{other:?} is told");
            seen.borrow_and_update();
        }
        // Two stores of this process on one table: each must hear the
        // other's commits, so no notification is skipped.
        let (registry, seen) = listened_by(&["a", "b"]);
        registry.notified("c", "a");
        assert!(seen.has_changed().unwrap());
    }
}
