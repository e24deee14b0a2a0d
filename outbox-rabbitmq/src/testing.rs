//! Test helpers (feature `testing`): the broker URL from the environment
//! and a TCP proxy that cuts, stalls and heals the broker connection.
//!
//! ```no_run
//! # async fn run() {
//! use outbox_rabbitmq::testing::{TcpProxy, amqp_url, broker_addr, url_via};
//! let url = amqp_url();
//! let proxy = TcpProxy::start(broker_addr(&url).await).await;
//! let through_proxy = url_via(&url, proxy.addr());
//! // … connect a transport or consumer to `through_proxy` …
//! proxy.cut(); // every live connection dies, new ones are refused
//! proxy.heal(); // new connections work again
//! # let _ = through_proxy; }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// The RabbitMQ broker the tests use: `OUTBOX_AMQP_URL`, else the local
/// default `amqp://guest:guest@127.0.0.1:5672/%2f` if it answers.
pub const RABBITMQ: outbox_api::testing::ServiceSpec = outbox_api::testing::ServiceSpec {
    name: "RabbitMQ",
    variable: "OUTBOX_AMQP_URL",
    local_url: "amqp://guest:guest@127.0.0.1:5672/%2f",
    local_addr: ([127, 0, 0, 1], 5672),
    setup: "",
};

/// The broker for a test ([`RABBITMQ`]).
///
/// # Panics
/// When there is none (tests that need a broker fail, never skip), with a
/// message saying how to provide one.
pub fn amqp_url() -> String {
    outbox_api::testing::service_url(&RABBITMQ)
}

/// Declares on `channel` a direct exchange (auto-deleted) and an exclusive
/// queue bound to it with `routing_key`: a test's own destination.
///
/// # Panics
/// When the broker refuses a declaration.
pub async fn declare_bound_queue(
    channel: &lapin::Channel,
    exchange: &str,
    queue: &str,
    routing_key: &str,
) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare test exchange");
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare test queue");
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind test queue");
}

/// A name no other test uses: `outbox-test-{prefix}-{uuid v7}`.
pub fn unique_name(prefix: &str) -> String {
    format!("outbox-test-{prefix}-{}", outbox_api::MessageId::new())
}

/// The socket address of the broker in `url` (resolved).
///
/// # Panics
/// When the URL does not parse or the host does not resolve.
pub async fn broker_addr(url: &str) -> SocketAddr {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker URL parses");
    tokio::net::lookup_host((uri.authority.host.as_str(), uri.authority.port))
        .await
        .expect("resolving the broker host")
        .next()
        .expect("the broker host has an address")
}

/// `url` with its host and port replaced by `addr` (e.g. a [`TcpProxy`]'s),
/// keeping user, password and vhost.
///
/// # Panics
/// When the URL does not parse.
pub fn url_via(url: &str, addr: SocketAddr) -> String {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker URL parses");
    format!(
        "amqp://{}:{}@{}/{}",
        percent_encode(&uri.authority.userinfo.username),
        percent_encode(&uri.authority.userinfo.password),
        addr,
        percent_encode(&uri.vhost)
    )
}

/// `url` with its password replaced by `password` (to test refused
/// credentials).
///
/// # Panics
/// When the URL does not parse.
pub fn url_with_password(url: &str, password: &str) -> String {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker URL parses");
    format!(
        "amqp://{}:{}@{}:{}/{}",
        percent_encode(&uri.authority.userinfo.username),
        percent_encode(password),
        uri.authority.host,
        uri.authority.port,
        percent_encode(&uri.vhost)
    )
}

/// Percent-encodes everything but unreserved URL characters.
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02x}")
            }
        })
        .collect()
}

/// A TCP proxy on `127.0.0.1` in front of a broker, for fault tests: it can
/// [`cut`](TcpProxy::cut) every live connection (and refuse new ones until
/// [`heal`](TcpProxy::heal)), or [`stall`](TcpProxy::stall) them (keep them
/// open but forward nothing: a broker that does not answer).
///
/// Dropping the proxy closes everything. It runs on the tokio runtime it
/// was started on.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
}

#[derive(Debug, Default)]
struct Shared {
    cut: AtomicBool,
    stalled: AtomicBool,
    live: Mutex<Vec<AbortHandle>>,
    accepted: AtomicU64,
    refused: AtomicU64,
}

impl Shared {
    fn kill_live(&self) {
        for task in self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            task.abort();
        }
    }
}

impl TcpProxy {
    /// Listens on a free port of `127.0.0.1` and forwards every connection
    /// to `upstream`.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                if s.cut.load(Ordering::SeqCst) {
                    s.refused.fetch_add(1, Ordering::Relaxed);
                    drop(client); // refused: closed at once
                    continue;
                }
                s.accepted.fetch_add(1, Ordering::Relaxed);
                let shared = Arc::clone(&s);
                let task = tokio::spawn(async move {
                    if let Ok(upstream) = TcpStream::connect(upstream).await {
                        let _ = client.set_nodelay(true);
                        let _ = upstream.set_nodelay(true);
                        let (client_read, client_write) = client.into_split();
                        let (up_read, up_write) = upstream.into_split();
                        tokio::join!(
                            pump(client_read, up_write, Arc::clone(&shared)),
                            pump(up_read, client_write, shared),
                        );
                    }
                });
                let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
                live.retain(|t| !t.is_finished());
                live.push(task.abort_handle());
                // A cut that raced with this accept must not miss it.
                if s.cut.load(Ordering::SeqCst) {
                    task.abort();
                }
            }
        })
        .abort_handle();
        TcpProxy {
            addr,
            shared,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Kills every live connection and refuses new ones until
    /// [`heal`](Self::heal).
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        self.shared.kill_live();
    }

    /// Accepts connections again and ends a [`stall`](Self::stall).
    pub fn heal(&self) {
        self.shared.stalled.store(false, Ordering::SeqCst);
        self.shared.cut.store(false, Ordering::SeqCst);
    }

    /// Keeps every connection open but stops forwarding bytes (a broker
    /// that does not answer) until [`resume`](Self::resume) or
    /// [`heal`](Self::heal).
    pub fn stall(&self) {
        self.shared.stalled.store(true, Ordering::SeqCst);
    }

    /// Forwards bytes again after a [`stall`](Self::stall).
    pub fn resume(&self) {
        self.shared.stalled.store(false, Ordering::SeqCst);
    }

    /// Whether the proxy is cut.
    pub fn is_cut(&self) -> bool {
        self.shared.cut.load(Ordering::SeqCst)
    }

    /// Connections accepted (forwarded) so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Connections refused while cut so far.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }
}

/// Forwards bytes one way, holding them while the proxy is stalled.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while shared.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if shared.cut.load(Ordering::SeqCst) || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.kill_live();
    }
}
