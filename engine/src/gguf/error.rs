//! Errors from reading and writing GGUF files.
//!
//! Every reading error names the file, the metadata key or tensor involved, and the byte offset (from the start of
//! that file) where the bad field starts, so that `xxd -s OFFSET FILE` shows it.

use std::path::PathBuf;

/// Deepest array nesting the reader accepts (an array of arrays is depth 2). The spec allows nesting but sets no
/// limit; real files use depth 1, and a bound keeps recursion finite on hostile input.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// An error reading a GGUF file or shard set. Each variant names the file; parsing variants also name the key or
/// tensor and the byte offset of the faulty field.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: cannot open or map the file: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{file}: not a GGUF file: magic at offset 0 is {found:02x?} (expected \"GGUF\")")]
    BadMagic { file: PathBuf, found: [u8; 4] },

    #[error("{file}: GGUF version {version} at offset {offset} is not supported (Strata reads versions 2 and 3{hint})")]
    UnsupportedVersion {
        file: PathBuf,
        version: u32,
        offset: u64,
        hint: &'static str,
    },

    #[error("{file}: truncated while reading {what}: needed {needed} bytes at offset {offset}, file has {file_bytes}")]
    Truncated {
        file: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_bytes: u64,
    },

    #[error(
        "{file}: {what} at offset {offset} claims length {len} ({kind}), past the end of the file ({remaining} bytes left)"
    )]
    LengthPastEnd {
        file: PathBuf,
        what: String,
        kind: &'static str,
        offset: u64,
        len: u64,
        remaining: u64,
    },

    #[error(
        "{file}: {what} at offset {offset} is {count}, which cannot fit in the {remaining} bytes left (each entry takes at least {min_entry_bytes} bytes)"
    )]
    CountTooLarge {
        file: PathBuf,
        what: &'static str,
        offset: u64,
        count: u64,
        remaining: u64,
        min_entry_bytes: u64,
    },

    #[error("{file}: {what} at offset {offset} is not valid UTF-8 ({source})")]
    InvalidUtf8 {
        file: PathBuf,
        what: String,
        offset: u64,
        #[source]
        source: std::str::Utf8Error,
    },

    #[error("{file}: metadata key `{key}` at offset {offset} has unknown value type {type_id} (known: 0..=12)")]
    UnknownValueType {
        file: PathBuf,
        key: String,
        offset: u64,
        type_id: u32,
    },

    #[error("{file}: metadata key `{key}`: arrays nested deeper than {max} levels at offset {offset}")]
    NestingTooDeep {
        file: PathBuf,
        key: String,
        offset: u64,
        max: usize,
    },

    #[error("{file}: metadata key `{key}` at offset {offset} appears twice")]
    DuplicateKey { file: PathBuf, key: String, offset: u64 },

    #[error("{file}: metadata key `{key}` at offset {offset}: {reason}")]
    BadAlignment {
        file: PathBuf,
        key: String,
        offset: u64,
        reason: String,
    },

    #[error("{file}: tensor `{tensor}` at offset {offset} has {n_dims} dimensions (at most {max})")]
    TooManyDims {
        file: PathBuf,
        tensor: String,
        offset: u64,
        n_dims: u32,
        max: usize,
    },

    #[error(
        "{file}: tensor `{tensor}`: dimension {index} at offset {offset} is {dim}, above i64::MAX (negative in ggml)"
    )]
    DimOutOfRange {
        file: PathBuf,
        tensor: String,
        offset: u64,
        index: usize,
        dim: u64,
    },

    #[error("{file}: tensor `{tensor}` at offset {offset}: dims {dims:?} overflow ({what})")]
    DimsOverflow {
        file: PathBuf,
        tensor: String,
        offset: u64,
        dims: Vec<u64>,
        what: &'static str,
    },

    #[error("{file}: tensor `{tensor}` at offset {offset} has unknown ggml type id {type_id}")]
    UnknownTensorType {
        file: PathBuf,
        tensor: String,
        offset: u64,
        type_id: u32,
    },

    #[error(
        "{file}: tensor `{tensor}` at offset {offset}: row length {row_len} is not a whole number of {ty} blocks ({block_elems} elements each)"
    )]
    PartialBlock {
        file: PathBuf,
        tensor: String,
        offset: u64,
        row_len: u64,
        ty: crate::quant::types::GgmlType,
        block_elems: usize,
    },

    #[error("{file}: tensor `{tensor}` appears twice (second tensor info at offset {offset})")]
    DuplicateTensor { file: PathBuf, tensor: String, offset: u64 },

    #[error(
        "{file}: tensor `{tensor}` (tensor info at offset {offset}): data offset {data_offset} is not a multiple of the alignment {alignment}"
    )]
    UnalignedTensor {
        file: PathBuf,
        tensor: String,
        offset: u64,
        data_offset: u64,
        alignment: u64,
    },

    #[error(
        "{file}: tensor `{tensor}` (tensor info at offset {offset}): data spans file bytes {start}..{end}, past the end of the file ({file_bytes} bytes); the file may be truncated"
    )]
    TensorOutOfFile {
        file: PathBuf,
        tensor: String,
        offset: u64,
        start: u64,
        end: u64,
        file_bytes: u64,
    },

    #[error(
        "{file}: tensors `{tensor}` and `{other}` overlap: `{tensor}` starts at file offset {offset}, before `{other}` ends at {other_end}"
    )]
    OverlappingTensors {
        file: PathBuf,
        tensor: String,
        other: String,
        offset: u64,
        other_end: u64,
    },

    #[error("{file}: shard {shard_no} of the set, {missing}, does not exist")]
    MissingShard {
        file: PathBuf,
        missing: PathBuf,
        shard_no: u64,
    },

    #[error("{file}: shard set metadata is inconsistent: key `{key}`: {reason}")]
    BadSplit { file: PathBuf, key: String, reason: String },

    #[error(
        "{file}: metadata key `{key}` says the set holds {expected} tensors, but its {shards} shard(s) hold {found}"
    )]
    SplitTensorCount {
        file: PathBuf,
        key: String,
        expected: String,
        found: usize,
        shards: usize,
    },

    #[error("{file}: tensor `{tensor}` (tensor info at offset {offset}) is also in shard {first_file}")]
    DuplicateTensorAcrossShards {
        file: PathBuf,
        tensor: String,
        offset: u64,
        first_file: PathBuf,
    },
}

/// An error writing a GGUF file with [`crate::gguf::GgufWriter`].
#[derive(Debug, thiserror::Error)]
pub enum GgufWriteError {
    #[error("{file}: write failed: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{file}: tensor `{tensor}` is not valid: {reason}")]
    BadTensor {
        file: PathBuf,
        tensor: String,
        reason: String,
    },

    #[error("{file}: metadata key `{key}` is not valid: {reason}")]
    BadMetadata { file: PathBuf, key: String, reason: String },

    #[error("{file}: no tensor {tensor} in this writer")]
    UnknownTensor { file: PathBuf, tensor: String },

    #[error("{file}: tensor `{tensor}` takes {expected} bytes but {given} were given")]
    WrongLength {
        file: PathBuf,
        tensor: String,
        expected: u64,
        given: u64,
    },

    #[error("{file}: tensor `{tensor}` was written twice")]
    WrittenTwice { file: PathBuf, tensor: String },

    #[error("{file}: {missing} tensor(s) never written, first `{tensor}`")]
    NotWritten {
        file: PathBuf,
        tensor: String,
        missing: usize,
    },
}
