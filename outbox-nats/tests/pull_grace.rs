//! A pull request whose `408` (the server's "request expired") never
//! arrives does not stall the consumer: its worker asks for the next one
//! soon after the expiry (`PULL_GRACE` in `src/consumer/worker.rs`), where
//! async-nats alone would end the request only 5 s after it. Seen under
//! load in MiniShop over NATS: one request in a few runs, a partition
//! stalled for 5 s. Here a proxy in front of the server withholds every
//! `408` from the consumer and counts its pull requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_api::receive::{HandlerFuture, Received, handler_fn};
use outbox_api::testing::wait_until;
use outbox_nats::testing::{declare_consumer_streams, nats_url, server_addr, unique_name};
use outbox_nats::{NatsConfig, NatsConsumer, NatsTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The subject a JetStream pull request is published to.
const PULL_SUBJECT: &[u8] = b"$JS.API.CONSUMER.MSG.NEXT.";

/// A proxy in front of the NATS server that drops every message carrying
/// status `408` on its way to the client, and counts the client's pull
/// requests.
struct No408Proxy {
    addr: SocketAddr,
    pulls: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
}

impl No408Proxy {
    async fn start(upstream: SocketAddr) -> No408Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        let pulls = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let (p, d) = (Arc::clone(&pulls), Arc::clone(&dropped));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (p, d) = (Arc::clone(&p), Arc::clone(&d));
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(count_pulls(cr, sw, p), drop_408(sr, cw, d));
                });
            }
        });
        No408Proxy {
            addr,
            pulls,
            dropped,
        }
    }
}

/// Client to server: forwarded as it comes, pull requests counted (the
/// subject searched across reads, a read's tail kept for the next).
async fn count_pulls(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    pulls: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        tail.extend_from_slice(&buf[..n]);
        let found = tail
            .windows(PULL_SUBJECT.len())
            .filter(|w| *w == PULL_SUBJECT)
            .count();
        pulls.fetch_add(found as u64, Ordering::SeqCst);
        let keep = tail.len().min(PULL_SUBJECT.len() - 1);
        tail.drain(..tail.len() - keep);
    }
}

/// Server to client, frame by frame (protocol lines, and `MSG`/`HMSG`
/// with their payloads): an `HMSG` whose headers begin with status `408`
/// is dropped, everything else forwarded.
async fn drop_408(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    dropped: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        let mut out = Vec::with_capacity(pending.len());
        let mut at = 0;
        while let Some(frame) = frame_len(&pending[at..]) {
            let bytes = &pending[at..at + frame];
            if bytes.starts_with(b"HMSG ") && is_408(bytes) {
                dropped.fetch_add(1, Ordering::SeqCst);
            } else {
                out.extend_from_slice(bytes);
            }
            at += frame;
        }
        pending.drain(..at);
        if to.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// The length of the whole first frame of `data`, if it has arrived.
fn frame_len(data: &[u8]) -> Option<usize> {
    let line_end = data.windows(2).position(|w| w == b"\r\n")? + 2;
    let line = std::str::from_utf8(&data[..line_end - 2]).ok()?;
    let payload = if line.starts_with("MSG ") || line.starts_with("HMSG ") {
        // The last field is the payload's size (with the headers for HMSG).
        line.rsplit(' ').next()?.parse::<usize>().ok()? + 2
    } else {
        0
    };
    (data.len() >= line_end + payload).then_some(line_end + payload)
}

/// Whether an `HMSG` frame's headers carry status 408.
fn is_408(frame: &[u8]) -> bool {
    let line_end = frame.windows(2).position(|w| w == b"\r\n").unwrap_or(0) + 2;
    frame[line_end..].starts_with(b"NATS/1.0 408")
}

/// With every `408` withheld, the consumer's worker still asks again
/// within a moment of each expiry (1 s): three pull requests come within
/// 8 s. Waiting for async-nats to end each request (5 s past its expiry),
/// the third would come about 12 s after the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_request_whose_expiry_is_never_reported_does_not_stall_the_worker() {
    let name = unique_name("grace");
    let transport = NatsTransport::connect(NatsTransport::builder(nats_url()))
        .await
        .expect("connect to NATS");
    declare_consumer_streams(&transport, &name, |s| s).await;
    let proxy = No408Proxy::start(server_addr(&nats_url())).await;
    let inbox = outbox_memory::MemoryInbox::new(outbox_memory::MemoryStore::new());
    let handler = handler_fn(
        |_: &Received, _: &mut outbox_memory::MemoryTransaction| -> HandlerFuture<'_> {
            Box::pin(async { Ok(()) })
        },
    );
    let consumer = NatsConsumer::builder(
        NatsConfig::new(format!("nats://{}", proxy.addr)),
        name.as_str(),
        "c1",
    )
    .dead_letter_subject(format!("{name}-dead.c1"))
    .spawn(inbox, handler)
    .await
    .expect("start the consumer");

    wait_until("the first pull request", Duration::from_secs(20), || {
        let n = proxy.pulls.load(Ordering::SeqCst);
        async move { n >= 1 }
    })
    .await;
    let first = tokio::time::Instant::now();
    let within = Duration::from_secs(8);
    while proxy.pulls.load(Ordering::SeqCst) < 3 && first.elapsed() < within {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (pulls, dropped) = (
        proxy.pulls.load(Ordering::SeqCst),
        proxy.dropped.load(Ordering::SeqCst),
    );
    assert!(
        dropped >= 1,
        "the proxy withheld no 408: the server's expiry status was not recognised"
    );
    assert!(
        pulls >= 3,
        "{pulls} pull requests in {within:?} after the first, with every 408 withheld \
         ({dropped} of them): the worker waited for async-nats to end each request"
    );
    consumer.shutdown().await;
    let js = transport.jetstream();
    let _ = js.delete_stream(&name).await;
    let _ = js.delete_stream(format!("{name}_DEAD")).await;
}
