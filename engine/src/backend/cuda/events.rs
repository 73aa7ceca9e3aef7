//! The CUDA backend's structured events (DESIGN.md section 3): `fault` (kernel, launch shape, call number,
//! error) and `fallback` (what failed and what runs instead). Each is one human line on stderr and goes to the
//! process's sink: the serve worker installs one that forwards them over its protocol and into its `--events`
//! file, like its own events.

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
    if let Some(sink) = SINK.get() {
        sink(&ev);
    }
}
