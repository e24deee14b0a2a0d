//! A web console for [outbox-rs](https://github.com/outbox-rs/outbox-rs):
//! an [axum] [`Router`] over any [`OperatorStore`], so that the human who
//! poisoned messages wait for has a page, not only a command line.
//!
//! * **Pages**: an overview (per outbox: pending, poisoned, processed,
//!   oldest pending age, health; on top, the outboxes counted by status
//!   and those not healthy named; a filter by name, `?q=`, and by status,
//!   `?status=not-healthy`, and pages — usable with a thousand tenants'
//!   outboxes, read a few at a time, see [`Console::read_concurrency`]),
//!   poisoned / pending / processed lists
//!   (type, key, attempts, last error; paging; a filter by type), a
//!   message's detail (headers, pretty-printed payload, trace id), the
//!   saga view of a trace (`/traces/{trace id}`: every message of that
//!   trace in every outbox of the console, in commit order, with kind,
//!   type, state, attempts and commit → processed time), and the
//!   actions *retry* and *discard* — of one message, or of all poisoned
//!   messages of a type — each behind a confirmation page. Server-rendered
//!   HTML that needs no JavaScript (the pages forbid scripts outright).
//! * **Mount it** in an application's server with [`router`], or run it
//!   alone with [`serve`] (what `outbox serve` does).
//! * **Security**: without a token the console answers only loopback peers
//!   addressed by a loopback host name; with a token every request needs it
//!   (a cookie from the login form, or `Authorization: Bearer`); actions are
//!   POSTs carrying a CSRF token and checked for their origin; everything a
//!   message holds is escaped. See the crate README for the whole model.
//!
//! ```no_run
//! # async fn demo(store: std::sync::Arc<dyn outbox_api::OperatorStore>) -> Result<(), outbox_console::ConsoleError> {
//! use outbox_console::Console;
//!
//! // In an application: the console at /outbox, beside the app's own routes.
//! let console = Console::new()
//!     .outbox("orders", store.clone())?
//!     .token_from_env()? // OUTBOX_CONSOLE_TOKEN, if set
//!     .path_prefix("/outbox")?;
//! let app = axum::Router::new()
//!     .route("/health", axum::routing::get(|| async { "ok" }))
//!     .merge(outbox_console::router(console));
//! # let _ = app;
//!
//! // Alone, on loopback (a token is required for any other address):
//! let console = Console::new().outbox("orders", store)?;
//! outbox_console::serve("127.0.0.1:8080".parse().unwrap(), console).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod charts;
mod pages;
mod security;
mod view;

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use outbox_api::{HealthReport, OperatorStore};

pub use security::TOKEN_ENV;

/// The name of the cookie the login form sets.
pub const SESSION_COOKIE: &str = "outbox_console_session";

/// Shortest token accepted, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// How many outboxes a page reads at the same time by default
/// ([`Console::read_concurrency`]).
pub const DEFAULT_READ_CONCURRENCY: usize = 8;

/// What can go wrong building or serving a console.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsoleError {
    /// A setting was refused; the text says which and why.
    Config(String),
    /// Serving on a non-loopback address without a token.
    NeedsToken(SocketAddr),
    /// Binding or serving failed.
    Io(std::io::Error),
}

impl fmt::Display for ConsoleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConsoleError::Config(why) => write!(f, "outbox console: {why}"),
            ConsoleError::NeedsToken(addr) => write!(
                f,
                "outbox console: refusing to listen on {addr} without a token: that address \
                 is not loopback, so anyone who reaches it could retry and discard messages. \
                 Set a token (Console::token, or the {TOKEN_ENV} environment variable read by \
                 Console::token_from_env; `outbox serve --token`), or listen on 127.0.0.1"
            ),
            ConsoleError::Io(e) => write!(f, "outbox console: {e}"),
        }
    }
}

impl std::error::Error for ConsoleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConsoleError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for ConsoleError {
    fn from(e: std::io::Error) -> Self {
        ConsoleError::Io(e)
    }
}

