//! Test helpers (feature `testing`): the server URL from the environment,
//! names no other test uses, and a `nats-server` of a test's own to stop
//! and restart.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The NATS server the tests use: `OUTBOX_NATS_URL`, else the local default
/// `nats://127.0.0.1:4222` if it answers. It needs JetStream (`-js`).
pub const NATS: outbox_api::testing::ServiceSpec = outbox_api::testing::ServiceSpec {
    name: "NATS",
    variable: crate::URL_ENV,
    local_url: "nats://127.0.0.1:4222",
    local_addr: ([127, 0, 0, 1], 4222),
    setup: "started with JetStream: nats-server -js",
    container: outbox_api::testing::ContainerSpec {
        image_variable: "OUTBOX_NATS_IMAGE",
        image: "nats:2",
        port: 4222,
        extra_ports: 0,
        env: &[],
        cmd: &["-js", "-p", "{port}", "-sd", "/tmp/nats"],
        ready: "Server is ready",
        url: "nats://{host}:{port}",
    },
};

/// The server for a test ([`NATS`]).
///
/// # Panics
/// When there is none (tests that need a server fail, never skip), with a
/// message saying how to provide one.
pub fn nats_url() -> String {
    outbox_api::testing::service_url(&NATS)
}

/// A name no other test uses, fit for a stream, a consumer or a subject
/// token: `T_{prefix}_{uuid v7 without dashes}`.
pub fn unique_name(prefix: &str) -> String {
    format!(
        "T_{prefix}_{}",
        outbox_api::MessageId::new().to_string().replace('-', "")
    )
}

/// The socket address of the server in `url`.
///
/// # Panics
/// When the URL does not parse or its host does not resolve.
pub fn server_addr(url: &str) -> SocketAddr {
    use std::net::ToSocketAddrs;
    let addr: async_nats::ServerAddr = url.parse().expect("the NATS URL parses");
    (addr.host(), addr.port())
        .to_socket_addrs()
        .expect("resolving the NATS host")
        .next()
        .expect("the NATS host has an address")
}

/// A `nats-server -js` of a test's own, on a free port of `127.0.0.1`,
/// storing into a directory of its own, for tests that stop and restart the
/// server (never the shared one). Stopped when dropped.
///
/// With the feature `containers`, the server is a container of the test's
/// own instead (its store inside the container, kept across a kill) when
/// `OUTBOX_TEST_SERVICES=containers`, or when no `nats-server` is installed
/// and a Docker engine answers.
#[derive(Debug)]
pub struct OwnNats {
    port: u16,
    store: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    #[cfg(feature = "containers")]
    container: Option<OwnContainer>,
}

#[cfg(feature = "containers")]
use outbox_api::testing::containers::OwnContainer;

/// A container for [`OwnNats`], if one is wanted and can be had: `Err`
/// when one is wanted (or needed) and cannot be started.
#[cfg(feature = "containers")]
fn own_container() -> Option<OwnContainer> {
    use outbox_api::testing::services::Mode;
    let forced = Mode::from_env().unwrap_or_else(|e| panic!("{e}")) == Mode::Containers;
    let installed = Command::new("nats-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !forced && installed {
        return None;
    }
    match OwnContainer::start_new(&NATS, &[]) {
        Ok(c) => Some(c),
        Err(e) if forced => panic!("a NATS container of the test's own: {e}"),
        Err(e) => panic!(
            "this test runs a NATS server of its own: install nats-server (Debian: apt-get \
             install nats-server) or run a Docker engine for a container ({e})"
        ),
    }
}

