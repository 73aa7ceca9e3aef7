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
    /// The file cannot be opened or mapped.
    #[error("{file}: cannot open or map the file: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error("{file}: not a GGUF file: magic at offset 0 is {found:02x?} (expected \"GGUF\")")]
    BadMagic { file: PathBuf, found: [u8; 4] },

    /// A version other than 2 or 3 (version 1, a future version, or a big-endian file).
    #[error("{file}: GGUF version {version} at offset {offset} is not supported (Strata reads versions 2 and 3{hint})")]
    UnsupportedVersion {
        file: PathBuf,
        version: u32,
        offset: u64,
        hint: &'static str,
    },

    /// The file ends inside a fixed-size field.
    #[error("{file}: truncated while reading {what}: needed {needed} bytes at offset {offset}, file has {file_bytes}")]
    Truncated {
        file: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_bytes: u64,
    },

    /// A string or array length larger than the bytes left in the file.
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

    /// A tensor or metadata count that cannot fit in the bytes left (rejected before allocating).
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

    /// A key, string value or tensor name that is not UTF-8.
    #[error("{file}: {what} at offset {offset} is not valid UTF-8 ({source})")]
    InvalidUtf8 {
        file: PathBuf,
        what: String,
        offset: u64,
        #[source]
        source: std::str::Utf8Error,
    },

    /// A metadata value type tag outside 0..=12.
    #[error("{file}: metadata key `{key}` at offset {offset} has unknown value type {type_id} (known: 0..=12)")]
    UnknownValueType {
        file: PathBuf,
        key: String,
        offset: u64,
        type_id: u32,
    },

    /// Arrays nested deeper than [`MAX_ARRAY_DEPTH`].
    #[error("{file}: metadata key `{key}`: arrays nested deeper than {max} levels at offset {offset}")]
    NestingTooDeep {
        file: PathBuf,
        key: String,
        offset: u64,
        max: usize,
    },

    /// A metadata key that appears twice.
    #[error("{file}: metadata key `{key}` at offset {offset} appears twice")]
    DuplicateKey { file: PathBuf, key: String, offset: u64 },

    /// `general.alignment` that is not an integer power of two in 1..=2^30.
    #[error("{file}: metadata key `{key}` at offset {offset}: {reason}")]
    BadAlignment {
        file: PathBuf,
        key: String,
        offset: u64,
        reason: String,
    },

    /// A tensor with more than [`MAX_DIMS`] dimensions.
    #[error("{file}: tensor `{tensor}` at offset {offset} has {n_dims} dimensions (at most {max})")]
    TooManyDims {
        file: PathBuf,
        tensor: String,
        offset: u64,
        n_dims: u32,
        max: usize,
    },

    /// A dimension above `i64::MAX` (negative as ggml reads it).
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

    /// Dimensions whose element count overflows `i64` or whose byte size overflows `u64`.
    #[error("{file}: tensor `{tensor}` at offset {offset}: dims {dims:?} overflow ({what})")]
    DimsOverflow {
        file: PathBuf,
        tensor: String,
        offset: u64,
        dims: Vec<u64>,
        what: &'static str,
    },

    /// A tensor type id that is not a ggml type (or a retired one).
    #[error("{file}: tensor `{tensor}` at offset {offset} has unknown ggml type id {type_id}")]
    UnknownTensorType {
        file: PathBuf,
        tensor: String,
        offset: u64,
        type_id: u32,
    },

    /// A row length that is not a whole number of the type's blocks.
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

    /// A tensor name that appears twice in one file.
    #[error("{file}: tensor `{tensor}` appears twice (second tensor info at offset {offset})")]
    DuplicateTensor { file: PathBuf, tensor: String, offset: u64 },

    /// A tensor data offset that is not a multiple of the alignment.
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

    /// Tensor data that runs past the end of the file (a truncated file, or a bad offset).
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

    /// Two tensors whose data ranges overlap.
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

    /// A shard of a set that does not exist on disk.
    #[error("{file}: shard {shard_no} of the set, {missing}, does not exist")]
    MissingShard {
        file: PathBuf,
        missing: PathBuf,
        shard_no: u64,
    },

    /// `split.*` keys that disagree with each other or with the file names.
    #[error("{file}: shard set metadata is inconsistent: key `{key}`: {reason}")]
    BadSplit { file: PathBuf, key: String, reason: String },

    /// `split.tensors.count` that differs from the number of tensors in the set.
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

    /// A tensor name found in two shards of a set.
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
    /// Creating, sizing or writing the file failed.
    #[error("{file}: write failed: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A tensor spec that cannot be written (duplicate name, too many dims, partial block, overflow).
    #[error("{file}: tensor `{tensor}` is not valid: {reason}")]
    BadTensor {
        file: PathBuf,
        tensor: String,
        reason: String,
    },

    /// Metadata that cannot be written (bad alignment, mixed-type array, nesting too deep).
    #[error("{file}: metadata key `{key}` is not valid: {reason}")]
    BadMetadata { file: PathBuf, key: String, reason: String },

    /// A tensor index or name that is not in the writer.
    #[error("{file}: no tensor {tensor} in this writer")]
    UnknownTensor { file: PathBuf, tensor: String },

    /// Tensor data whose length differs from the tensor's size in bytes.
    #[error("{file}: tensor `{tensor}` takes {expected} bytes but {given} were given")]
    WrongLength {
        file: PathBuf,
        tensor: String,
        expected: u64,
        given: u64,
    },

    /// A tensor written twice.
    #[error("{file}: tensor `{tensor}` was written twice")]
    WrittenTwice { file: PathBuf, tensor: String },

    /// Tensors never written when [`crate::gguf::GgufWriter::finish`] is called.
    #[error("{file}: {missing} tensor(s) never written, first `{tensor}`")]
    NotWritten {
        file: PathBuf,
        tensor: String,
        missing: usize,
    },
}
