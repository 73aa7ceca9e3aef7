//! Regression inputs for the GGUF reader, in fixtures/gguf-crashes/ (see its README.md): every file must parse to
//! an error naming the file, never a panic. `crash-*` files once crashed the reader; `hostile-VARIANT.gguf` files
//! are the smallest fuzz inputs that reached each error, and must keep giving that variant.

use std::path::Path;

use strata_engine::gguf::{GgufFile, GgufHeader};

#[test]
fn crash_and_hostile_inputs_are_errors() {
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
        if let Some(variant) = name.strip_prefix("hostile-").and_then(|n| n.strip_suffix(".gguf")) {
            let debug = format!("{err:?}");
            assert!(debug.starts_with(&format!("{variant} ")), "{name}: got {debug}");
        }
        assert!(GgufFile::from_bytes(&name, bytes).is_err(), "{name}");
        checked += 1;
    }
    assert!(checked >= 17, "only {checked} inputs in {}", dir.display());
}
