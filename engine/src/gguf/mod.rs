//! GGUF files: reader (memmap2, zero-copy tensor data, shard sets), metadata, and writer.
//!
//! Source: the GGUF specification, ggml/docs/gguf.md (versions 2 and 3), and llama.cpp's `gguf-split` for the
//! shard-set convention (`NAME-0000k-of-0000n.gguf`, keys `split.no`, `split.count`, `split.tensors.count`).
//!
//! - [`GgufFile`]: one file, parsed and validated at open; tensor data is a slice of the memory map.
//! - [`GgufModel`]: the model view over one file or a whole shard set.
//! - [`GgufWriter`]: writes version-3 files, tensors in order or concurrently at precomputed offsets.

pub mod error;
pub mod reader;
pub mod shards;
pub mod value;
pub mod writer;

pub use error::{GgufError, GgufWriteError, MAX_ARRAY_DEPTH, MAX_DIMS};
pub use reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, GgufFile, GgufHeader, TensorInfo};
pub use shards::{GgufModel, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, parse_shard_path, shard_path};
pub use value::{Metadata, MetadataError, Value, ValueType};
pub use writer::{GgufWriter, TensorRef, TensorSpec, to_bytes, write_shard_set};
