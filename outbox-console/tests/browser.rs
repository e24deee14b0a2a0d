//! The console in a real browser: headless Chromium driven over WebDriver
//! (chromedriver) with fantoccini. An operator opens the console, finds a
//! poisoned message, retries it through the confirmation page, and a
//! running `outbox::Relay` delivers it; the message's `<script>` payload
//! shows as text and never runs. Screenshots are kept under
//! `target/console/`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`apt-get install -y
//! chromium chromium-driver`; `.ci/run` installs them). Without them this
//! test fails, saying so. `CHROMEDRIVER` and `CHROMIUM` override the paths.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use outbox::memory::{MemoryStore, MemoryTransport};
use outbox::{Clock, MessageState, NewMessage, OperatorStore, Relay, RetryPolicy, Store};
use outbox_console::Console;
use serde_json::json;
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(60);
const SCRIPT_PAYLOAD: &str =
    r#"{"note":"<script>document.title='pwned';window.pwned=true</script>"}"#;

fn find(var: &str, candidates: &[&str], package: &str) -> PathBuf {
    let from_env = std::env::var_os(var).map(PathBuf::from);
    if let Some(p) = from_env.as_ref().filter(|p| p.exists()) {
        return p.clone();
    }
    if from_env.is_none() {
        let path = std::env::var_os("PATH").unwrap_or_default();
        for name in candidates {
            let direct = Path::new(name);
            if direct.is_absolute() && direct.exists() {
                return direct.to_owned();
            }
            for dir in std::env::split_paths(&path) {
                let p = dir.join(name);
                if p.exists() {
                    return p;
                }
            }
        }
    }
    let looked = match from_env {
        Some(p) => format!("{var}={} does not exist", p.display()),
        None => format!("{} not found, {var} not set", candidates.join(" / ")),
    };
    panic!(
        "the browser test needs {package} ({looked}). Install Debian's packages with \
         `apt-get install -y chromium chromium-driver` (as .ci/run does), or point {var} at \
         the binary."
    );
}

/// Polls `cond` until it holds, or fails after `DEADLINE` saying `what`.
async fn wait_until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        if cond().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A chromedriver child on a free loopback port, killed on drop.
struct Driver {
    _child: tokio::process::Child,
    url: String,
}

async fn start_driver() -> Driver {
    let binary = find(
        "CHROMEDRIVER",
        &["/usr/bin/chromedriver", "chromedriver"],
        "chromedriver",
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(&binary)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    // Ready when its own `/status` says so — not merely when something
    // listens on the port (another process may have taken it meanwhile) —
    // and failing at once, naming it, if it exits.
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{} exited ({status}) before it was ready", binary.display());
        }
        if driver_ready(addr).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for chromedriver on {addr} to report ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Driver {
        _child: child,
        url: format!("http://{addr}"),
    }
}

/// Whether the chromedriver on `addr` answers `GET /status` with
/// `"ready": true`.
async fn driver_ready(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let request = format!("GET /status HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    // It keeps the connection open after its answer: read until the
    // answer says it is ready, or for at most two seconds.
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let text = String::from_utf8_lossy(&answer);
        if text.contains("\"ready\":true") {
            return true;
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => answer.extend_from_slice(&buf[..n]),
            _ => return false,
        }
    }
}

async fn browser(driver: &Driver, profile: &Path) -> Client {
    let chromium = find("CHROMIUM", &["/usr/bin/chromium", "chromium"], "chromium");
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                "--window-size=1200,720",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .unwrap_or_else(|e| panic!("chromedriver at {} did not start Chromium: {e}", driver.url))
}

fn artifacts() -> PathBuf {
    // CARGO_TARGET_TMPDIR is target/tmp; the artifacts go beside it.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("console");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The console over `store` (as outbox "orders"), served on a loopback
/// port of its own until [`stop`](Served::stop).
struct Served {
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), outbox_console::ConsoleError>>,
}

impl Served {
    async fn start(store: &MemoryStore) -> Served {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let console = Console::new()
            .outbox("orders", Arc::new(store.clone()) as Arc<dyn OperatorStore>)
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(outbox_console::serve_on(listener, console, async {
            let _ = stopped.await;
        }));
        Served { base, stop, server }
    }

    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.server.await.unwrap().unwrap();
    }
}

