//! [`LogBuffer`]: somewhere for a test's log subscriber to write, and read
//! back (e.g. to check that no password was logged).

use std::sync::{Arc, Mutex};

/// Collects what is written to it (a `tracing_subscriber::fmt` writer:
/// `.with_writer(move || buffer.clone())`); clones share the buffer.
#[derive(Debug, Clone, Default)]
pub struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    /// A buffer that gets every event at every level logged on this thread
    /// (plain text, no colours) until the guard is dropped.
    pub fn capture_all() -> (LogBuffer, tracing::subscriber::DefaultGuard) {
        let logs = LogBuffer::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// Everything written so far, as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
