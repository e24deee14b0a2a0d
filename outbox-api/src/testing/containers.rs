//! The container step of service discovery (feature `containers`): when a
//! test needs a server that no variable names and no local port answers
//! for, and a Docker engine answers, the server runs in a container started
//! through [testcontainers](https://docs.rs/testcontainers).
//!
//! - **The engine**: `DOCKER_HOST`, else the platform's default socket
//!   (bollard's defaults, as testcontainers uses them).
//! - **The image**: the service's variable (`OUTBOX_PG_IMAGE`, …), else the
//!   official image ([`ContainerSpec::image`]). A tag present locally is
//!   used as it is; testcontainers pulls one that is not.
//! - **The network**: ports published on loopback when the engine has a
//!   `bridge` network (Docker Desktop, a stock engine); host networking
//!   when it has none (an engine started with `--bridge=none`, as
//!   `scripts/docker-engine` starts one on machines that must keep off
//!   private-range networks). `OUTBOX_CONTAINER_NETWORK=host|bridge`
//!   overrides. Either way the server's ports are free ports of loopback
//!   chosen here, so containers never collide with each other or with
//!   a local server.
//! - **One container per service and image, shared**: the container is
//!   named after both (`outbox-test-postgresql-postgres-15`) and labelled
//!   with its URL; every test process of a run (and of later runs) uses the
//!   one that is running, as tests share a local server, each test in names
//!   of its own. It stays after the tests, ready for the next run; `docker
//!   rm -f` of its name removes it (`scripts/docker-engine stop` removes
//!   every container of the engine it started). Processes that race to
//!   start it wait for the one that wins.

use std::io::Write;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use testcontainers::bollard::Docker;
use testcontainers::bollard::models::ContainerStateStatusEnum;
use testcontainers::bollard::query_parameters::{
    KillContainerOptions, LogsOptions, RemoveContainerOptions, RestartContainerOptions,
};
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::SyncRunner;
use testcontainers::{Container, GenericImage, ImageExt};

use super::services::{ContainerSpec, ServiceSpec};

/// The label holding a container's URL.
const URL_LABEL: &str = "outbox-test.url";
/// How long a container may take to print its ready line.
const STARTUP: Duration = Duration::from_secs(180);

/// Why the container step could not give a URL.
#[derive(Debug)]
pub enum Unavailable {
    /// No Docker engine answered (the step does not apply).
    NoEngine(String),
    /// An engine answered but the container did not come up.
    Failed(String),
}

/// The URL of `spec`'s server in a container: the running one of its name,
/// else one started now.
pub fn url(spec: &ServiceSpec) -> Result<String, Unavailable> {
    // testcontainers' blocking runner and bollard run on runtimes of their
    // own, which cannot start inside a test's runtime: a thread of its own.
    apart(|| start_or_reuse(spec))
        .unwrap_or_else(|| Err(Unavailable::Failed("the container step panicked".into())))
}

/// Runs `f` on a thread of its own and waits for it; `None` if it panicked.
/// testcontainers' blocking runner and the Docker client's runtime cannot
/// start inside a test's runtime, from which the tests call all of this.
fn apart<T: Send>(f: impl FnOnce() -> T + Send) -> Option<T> {
    std::thread::scope(|scope| scope.spawn(f).join().ok())
}

/// The image for `spec`: its variable, else the official image.
pub fn image(spec: &ContainerSpec) -> String {
    std::env::var(spec.image_variable)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| spec.image.to_owned())
}

/// The container's name for a service and image: `outbox-test-{service}-{image}`
/// with every character Docker does not allow in a name made `-`.
pub fn container_name(service: &str, image: &str) -> String {
    let clean = |s: &str| {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect::<String>()
    };
    format!("outbox-test-{}-{}", clean(service), clean(image))
}

/// `template` with `{port}` and `{port1}` … replaced by `ports` in order
/// and `{host}` by `host`.
pub fn fill(template: &str, host: &str, ports: &[u16]) -> String {
    let mut out = template.replace("{host}", host);
    // Longest placeholders first, so `{port1}` is not read as `{port}1`.
    for (i, port) in ports.iter().enumerate().rev() {
        let key = if i == 0 {
            "{port}".to_owned()
        } else {
            format!("{{port{i}}}")
        };
        out = out.replace(&key, &port.to_string());
    }
    out
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("a runtime for the Docker client: {e}"))
}