impl OwnNats {
    /// Starts one under `dir` (its JetStream store and log go there) and
    /// waits until it accepts connections.
    ///
    /// # Panics
    /// When `nats-server` is not installed (the message says how to install
    /// it) or does not start within 20 s.
    pub fn start(dir: &Path) -> OwnNats {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        #[cfg(feature = "containers")]
        if let Some(container) = own_container() {
            let port = server_addr(container.url()).port();
            return OwnNats {
                port,
                store: dir.join("jetstream"),
                log: dir.join("nats-server.log"),
                child: None,
                container: Some(container),
            };
        }
        let mut own = OwnNats {
            port,
            store: dir.join("jetstream"),
            log: dir.join("nats-server.log"),
            child: None,
            #[cfg(feature = "containers")]
            container: None,
        };
        own.restart();
        own
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Stops it at once (SIGKILL): what it had not written to its store is
    /// gone, as in a crash.
    pub fn kill(&mut self) {
        #[cfg(feature = "containers")]
        if let Some(c) = &self.container {
            // Already ended is fine: a kill of a stopped server is a no-op.
            let _ = c.crash();
            return;
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again (after [`kill`](Self::kill)) on the same port and
    /// store, and waits until it accepts connections.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub fn restart(&mut self) {
        self.kill();
        #[cfg(feature = "containers")]
        if let Some(c) = &self.container {
            c.start()
                .unwrap_or_else(|e| panic!("starting the NATS container again: {e}"));
            return;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("the server's log file");
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run nats-server ({e}); install it (Debian: apt-get install nats-server) \
                     to run the tests that stop and restart a server of their own"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server on port {} did not start within 20 s; its log:\n{}",
                self.port,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Declares, through `transport`, a consumer test's two streams: `name`,
/// capturing `{name}.>` (its spec as `adjust` makes it), and `{name}_DEAD`,
/// capturing `{name}-dead.>`, for the consumer's dead letters.
///
/// # Panics
/// When the server refuses either.
pub async fn declare_consumer_streams(
    transport: &crate::NatsTransport,
    name: &str,
    adjust: impl FnOnce(crate::StreamSpec) -> crate::StreamSpec,
) {
    transport
        .declare(&adjust(crate::StreamSpec::new(name, [format!("{name}.>")])))
        .await
        .expect("declare the test's stream");
    transport
        .declare(&crate::StreamSpec::new(
            format!("{name}_DEAD"),
            [format!("{name}-dead.>")],
        ))
        .await
        .expect("declare the test's dead-letter stream");
}

/// A stream of a test's own on the shared server (memory storage),
/// capturing `{name}.>`, read back message by message.
#[derive(Debug)]
pub struct TestStream {
    /// Its name, also its subjects' first token.
    pub name: String,
    /// A JetStream context on its own connection.
    pub js: async_nats::jetstream::Context,
}

impl TestStream {
    /// Creates one named `unique_name(prefix)` on the server at [`nats_url`].
    ///
    /// # Panics
    /// When the server cannot be reached or refuses the stream.
    pub async fn new(prefix: &str) -> TestStream {
        use async_nats::jetstream;
        let name = unique_name(prefix);
        let client = async_nats::connect(nats_url())
            .await
            .expect("connect to NATS");
        let js = jetstream::new(client);
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("create the test's stream");
        TestStream { name, js }
    }

    /// The stored messages, in stream order.
    ///
    /// # Panics
    /// When the stream cannot be read.
    pub async fn stored(&self) -> Vec<async_nats::jetstream::message::StreamMessage> {
        let mut stream = self.js.get_stream(&self.name).await.expect("the stream");
        let last = stream
            .info()
            .await
            .expect("stream info")
            .state
            .last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = stream.get_raw_message(seq).await {
                out.push(m);
            }
        }
        out
    }

    /// The outbox ids (`Nats-Msg-Id`) of the stored messages, in order.
    pub async fn ids(&self) -> Vec<outbox_api::MessageId> {
        self.stored()
            .await
            .iter()
            .filter_map(|m| header(&m.headers, crate::MSG_ID_HEADER))
            .filter_map(|v| v.parse().ok())
            .collect()
    }

    /// Deletes it.
    pub async fn delete(&self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// A header's value; `name` is parsed as the wire's names are
/// (`Nats-Msg-Id` is one of the client's standard names, which a plain
/// string lookup would miss).
pub fn header(h: &async_nats::HeaderMap, name: &str) -> Option<String> {
    let name: async_nats::HeaderName = name.parse().ok()?;
    h.get(name).map(|v| v.as_str().to_owned())
}