/// A source of a relay's [`HealthReport`] for the overview (e.g. a
/// `RelayHandle`'s `health()`); see [`Console::outbox_with_health`].
pub type HealthFn =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = HealthReport> + Send>> + Send + Sync>;

/// One outbox the console shows.
#[derive(Clone)]
pub(crate) struct Outbox {
    pub(crate) name: String,
    pub(crate) store: Arc<dyn OperatorStore>,
    pub(crate) health: Option<HealthFn>,
}

/// The outboxes a console shows, which may change while it serves
/// ([`Console::outbox_list`]): each page reads the list as it is when the
/// request comes. Clones share the list.
#[derive(Clone, Default)]
pub struct OutboxList {
    inner: Arc<RwLock<Arc<Vec<Outbox>>>>,
}

impl fmt::Debug for OutboxList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl OutboxList {
    /// Adds an outbox, as [`Console::outbox`] does: refused, changing
    /// nothing, if its name is not valid, is reserved or is in the list.
    pub fn add(
        &self,
        name: impl Into<String>,
        store: Arc<dyn OperatorStore>,
    ) -> Result<(), ConsoleError> {
        self.push(name.into(), store, None)
    }

    /// Adds an outbox with a health report, as
    /// [`Console::outbox_with_health`] does.
    pub fn add_with_health<F, Fut>(
        &self,
        name: impl Into<String>,
        store: Arc<dyn OperatorStore>,
        health: F,
    ) -> Result<(), ConsoleError>
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HealthReport> + Send + 'static,
    {
        let health: HealthFn = Arc::new(move || Box::pin(health()));
        self.push(name.into(), store, Some(health))
    }

    /// Removes the outbox `name`; false if the list has none of that name.
    pub fn remove(&self, name: &str) -> bool {
        let mut list = self.write();
        if !list.iter().any(|o| o.name == name) {
            return false;
        }
        let kept: Vec<Outbox> = list.iter().filter(|o| o.name != name).cloned().collect();
        *list = Arc::new(kept);
        true
    }

    /// The outboxes' names, in the order they were added.
    pub fn names(&self) -> Vec<String> {
        self.snapshot().iter().map(|o| o.name.clone()).collect()
    }

    /// The list as it is now (what one page reads).
    pub(crate) fn snapshot(&self) -> Arc<Vec<Outbox>> {
        Arc::clone(&self.inner.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Arc<Vec<Outbox>>> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    fn push(
        &self,
        name: String,
        store: Arc<dyn OperatorStore>,
        health: Option<HealthFn>,
    ) -> Result<(), ConsoleError> {
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid {
            return Err(ConsoleError::Config(format!(
                "outbox name {name:?} is not valid: use 1 to 64 letters, digits, `-` or `_`"
            )));
        }
        if RESERVED_NAMES.contains(&name.as_str()) {
            return Err(ConsoleError::Config(format!(
                "outbox name `{name}` is reserved for the console's own pages; choose another"
            )));
        }
        let mut list = self.write();
        if list.iter().any(|o| o.name == name) {
            return Err(ConsoleError::Config(format!(
                "outbox name `{name}` is given twice"
            )));
        }
        Arc::make_mut(&mut list).push(Outbox {
            name,
            store,
            health,
        });
        Ok(())
    }
}

/// The console's configuration: which outboxes it shows, under which path,
/// and whether it asks for a token. Build it, then hand it to [`router`] or
/// [`serve`].
///
/// Its outboxes can change while it serves (a tenant created or deleted):
/// see [`Console::outbox_list`]. Clones of a console share that list.
#[derive(Clone)]
pub struct Console {
    pub(crate) outboxes: OutboxList,
    pub(crate) token: Option<String>,
    pub(crate) prefix: String,
    pub(crate) backlog_age_alert: Duration,
    pub(crate) page_size: usize,
    pub(crate) read_concurrency: usize,
}

impl fmt::Debug for Console {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Console")
            .field("outboxes", &self.outboxes.names())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("prefix", &self.prefix)
            .field("backlog_age_alert", &self.backlog_age_alert)
            .field("page_size", &self.page_size)
            .field("read_concurrency", &self.read_concurrency)
            .finish()
    }
}

impl Default for Console {
    fn default() -> Self {
        Self::new()
    }
}

/// Outbox names that would collide with the console's own paths.
const RESERVED_NAMES: &[&str] = &["login", "logout", "style.css", "traces"];

impl Console {
    /// A console with no outbox, no token, mounted at `/`.
    pub fn new() -> Self {
        Console {
            outboxes: OutboxList::default(),
            token: None,
            prefix: String::new(),
            backlog_age_alert: Duration::from_secs(300),
            page_size: 50,
            read_concurrency: DEFAULT_READ_CONCURRENCY,
        }
    }

