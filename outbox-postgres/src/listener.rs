//! [`PgWorkListener`]: wakes a relay on in-process commits at once, on
//! other processes' commits through `LISTEN`, and polls when it cannot
//! listen.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_api::WorkListener;
use outbox_api::backend::{Wakeup, WakeupListener};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long the listener waits before connecting again after a failure,
/// at first and at most.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// How a store's relays learn about commits made by other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WakeUp {
    /// `LISTEN` on the table's channel (one connection per listening
    /// relay), polling only while that connection is down. The default.
    #[default]
    ListenNotify,
    /// Never `LISTEN`: poll every `poll_interval`. For connections through
    /// PgBouncer in transaction mode, where `LISTEN` does not work.
    /// Commits in this process still wake its relays at once.
    PollOnly,
}

/// A [`WorkListener`] for a PostgreSQL outbox, returned by
/// [`PgStore::listen`](outbox_api::Store::listen).
///
/// It reports a change:
/// * at once, when an enqueue through a [`PgOutbox`](crate::PgOutbox) of
///   this process has committed, or an operator action or a release made
///   messages claimable;
/// * when a notification arrives on the table's channel (sent after commit
///   by the announcing process, debounced);
/// * whenever its `LISTEN` connection is (re)established — notifications
///   sent while it was down are lost, so the relay claims once to catch up;
/// * every `poll_interval` while it cannot listen, and always with
///   [`WakeUp::PollOnly`].
///
/// The `LISTEN` connection lives in a task of its own, so `wait` is
/// cancel-safe; dropping the listener ends that task.
pub struct PgWorkListener {
    local: WakeupListener,
    remote: Option<watch::Receiver<u64>>,
    listening: Arc<AtomicBool>,
    poll: Duration,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PgWorkListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgWorkListener")
            .field("listening", &self.is_listening())
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

impl Drop for PgWorkListener {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl PgWorkListener {
    pub(crate) fn new(
        local: &Wakeup,
        mode: WakeUp,
        options: &PgConnectOptions,
        channel: &str,
        poll: Duration,
    ) -> Self {
        let listening = Arc::new(AtomicBool::new(false));
        let mut listener = PgWorkListener {
            local: local.listener(),
            remote: None,
            listening: Arc::clone(&listening),
            poll,
            task: None,
        };
        if mode == WakeUp::PollOnly {
            return listener;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("outbox listener created outside a tokio runtime; it polls");
            return listener;
        };
        let (tx, rx) = watch::channel(0u64);
        listener.remote = Some(rx);
        listener.task = Some(rt.spawn(listen_loop(
            options.clone(),
            channel.to_owned(),
            tx,
            listening,
        )));
        listener
    }

    /// Whether its `LISTEN` connection is up.
    pub fn is_listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// Takes a change reported and not yet seen.
    fn take_change(&mut self) -> bool {
        let local = self.local.take_change();
        let remote = match &mut self.remote {
            Some(rx) if rx.has_changed().unwrap_or(false) => {
                rx.borrow_and_update();
                true
            }
            _ => false,
        };
        local || remote
    }
}

/// Holds a `LISTEN` connection open, reporting each notification and each
/// (re)connection; reconnects with growing pauses when it breaks.
async fn listen_loop(
    options: PgConnectOptions,
    channel: String,
    changes: watch::Sender<u64>,
    listening: Arc<AtomicBool>,
) {
    let bump = || changes.send_modify(|v| *v = v.wrapping_add(1));
    let mut pause = RECONNECT_FIRST;
    let mut failures = 0u32;
    loop {
        match connect(&options, &channel).await {
            Ok(mut listener) => {
                if failures > 0 {
                    tracing::info!(%channel, "outbox listener connected again");
                }
                failures = 0;
                pause = RECONNECT_FIRST;
                listening.store(true, Ordering::SeqCst);
                // Anything committed before LISTEN took effect was not
                // announced to this connection: report a change to catch up.
                bump();
                loop {
                    match listener.try_recv().await {
                        Ok(Some(_)) => bump(),
                        // The connection was lost and made again: whatever
                        // was sent meanwhile is lost.
                        Ok(None) => bump(),
                        Err(e) => {
                            tracing::warn!(error = %e, %channel,
                                "outbox listener lost its connection; polling until it is back");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                failures += 1;
                if failures == 1 {
                    tracing::warn!(error = %e, %channel,
                        "outbox listener cannot LISTEN; polling until it can");
                } else {
                    tracing::debug!(error = %e, %channel, failures, "outbox listener still cannot LISTEN");
                }
            }
        }
        listening.store(false, Ordering::SeqCst);
        bump();
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// A listener on its own connection (a pool of one, so that sqlx can
/// reconnect it), listening on `channel`.
async fn connect(options: &PgConnectOptions, channel: &str) -> Result<PgListener, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(10))
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options.clone());
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.ignore_pool_close_event(true);
    listener.listen(channel).await?;
    Ok(listener)
}

#[async_trait]
impl WorkListener for PgWorkListener {
    async fn wait(&mut self, timeout: Duration) -> bool {
        if self.take_change() {
            return true;
        }
        let polling = !self.is_listening();
        let (nap, on_nap) = if polling && self.poll < timeout {
            (self.poll, true)
        } else {
            (timeout, false)
        };
        let Self { local, remote, .. } = self;
        let remote = async {
            match remote {
                Some(rx) => {
                    if rx.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                    rx.borrow_and_update();
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = local.changed() => true,
            _ = remote => true,
            _ = tokio::time::sleep(nap) => on_nap,
        }
    }
}