/// A Docker client (`DOCKER_HOST`, else the default socket).
fn client() -> Result<Docker, String> {
    Docker::connect_with_defaults().map_err(|e| format!("no Docker client configuration: {e}"))
}

/// Whether the engine answers, within 5 s; `Err` says where it was asked.
async fn ping(docker: &Docker) -> Result<(), String> {
    let answer = tokio::time::timeout(Duration::from_secs(5), docker.ping()).await;
    let why = match answer {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 5 s".to_owned(),
    };
    Err(format!(
        "no Docker engine answered at {} ({why})",
        std::env::var("DOCKER_HOST").unwrap_or_else(|_| "the default socket".into())
    ))
}

/// Everything the container `name` printed, both streams, every start.
async fn log_text(docker: &Docker, name: &str) -> Result<String, String> {
    let mut logs = docker.logs(
        name,
        Some(LogsOptions {
            stdout: true,
            stderr: true,
            ..Default::default()
        }),
    );
    let mut text = String::new();
    while let Some(chunk) = logs.next().await {
        let chunk = chunk.map_err(|e| format!("the logs of {name}: {e}"))?;
        text.push_str(&String::from_utf8_lossy(&chunk.into_bytes()));
    }
    Ok(text)
}

fn start_or_reuse(spec: &ServiceSpec) -> Result<String, Unavailable> {
    let rt = runtime().map_err(Unavailable::Failed)?;
    let docker = client().map_err(Unavailable::NoEngine)?;
    rt.block_on(ping(&docker)).map_err(Unavailable::NoEngine)?;
    let c = &spec.container;
    let image = image(c);
    let name = container_name(spec.name, &image);
    let deadline = Instant::now() + STARTUP;
    loop {
        if let Some(url) = rt.block_on(running_url(&docker, &name, c.ready, deadline))? {
            wait_until_it_answers(&url, deadline).map_err(Unavailable::Failed)?;
            say(&format!(
                "services: {} — reusing container {name} (image {image}) at {url}",
                spec.name
            ));
            return Ok(url);
        }
        let host_network = rt.block_on(host_networking(&docker))?;
        match launch(spec, &image, &name, host_network, &[]) {
            Ok((container, url)) => {
                // The container outlives this process, shared with the
                // run's other test processes and with later runs (see the
                // module's documentation): dropping the handle would remove it.
                std::mem::forget(container);
                return Ok(url);
            }
            // Another process started one of that name first: use it once it is up.
            Err(e) if e.contains("Conflict") || e.contains("already in use") => {
                if Instant::now() > deadline {
                    return Err(Unavailable::Failed(e));
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => return Err(Unavailable::Failed(e)),
        }
    }
}

/// The URL of the container named `name` once it runs and has printed
/// `ready`; `None` if there is none. A stopped one is removed (it cannot be
/// trusted to come back on the same ports).
async fn running_url(
    docker: &Docker,
    name: &str,
    ready: &str,
    deadline: Instant,
) -> Result<Option<String>, Unavailable> {
    loop {
        let Ok(found) = docker.inspect_container(name, None).await else {
            return Ok(None);
        };
        let state = found.state.as_ref();
        let running = state.and_then(|s| s.running).unwrap_or(false);
        let created = state.and_then(|s| s.status) == Some(ContainerStateStatusEnum::CREATED);
        let url = found
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(URL_LABEL).cloned());
        match (running || created, url) {
            (true, Some(url)) => {
                // Another process may have started it a moment ago: its
                // server is up once its log holds the ready line.
                if running
                    && log_text(docker, name)
                        .await
                        .is_ok_and(|t| t.contains(ready))
                {
                    return Ok(Some(url));
                }
                if Instant::now() > deadline {
                    return Err(Unavailable::Failed(format!(
                        "container {name} never printed {ready:?}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            _ => {
                docker
                    .remove_container(
                        name,
                        Some(RemoveContainerOptions {
                            force: true,
                            ..Default::default()
                        }),
                    )
                    .await
                    .map_err(|e| {
                        Unavailable::Failed(format!("removing the stopped container {name}: {e}"))
                    })?;
                return Ok(None);
            }
        }
    }
}

/// Whether containers should use the host's network: the variable, else
/// whether the engine lacks a `bridge` network.
async fn host_networking(docker: &Docker) -> Result<bool, Unavailable> {
    match std::env::var("OUTBOX_CONTAINER_NETWORK").ok().as_deref() {
        Some("host") => return Ok(true),
        Some("bridge") => return Ok(false),
        Some(other) if !other.trim().is_empty() => {
            return Err(Unavailable::Failed(format!(
                "OUTBOX_CONTAINER_NETWORK={other}: expected `host` or `bridge`"
            )));
        }
        _ => {}
    }
    Ok(docker.inspect_network("bridge", None).await.is_err())
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("choosing a free port: {e}"))
}

/// A container of `spec`'s server named `name`, started and answering:
/// its handle (dropping it removes the container) and URL. `extra_cmd`
/// follows the image's arguments.
fn launch(
    spec: &ServiceSpec,
    image: &str,
    name: &str,
    host_network: bool,
    extra_cmd: &[&str],
) -> Result<(Container<GenericImage>, String), String> {
    let c = &spec.container;
    let host_ports = (0..=c.extra_ports)
        .map(|_| free_port())
        .collect::<Result<Vec<_>, _>>()?;
    // On a host network the server listens on the free ports themselves; on
    // a bridge its own ports are published on the free ones.
    let inner_ports: Vec<u16> = if host_network {
        host_ports.clone()
    } else {
        std::iter::once(c.port)
            .chain(host_ports[1..].iter().copied())
            .collect()
    };
    let url = fill(c.url, "127.0.0.1", &host_ports);
    let (repo, tag) = match image.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, t),
        _ => (image, "latest"),
    };
    let mut generic =
        GenericImage::new(repo, tag).with_wait_for(WaitFor::message_on_either_std(c.ready));
    if !host_network {
        generic = generic.with_exposed_port(c.port.tcp());
    }
    let mut request = generic
        .with_container_name(name)
        .with_label(URL_LABEL, url.clone())
        .with_label("outbox-test.service", spec.name)
        .with_startup_timeout(STARTUP);
    for (key, value) in c.env {
        request = request.with_env_var(*key, fill(value, "127.0.0.1", &inner_ports));
    }
    if !c.cmd.is_empty() || !extra_cmd.is_empty() {
        let cmd = c.cmd.iter().chain(extra_cmd);
        request = request.with_cmd(cmd.map(|a| fill(a, "127.0.0.1", &inner_ports)));
    }
    request = if host_network {
        request.with_network("host")
    } else {
        request.with_mapped_port(host_ports[0], c.port.tcp())
    };
    let started = Instant::now();
    let container = request
        .start()
        .map_err(|e| format!("starting {name} from image {image}: {e}"))?;
    let id = container.id().to_owned();
    wait_until_it_answers(&url, Instant::now() + STARTUP)?;
    say(&format!(
        "services: {} — started container {name} ({}) from image {image} on {} network in {:.1} s: {url}",
        spec.name,
        &id[..id.len().min(12)],
        if host_network { "the host" } else { "a bridge" },
        started.elapsed().as_secs_f64()
    ));
    Ok((container, url))
}

/// A server in a container of a test's own, for a test that crashes or
/// restarts it (never the shared one): a fresh name, its own free ports,
/// removed when dropped (also when the test panics).
///
/// Every method runs on a thread of its own, so it may be called from a
/// test's runtime (inside `block_in_place`) as from plain code.
pub struct OwnContainer {
    name: String,
    url: String,
    ready: &'static str,
    container: Option<Container<GenericImage>>,
}

impl std::fmt::Debug for OwnContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnContainer")
            .field("name", &self.name)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Runs `f` with a Docker client on a current-thread runtime, on a thread
/// of its own ([`apart`]).
fn with_docker<T: Send>(
    f: impl FnOnce(&tokio::runtime::Runtime, &Docker) -> Result<T, String> + Send,
) -> Result<T, String> {
    apart(|| f(&runtime()?, &client()?)).unwrap_or_else(|| Err("a Docker call panicked".into()))
}

impl OwnContainer {
    /// Starts `spec`'s server (its image as [`image`] chooses) in a new
    /// container with `extra_cmd` after the image's arguments, and waits
    /// until it answers. `Err` says why: no engine, or the start failed.
    pub fn start_new(spec: &ServiceSpec, extra_cmd: &[&str]) -> Result<Self, String> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let image = image(&spec.container);
        let name = format!(
            "{}-own-{}-{}",
            container_name(spec.name, &image),
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        let host_network = with_docker(|rt, docker| {
            rt.block_on(async {
                ping(docker).await?;
                host_networking(docker).await.map_err(|e| format!("{e:?}"))
            })
        })?;
        let (container, url) = apart(|| launch(spec, &image, &name, host_network, extra_cmd))
            .unwrap_or_else(|| Err("starting the container panicked".into()))?;
        Ok(Self {
            name,
            url,
            ready: spec.container.ready,
            container: Some(container),
        })
    }

    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The container's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Everything the server printed so far, both streams, every start.
    pub fn logs(&self) -> Result<String, String> {
        with_docker(|rt, docker| rt.block_on(log_text(docker, &self.name)))
    }

    /// Crashes the server: SIGKILL to the container's first process, so
    /// every process of the container ends at once, as in a power cut of
    /// the server alone.
    pub fn crash(&self) -> Result<(), String> {
        with_docker(|rt, docker| {
            rt.block_on(docker.kill_container(
                &self.name,
                Some(KillContainerOptions {
                    signal: "SIGKILL".into(),
                }),
            ))
            .map_err(|e| format!("killing {}: {e}", self.name))?;
            // Wait until the engine has seen it end.
            rt.block_on(async {
                let deadline = Instant::now() + STARTUP;
                loop {
                    let running = docker
                        .inspect_container(&self.name, None)
                        .await
                        .ok()
                        .and_then(|c| c.state.and_then(|s| s.running))
                        .unwrap_or(false);
                    if !running {
                        return Ok(());
                    }
                    if Instant::now() > deadline {
                        return Err(format!("{} still runs after SIGKILL", self.name));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        })
    }

    /// Starts the container again (after [`crash`](Self::crash)) and waits
    /// until the server has printed its ready line once more and answers.
    pub fn start(&self) -> Result<(), String> {
        let before = self.logs()?.matches(self.ready).count();
        with_docker(|rt, docker| {
            rt.block_on(docker.start_container(&self.name, None))
                .map_err(|e| format!("starting {} again: {e}", self.name))
        })?;
        self.wait_for_ready_line(before)
    }

    /// Restarts the server cleanly (SIGTERM, then a start) and waits until
    /// it answers again.
    pub fn restart(&self) -> Result<(), String> {
        let before = self.logs()?.matches(self.ready).count();
        with_docker(|rt, docker| {
            rt.block_on(docker.restart_container(
                &self.name,
                Some(RestartContainerOptions {
                    t: Some(30),
                    ..Default::default()
                }),
            ))
            .map_err(|e| format!("restarting {}: {e}", self.name))
        })?;
        self.wait_for_ready_line(before)
    }

    fn wait_for_ready_line(&self, before: usize) -> Result<(), String> {
        let deadline = Instant::now() + STARTUP;
        while self.logs()?.matches(self.ready).count() <= before {
            if Instant::now() > deadline {
                return Err(format!(
                    "{} did not print {:?} again within {STARTUP:?}",
                    self.name, self.ready
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        wait_until_it_answers(&self.url, deadline)
    }
}

impl Drop for OwnContainer {
    fn drop(&mut self) {
        if let Some(container) = self.container.take() {
            // Removing it runs testcontainers' own runtime: on a thread of its own.
            apart(move || drop(container));
        }
    }
}

/// Waits until the server in `url` accepts TCP connections (a server that
/// initialises first, as PostgreSQL's image does, prints its ready line
/// before it listens on TCP).
fn wait_until_it_answers(url: &str, deadline: Instant) -> Result<(), String> {
    let authority = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .map(|a| a.rsplit('@').next().unwrap_or(a))
        .ok_or_else(|| format!("no host and port in {url}"))?;
    let addr = authority
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("cannot resolve {authority}"))?;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the container's server never answered on {addr}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A line for the run's log, past the test harness's capture (which takes
/// only `print!` and `eprint!`), so that CI shows where each server came from.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_templates() {
        assert_eq!(
            container_name("PostgreSQL", "outbox-local/postgres:15"),
            "outbox-test-postgresql-outbox-local-postgres-15"
        );
        assert_eq!(
            fill("-p {port} -d {port1} {port}", "h", &[5, 6]),
            "-p 5 -d 6 5"
        );
        assert_eq!(
            fill("amqp://g:g@{host}:{port}/%2f", "127.0.0.1", &[7]),
            "amqp://g:g@127.0.0.1:7/%2f"
        );
    }
}
