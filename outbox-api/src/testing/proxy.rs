//! A TCP proxy for fault tests, in front of any server (a broker, a
//! database): it cuts, stalls and heals the connections through it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A TCP proxy on `127.0.0.1` in front of a server, for fault tests: it can
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