    /// Adds an outbox under `name` (letters, digits, `-` and `_`; at most 64
    /// bytes; unique). Its health on the overview is judged from the table
    /// alone (poison, backlog age); use
    /// [`outbox_with_health`](Console::outbox_with_health) to show the
    /// relay's own report.
    pub fn outbox(
        self,
        name: impl Into<String>,
        store: Arc<dyn OperatorStore>,
    ) -> Result<Self, ConsoleError> {
        self.outboxes.add(name, store)?;
        Ok(self)
    }

    /// Adds an outbox whose overview row shows `health()`'s report (e.g. a
    /// running relay's `RelayHandle::health`), which also knows whether the
    /// relay runs and whether its transport is up.
    pub fn outbox_with_health<F, Fut>(
        self,
        name: impl Into<String>,
        store: Arc<dyn OperatorStore>,
        health: F,
    ) -> Result<Self, ConsoleError>
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HealthReport> + Send + 'static,
    {
        self.outboxes.add_with_health(name, store, health)?;
        Ok(self)
    }

    /// The console's list of outboxes, to change while it serves: an
    /// outbox added to it shows on the next page loaded, one removed is
    /// gone from it (a page of it answers 404). The same list as the
    /// console's and its clones', and the router's it is handed to.
    pub fn outbox_list(&self) -> OutboxList {
        self.outboxes.clone()
    }

    /// Requires `token` on every request (at least [`MIN_TOKEN_LEN`] bytes;
    /// e.g. `openssl rand -hex 32`). It is never shown in a page, a log or
    /// `Debug`.
    pub fn token(mut self, token: impl Into<String>) -> Result<Self, ConsoleError> {
        let token = token.into();
        if token.len() < MIN_TOKEN_LEN {
            return Err(ConsoleError::Config(format!(
                "the console token is too short ({} bytes; at least {MIN_TOKEN_LEN}): \
                 use a long random one, e.g. `openssl rand -hex 32`",
                token.len()
            )));
        }
        self.token = Some(token);
        Ok(self)
    }

    /// Requires the token in the [`TOKEN_ENV`] environment variable
    /// (`OUTBOX_CONSOLE_TOKEN`) if it is set and not empty; otherwise
    /// changes nothing.
    pub fn token_from_env(self) -> Result<Self, ConsoleError> {
        match std::env::var(TOKEN_ENV) {
            Ok(t) if !t.is_empty() => self.token(t),
            _ => Ok(self),
        }
    }

    /// Whether a token is required.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Serves the console under `prefix` (e.g. `/outbox`), so that an
    /// application can [`merge`](axum::Router::merge) it beside its own
    /// routes; links and the cookie path follow it. `""` or `/` is the root.
    pub fn path_prefix(mut self, prefix: impl Into<String>) -> Result<Self, ConsoleError> {
        let prefix = prefix.into();
        let trimmed = prefix.trim_end_matches('/');
        let valid = trimmed.is_empty()
            || (trimmed.starts_with('/')
                && trimmed[1..].split('/').all(|seg| {
                    !seg.is_empty()
                        && seg != "."
                        && seg != ".."
                        && seg
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_.~".contains(&b))
                }));
        if !valid {
            return Err(ConsoleError::Config(format!(
                "path prefix {prefix:?} is not valid: use `/name` or `/a/b` with letters, \
                 digits, `-`, `_`, `.` or `~` in each segment"
            )));
        }
        self.prefix = trimmed.to_owned();
        Ok(self)
    }

