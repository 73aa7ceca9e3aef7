//! GGUF files: reader (memmap2, zero-copy tensor data, shard sets), metadata, and writer.
//!
//! Source: the GGUF specification, ggml/docs/gguf.md (versions 2 and 3).

pub mod value;

pub use value::{Metadata, MetadataError, Value, ValueType};
