//! Parses arbitrary bytes as a GGUF file: it must return Ok or Err, never panic, and an Ok file must hand out
//! tensor data slices of exactly each tensor's size.
#![no_main]

#[allow(dead_code)]
#[path = "../../engine/src/gguf/mod.rs"]
mod gguf;

#[allow(dead_code)]
#[path = "../../engine/src/quant/types.rs"]
pub mod ggml_types;

// The gguf module names the type table `crate::quant::types`, as in the engine.
mod quant {
    pub use super::ggml_types as types;
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let header = gguf::GgufHeader::parse("fuzz-input.gguf", data);
    let file = gguf::GgufFile::from_bytes("fuzz-input.gguf", data.to_vec());
    assert_eq!(header.is_ok(), file.is_ok());
    if let Ok(file) = file {
        for t in file.tensors() {
            assert_eq!(file.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
            assert_eq!(t.n_elements(), t.dims.iter().product::<u64>());
        }
        let _ = file.metadata().alignment();
    }
});