async fn text_of(c: &Client, css: &str) -> String {
    let url = c.current_url().await.map(|u| u.to_string());
    c.find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css} on {url:?}: {e}"))
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_retries_a_poisoned_message_in_a_browser_and_the_relay_delivers_it() {
    let driver = start_driver().await;

    // An outbox with a relay whose broker refuses `Fragile` messages: the
    // `<script>` one is poisoned after five attempts.
    let store = MemoryStore::new();
    let (broker, broker_handle) = MemoryTransport::new();
    broker_handle.reject_type("Fragile");
    let relay = Relay::builder(store.clone())
        .transport(broker)
        .retry_policy(RetryPolicy::NextRound)
        .poll_interval(Duration::from_millis(50))
        .spawn()
        .unwrap();
    let mut tx = store.begin();
    for n in 0..12 {
        tx.enqueue(
            NewMessage::json(
                outbox::MessageKind::Integration,
                "OrderPlaced",
                &json!({ "order": n }),
            )
            .unwrap()
            .key(format!("order-{n}")),
        )
        .unwrap();
    }
    for n in 0..3 {
        tx.enqueue(
            NewMessage::json(
                outbox::MessageKind::Integration,
                "InvoiceDue",
                &json!({ "invoice": n }),
            )
            .unwrap()
            .delay(Duration::from_secs(3600)),
        )
        .unwrap();
    }
    let poisoned = tx
        .enqueue(
            NewMessage::new(
                outbox::MessageKind::Integration,
                "Fragile",
                SCRIPT_PAYLOAD.as_bytes().to_vec(),
            )
            .content_type("application/json")
            .key("cart-7")
            .header("tenant", "acme"),
        )
        .unwrap();
    tx.commit().unwrap();
    wait_until("the Fragile message to be poisoned", || {
        let store = store.clone();
        async move { Store::stats(&store).await.unwrap().poisoned == 1 }
    })
    .await;
    // The broker takes it from now on; only the operator's retry can send it.
    broker_handle.accept_all();

    let served = Served::start(&store).await;
    let base = served.base.clone();

    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, profile.path()).await;

    // The overview: counts and health; its screenshot is the artifact.
    c.goto(&format!("{base}/")).await.unwrap();
    let overview = text_of(&c, "main table").await;
    assert!(
        overview.contains("orders") && overview.contains("degraded"),
        "{overview}"
    );
    let dir = artifacts();
    std::fs::write(dir.join("overview.png"), c.screenshot().await.unwrap()).unwrap();

    // Find the poisoned message: the outbox's poisoned list, then its row.
    c.find(Locator::Css(
        r#"main a[href="/orders/messages?state=poisoned"]"#,
    ))
    .await
    .unwrap()
    .click()
    .await
    .unwrap();
    let list = text_of(&c, "main table").await;
    assert!(
        list.contains("Fragile") && list.contains(&poisoned.to_string()),
        "{list}"
    );
    std::fs::write(dir.join("poisoned.png"), c.screenshot().await.unwrap()).unwrap();
    c.find(Locator::LinkText(&poisoned.to_string()))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();

    // The detail page: the payload is text, and its script never ran.
    let payload = text_of(&c, "pre.payload").await;
    assert!(
        payload.contains("<script>document.title='pwned';window.pwned=true</script>"),
        "the payload shows as text: {payload}"
    );
    let title = c.title().await.unwrap();
    assert_eq!(title, format!("Message {poisoned} · outbox console"));
    let ran = c
        .execute(
            "return [window.pwned === true, document.scripts.length]",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(ran, json!([false, 0]), "no script element, nothing ran");
    std::fs::write(dir.join("message.png"), c.screenshot().await.unwrap()).unwrap();

    // Retry: the link leads to a confirmation page, which changes nothing…
    c.find(Locator::LinkText("Retry…"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let heading = text_of(&c, "h1").await;
    assert!(heading.starts_with("Confirm: retry"), "{heading}");
    std::fs::write(dir.join("confirm.png"), c.screenshot().await.unwrap()).unwrap();
    let m = store.get(poisoned).await.unwrap().unwrap();
    assert_eq!(
        m.state,
        MessageState::Poisoned,
        "not before the confirmation"
    );
    // …until the operator confirms.
    c.find(Locator::Css("form.actions button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The POST answers with a redirect to the message; wait for that page.
    let landed = c
        .wait()
        .at_most(DEADLINE)
        .for_element(Locator::Css("p.flash"))
        .await;
    if let Err(e) = landed {
        panic!(
            "no result page after confirming ({e}): {}",
            c.source().await.unwrap()
        );
    }
    let flash = text_of(&c, "p.flash").await;
    assert_eq!(flash, "Retried.");

    // The running relay delivers it, and the page says so on reload.
    wait_until("the relay to deliver the retried message", || {
        let delivered = broker_handle.delivered_ids();
        async move { delivered.contains(&poisoned) }
    })
    .await;
    wait_until("the message to be marked processed", || {
        let store = store.clone();
        async move { store.get(poisoned).await.unwrap().unwrap().state == MessageState::Processed }
    })
    .await;
    c.refresh().await.unwrap();
    let details = text_of(&c, "main table").await;
    assert!(details.contains("processed"), "{details}");
    assert!(
        details.contains("retried by outbox-console (127.0.0.1)"),
        "{details}"
    );

    c.close().await.unwrap();
    served.stop().await;
    relay.shutdown().await;
}

/// An hour of traffic in an outbox of its own, written through the store
/// at the times a manual clock gives: a rate that rises and falls, sixty
/// deliveries a minute at most (a busy stretch leaves a backlog that
/// drains after it), a failure every seven minutes (poisoned at the fifth
/// try, or at once in the 38th minute), and one saga of three messages
/// under one trace, the last still waiting.
/// Returns the store and the saga's trace id.
async fn an_hour_of_traffic() -> (MemoryStore, String) {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let start = outbox::Timestamp::now().saturating_sub(Duration::from_secs(3_600));
    let clock = Arc::new(outbox::ManualClock::new(start));
    let store = MemoryStore::with_clock(clock.clone());
    let claim = |now| outbox::ClaimRequest::new("seed", 10_000, Duration::from_secs(60), now);
    for minute in 0..60u64 {
        let rate = 20 + (minute * 7 % 23) + if (25..35).contains(&minute) { 40 } else { 0 };
        let mut tx = store.begin();
        for n in 0..rate {
            let mut m = NewMessage::new(
                outbox::MessageKind::Domain,
                "OrderPlaced",
                format!("{{\"order\":{n}}}").into_bytes(),
            );
            if minute == 59 && n + 3 >= rate {
                m = m.trace_parent(format!("00-{TRACE}-00f067aa0ba902b{}-01", rate - n));
            }
            tx.enqueue(m).unwrap();
        }
        tx.commit().unwrap();
        let now = clock.now();
        let claimed = store.claim(&claim(now)).await.unwrap();
        let ids: Vec<outbox::MessageId> = claimed.iter().map(|m| m.id).collect();
        // Sixty a minute at most: the busy stretch leaves a backlog, which
        // drains after it; the newest message of the last minute waits.
        let (failing, rest) = ids.split_at(usize::from(minute % 7 == 3));
        let done = rest.len().min(60) - usize::from(minute == 59);
        let latency = 3 + minute % 9 * 4;
        store
            .complete(
                &rest[..done],
                now.saturating_add(Duration::from_millis(latency)),
            )
            .await
            .unwrap();
        store
            .release(&outbox::Release::new("seed", rest[done..].to_vec(), now))
            .await
            .unwrap();
        for id in failing {
            let max = if minute == 38 { 1 } else { 5 };
            let at = now.saturating_add(Duration::from_millis(20));
            store
                .fail(&outbox::Failure::new(
                    "seed",
                    *id,
                    "stock service said 503",
                    at,
                    max,
                    at,
                ))
                .await
                .unwrap();
        }
        clock.advance(Duration::from_secs(60));
    }
    (store, TRACE.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_activity_charts_and_a_saga_in_a_browser() {
    let driver = start_driver().await;
    let (store, trace) = an_hour_of_traffic().await;
    let served = Served::start(&store).await;
    let base = served.base.clone();
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, profile.path()).await;
    c.set_window_size(1000, 1420).await.unwrap();
    let dir = artifacts();

    // From the overview to the charts.
    c.goto(&format!("{base}/")).await.unwrap();
    c.find(Locator::LinkText("activity"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let note = text_of(&c, "p.note").await;
    assert!(note.contains("poisoned in the hour"), "{note}");
    // Three charts drawn, each with its lines, and no script on the page.
    let drawn = c
        .execute(
            "return [...document.querySelectorAll('figure.chart svg[role=img]')].map(s => \
             [s.getBoundingClientRect().width > 300, s.querySelectorAll('polyline').length])
             .concat([[document.scripts.length]])",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        drawn,
        json!([[true, 3], [true, 1], [true, 2], [0]]),
        "three visible charts: three lines, one, two"
    );
    std::fs::write(dir.join("activity.png"), c.screenshot().await.unwrap()).unwrap();

    // The saga view of the traced order.
    c.set_window_size(1200, 520).await.unwrap();
    c.goto(&format!("{base}/traces/{trace}")).await.unwrap();
    let saga = text_of(&c, "main table").await;
    assert_eq!(
        saga.matches("OrderPlaced").count(),
        3,
        "the trace's three messages: {saga}"
    );
    assert!(
        saga.contains("processed") && saga.contains("pending"),
        "{saga}"
    );
    std::fs::write(dir.join("saga.png"), c.screenshot().await.unwrap()).unwrap();

    c.close().await.unwrap();
    served.stop().await;
}
