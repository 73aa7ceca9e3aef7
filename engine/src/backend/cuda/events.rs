//! The CUDA backend's structured events (DESIGN.md section 3): `fault` (kernel, launch shape, call number,
//! error) and `fallback` (what failed and what runs instead). Each is one JSON line appended to the file named by
//! `STRATA_EVENTS` (when set) and one human line on stderr; a process can also install a sink (the serve worker
//! forwards them over its protocol).

use std::io::Write;
use std::sync::OnceLock;

use crate::serve::protocol::Event;

type Sink = Box<dyn Fn(&Event) + Send + Sync>;
static SINK: OnceLock<Sink> = OnceLock::new();

/// Installs the process's event sink (first call wins; later calls are ignored).
pub fn set_sink(f: impl Fn(&Event) + Send + Sync + 'static) {
    let _ = SINK.set(Box::new(f));
}

/// Emits an event of `kind` with `fields`, and `human` as the stderr line.
pub fn emit(kind: &str, fields: serde_json::Value, human: &str) {
    let ev = Event::now(kind, fields);
    eprintln!("strata: {kind}: {human}");
    if let Some(path) = std::env::var_os("STRATA_EVENTS")
        && let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path)
        && let Ok(line) = serde_json::to_string(&ev)
    {
        let _ = writeln!(f, "{line}");
    }
    if let Some(sink) = SINK.get() {
        sink(&ev);
    }
}
