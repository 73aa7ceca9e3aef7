//! Regression inputs for the GGUF reader: every file in fixtures/gguf-crashes/ (inputs that once panicked,
//! overflowed or over-allocated, found by fuzz/) must parse to an error, without a panic.

use std::path::Path;

use strata_engine::gguf::{GgufFile, GgufHeader};

#[test]
fn crash_inputs_are_errors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/gguf-crashes");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let err = GgufHeader::parse(&name, &bytes).expect_err(&name);
        assert!(err.to_string().contains(&name), "{err}");
        assert!(GgufFile::from_bytes(&name, bytes).is_err(), "{name}");
        checked += 1;
    }
    eprintln!("{checked} crash inputs checked");
}
