//! Helpers the CLI test files share: reading a finished `outbox` run.

#![allow(dead_code)]

use std::process::Output;

use serde_json::Value;

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Succeeded; returns stdout.
#[track_caller]
pub fn assert_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        stdout(out),
        stderr(out)
    );
    stdout(out)
}

/// Stdout as JSON.
#[track_caller]
pub fn json_of(out: &Output) -> Value {
    let text = stdout(out);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Failed with `code`, one `error:` line on stderr naming `needle`, no panic.
#[track_caller]
pub fn assert_error(out: &Output, code: i32, needle: &str) {
    let err = stderr(out);
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout: {}\nstderr: {err}",
        stdout(out)
    );
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "want one line on stderr, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(needle), "want `{needle}` in: {err}");
}
