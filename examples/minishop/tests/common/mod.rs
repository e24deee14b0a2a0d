//! What the end-to-end tests of the `minishop` binary share: running it
//! (with a deadline), reading its summary, and talking to its HTTP API.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_minishop");

pub struct Finished {
    pub status: ExitStatus,
    #[allow(dead_code)] // read by some of the test crates sharing this module
    pub stdout: String,
    pub stderr: String,
}

pub fn minishop() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("OUTBOX_AMQP_URL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

pub fn drain(r: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(r).read_to_string(&mut s);
        s
    })
}

/// Waits for the child to exit, killing it (and failing) at the deadline.
pub fn wait(mut child: Child, limit: Duration) -> Finished {
    let out = child.stdout.take().map(drain);
    let err = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "minishop did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                out.map(|o| o.join().unwrap_or_default())
                    .unwrap_or_default(),
                err.join().unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(10));
    };
    Finished {
        status,
        stdout: out
            .map(|o| o.join().unwrap_or_default())
            .unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// A tiny HTTP/1.1 client: (status, body).
pub fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    http_with(addr, method, path, body, "")
}

/// [`http`] with more header lines (each ending in `\r\n`).
pub fn http_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to minishop");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// [`serve_http`] with more arguments and variables.
pub fn serve_http_with(
    dir: &std::path::Path,
    args: &[&str],
    vars: &[(&str, &str)],
) -> (Child, String) {
    let mut child = minishop()
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(args)
        .envs(vars.iter().copied())
        .env_remove("OUTBOX_CONSOLE_TOKEN")
        .spawn()
        .expect("start minishop");
    // The first stdout line says where it listens.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(line) => line,
        Err(_) => {
            let _ = child.kill();
            panic!("minishop did not say where it listens within 30 s");
        }
    };
    let addr = line
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .trim()
        .to_owned();
    (child, addr)
}

/// Stops MiniShop with Ctrl-C and checks that it stopped gracefully;
/// returns what it printed.
pub fn interrupt(child: Child) -> Finished {
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let f = wait(child, Duration::from_secs(30));
    assert!(f.status.success(), "exit {:?}\n{}", f.status, f.stderr);
    assert!(f.stderr.contains("MiniShop stopped."), "{}", f.stderr);
    f
}