    /// When the table-based health calls an outbox degraded because of its
    /// oldest pending message (default 5 minutes, as the relay's
    /// `backlog_age_alert`).
    pub fn backlog_age_alert(mut self, age: Duration) -> Self {
        self.backlog_age_alert = age;
        self
    }

    /// Messages per list page, and outboxes per overview page (default 50;
    /// 1 to 500).
    pub fn page_size(mut self, n: usize) -> Self {
        self.page_size = n.clamp(1, 500);
        self
    }

    /// How many outboxes a page reads at the same time when it reads them
    /// all — the overview's health and counts, the saga view's search
    /// (default [`DEFAULT_READ_CONCURRENCY`]; 1 to 64). With many outboxes
    /// on one database (a schema per tenant), keep it at or below the
    /// pool's size: more only waits for connections.
    pub fn read_concurrency(mut self, n: usize) -> Self {
        self.read_concurrency = n.clamp(1, 64);
        self
    }
}

/// The console as an axum [`Router`], with its routes under the console's
/// [path prefix](Console::path_prefix). Merge it into an application's
/// router (`app.merge(outbox_console::router(console))`) — not `nest`: the
/// prefix is already in its routes and links.
///
/// Without a token the console answers only requests from a loopback peer,
/// which it learns from axum's `ConnectInfo<SocketAddr>`: serve the
/// application with
/// `into_make_service_with_connect_info::<SocketAddr>()`, or set a token.
pub fn router(console: Console) -> Router {
    let state = Arc::new(pages::State::new(console));
    let p = state.prefix.clone();
    let mut inner = Router::new()
        .route("/", get(pages::overview))
        .route("/style.css", get(pages::stylesheet))
        .route("/login", get(pages::login_form).post(pages::login))
        .route("/logout", post(pages::logout))
        .route("/traces/{trace_id}", get(pages::trace))
        .route("/{outbox}/activity", get(pages::activity))
        .route("/{outbox}/messages", get(pages::list))
        .route("/{outbox}/messages/{id}", get(pages::detail))
        .route(
            "/{outbox}/messages/{id}/{action}",
            get(pages::confirm_one).post(pages::act_one),
        )
        .route(
            "/{outbox}/poisoned/{action}",
            get(pages::confirm_bulk).post(pages::act_bulk),
        );
    if !p.is_empty() {
        // Under a prefix the console owns every path below it, so unknown
        // ones get its own 404 page (at the root, the application's
        // fallback, or `serve`'s, answers them).
        inner = inner.fallback(pages::not_found);
    }
    let inner = inner
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            security::guard,
        ))
        .with_state(state);
    if p.is_empty() {
        inner
    } else {
        // `nest` answers `/outbox`; `/outbox/` is sent there.
        let to = p.clone();
        Router::new().nest(&p, inner).route(
            &format!("{p}/"),
            get(move || std::future::ready(axum::response::Redirect::permanent(&to))),
        )
    }
}

/// Runs the console alone on `addr` until the process ends (what `outbox
/// serve --listen ADDR` does). A non-loopback `addr` is refused with
/// [`ConsoleError::NeedsToken`] unless the console has a token.
pub async fn serve(addr: SocketAddr, console: Console) -> Result<(), ConsoleError> {
    check_addr(addr, &console)?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, console, std::future::pending()).await
}

/// Runs the console on a bound `listener` until `shutdown` completes (for
/// Ctrl-C handling, or a test that binds port 0). Refuses a non-loopback
/// listener without a token, as [`serve`] does.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    console: Console,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ConsoleError> {
    let addr = listener.local_addr()?;
    check_addr(addr, &console)?;
    let prefix = console.prefix.clone();
    let app = router(console).fallback(pages::plain_not_found(prefix.clone()));
    tracing::info!("outbox console listening on http://{addr}{prefix}/");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await?;
    Ok(())
}

fn check_addr(addr: SocketAddr, console: &Console) -> Result<(), ConsoleError> {
    if !addr.ip().is_loopback() && console.token.is_none() {
        return Err(ConsoleError::NeedsToken(addr));
    }
    Ok(())
}
