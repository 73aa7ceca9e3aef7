//! The GGUF reader: one file, parsed over a byte slice (a memory map or an owned buffer), tensor data zero-copy.
//!
//! Source: the GGUF specification, "File Structure" (ggml/docs/gguf.md). Layout, all little-endian:
//! `"GGUF"`, `u32` version, `u64` tensor count, `u64` metadata count, the metadata key-value pairs, the tensor
//! infos, padding to `general.alignment`, then the data section holding every tensor at its aligned offset.
//!
//! The parser trusts nothing: every length and count is checked against the bytes left before anything is
//! allocated, so a hostile or damaged file gives a [`GgufError`] and never a panic or a huge allocation.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use super::error::{GgufError, MAX_ARRAY_DEPTH, MAX_DIMS};
use super::value::{Metadata, Value, ValueType};
use crate::quant::types::GgmlType;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version the writer produces. Version 2 has the same layout and is read too.
pub const GGUF_VERSION: u32 = 3;
/// Alignment of the data section and of every tensor when `general.alignment` is absent, in bytes.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Smallest encoding of one metadata key-value pair: key length, value type, a one-byte value (bytes).
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoding of one tensor info: name length, `n_dims`, type, offset (bytes).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// One tensor as described by its tensor info.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the row length (the contiguous one). At most 4; may be empty
    /// (a scalar) or hold zeros (an empty tensor).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Start of the tensor's data in bytes, relative to the data section of its file (see
    /// [`GgufFile::data_offset`]). A multiple of the file's alignment.
    pub offset: u64,
    /// Size of the tensor's data in bytes (rows × [`GgmlType::row_bytes`] of a row), without padding.
    pub n_bytes: u64,
    /// Index of the file holding the data within its shard set; 0 for a plain file.
    pub shard: usize,
}

impl TensorInfo {
    /// Number of elements (product of the dims; 1 for a tensor with no dims).
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time (and by the writer) not to overflow.
        self.dims.iter().product()
    }
}

/// The bytes of a file: mapped, or held in memory (for [`GgufFile::from_bytes`] and empty files).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One GGUF file (version 2 or 3): metadata, tensor infos, and zero-copy access to tensor data.
///
/// Opening parses and validates the whole header and the position of every tensor's data; it does not read the
/// data. For a model split across shards use [`crate::gguf::GgufModel`].
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    header: GgufHeader,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata_entries", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .field("data_offset", &self.header.data_offset)
            .field("file_bytes", &self.file_bytes())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    ///
    /// The map is read-only; as with any memory map, the file must not be truncated or rewritten while this
    /// value lives. Errors: [`GgufError::Io`] when the file cannot be opened or mapped, otherwise the parsing
    /// errors of [`GgufFile::from_bytes`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        Self::open_shard(path.as_ref(), 0)
    }

    pub(crate) fn open_shard(path: &Path, shard: usize) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            file: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let bytes = if len == 0 {
            Bytes::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and documented as requiring the file to stay unchanged while mapped;
            // every access goes through bounds-checked slices.
            Bytes::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        Self::parse(path.to_path_buf(), bytes, shard)
    }

    /// Parses a GGUF file held in memory; `name` stands for the file in error messages.
    ///
    /// This is the same parser [`GgufFile::open`] runs over the memory map; tests and the fuzzer use it.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::parse(name.into(), Bytes::Owned(bytes), 0)
    }

    fn parse(path: PathBuf, bytes: Bytes, shard: usize) -> Result<GgufFile, GgufError> {
        let header = parse_header(&path, &bytes, shard)?;
        Ok(GgufFile { path, bytes, header })
    }

    /// The path the file was opened from (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version()
    }

    /// The metadata key-value pairs, in file order.
    pub fn metadata(&self) -> &Metadata {
        self.header.metadata()
    }

    /// The tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        self.header.tensors()
    }

    /// The tensor named `name` (a linear search; [`crate::gguf::GgufModel::tensor`] is indexed).
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors().iter().find(|t| t.name == name)
    }

    /// Start of the data section, in bytes from the start of the file (a multiple of [`GgufFile::alignment`]).
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset()
    }

    /// Alignment of the data section and of each tensor's offset, in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.header.alignment()
    }

    /// The parsed header: everything before the data section.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// Size of the file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The data of tensor `info` (`info.n_bytes` bytes), a slice of the memory map: no copy.
    ///
    /// `info` must come from this file's [`GgufFile::tensors`]; the range was checked at open time. For an info
    /// from another file whose range falls outside this one, the slice is empty.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let range = self
            .header
            .data_offset
            .checked_add(info.offset)
            .and_then(|start| Some(start..start.checked_add(info.n_bytes)?))
            .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
        range.and_then(|r| self.bytes.get(r)).unwrap_or(&[])
    }

    /// Tells the OS that bytes `range` of `info`'s (clamped to them) will not be read again soon: on a mapped
    /// file, `madvise(MADV_DONTNEED)` over them, so their pages leave this process's resident set (a later read
    /// maps them again from the page cache or the file, with the same bytes). Nothing for bytes held in memory,
    /// or a tensor outside the file.
    pub fn release_range(&self, info: &TensorInfo, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let Bytes::Mapped(m) = &self.bytes {
            let all = self.tensor_data(info);
            let end = range.end.min(all.len());
            let data = &all[range.start.min(end)..end];
            if data.is_empty() {
                return;
            }
            let start = data.as_ptr() as usize - m.as_ptr() as usize;
            // SAFETY: the range is inside the mapping (it is `tensor_data`'s). The mapping is read-only and
            // shared, so dropping its pages discards nothing: every later read sees the file's bytes again.
            // Advice is only advice: a refusal changes nothing, and is ignored.
            let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, data.len()) };
        }
        #[cfg(not(unix))]
        let _ = (info, range);
    }

    /// File offset of the tensor info record of tensor number `index` (for error messages).
    pub(crate) fn info_offset(&self, index: usize) -> u64 {
        self.header.info_offsets.get(index).copied().unwrap_or(0)
    }

    /// Moves every tensor into shard `shard` of a set.
    pub(crate) fn set_shard(&mut self, shard: usize) {
        for t in &mut self.header.tensors {
            t.shard = shard;
        }
    }
}

/// Everything before the data section of a GGUF file, parsed and validated over borrowed bytes: what
/// [`GgufFile`] holds besides the bytes themselves.
///
/// For checking bytes without handing them over (the corruption tests and the fuzzer flip bytes in one buffer
/// and parse it again and again).
#[derive(Debug, Clone)]
pub struct GgufHeader {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    info_offsets: Vec<u64>,
    data_offset: u64,
    alignment: u64,
}

impl GgufHeader {
    /// Parses and validates `bytes`, a whole GGUF file (tensor data ranges are checked against its length);
    /// `name` stands for the file in error messages. Errors: those of [`GgufFile::open`] but `Io`.
    pub fn parse(name: impl AsRef<Path>, bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        parse_header(name.as_ref(), bytes, 0)
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The metadata key-value pairs, in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Start of the data section, in bytes from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Alignment of the data section and of each tensor's offset, in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
}

/// What the parser was reading, for error messages. Rendered only when an error is built.
#[derive(Clone, Copy)]
enum Ctx<'a> {
    Field(&'static str),
    KeyOf(u64),
    ValueOf(&'a str),
    NameOfTensor(u64),
    Tensor(&'a str),
}

impl fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ctx::Field(what) => f.write_str(what),
            Ctx::KeyOf(i) => write!(f, "the key of metadata entry #{i}"),
            Ctx::ValueOf(key) => write!(f, "the value of metadata key `{key}`"),
            Ctx::NameOfTensor(i) => write!(f, "the name of tensor info #{i}"),
            Ctx::Tensor(name) => write!(f, "the tensor info of `{name}`"),
        }
    }
}

struct Cursor<'a> {
    file: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, ctx: Ctx) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                file: self.file.to_path_buf(),
                what: ctx.to_string(),
                offset: self.offset(),
                needed: n,
                file_bytes: self.bytes.len() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, ctx: Ctx) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, ctx)?);
        Ok(out)
    }

    fn u32(&mut self, ctx: Ctx) -> Result<u32, GgufError> {
        self.array(ctx).map(u32::from_le_bytes)
    }

    fn u64(&mut self, ctx: Ctx) -> Result<u64, GgufError> {
        self.array(ctx).map(u64::from_le_bytes)
    }

    /// A GGUF string: `u64` byte length, then UTF-8 bytes (no terminator).
    fn string(&mut self, ctx: Ctx) -> Result<String, GgufError> {
        let at = self.offset();
        let len = self.u64(ctx)?;
        if len > self.remaining() {
            return Err(GgufError::LengthPastEnd {
                file: self.file.to_path_buf(),
                what: ctx.to_string(),
                kind: "string",
                offset: at,
                len,
                remaining: self.remaining(),
            });
        }
        let raw = self.take(len, ctx)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(source) => Err(GgufError::InvalidUtf8 {
                file: self.file.to_path_buf(),
                what: ctx.to_string(),
                offset: at,
                source,
            }),
        }
    }

    fn value_type(&mut self, key: &str) -> Result<ValueType, GgufError> {
        let at = self.offset();
        let id = self.u32(Ctx::ValueOf(key))?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            file: self.file.to_path_buf(),
            key: key.to_owned(),
            offset: at,
            type_id: id,
        })
    }

    /// A metadata value of type `ty`; `depth` is the number of arrays enclosing it.
    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value, GgufError> {
        let ctx = Ctx::ValueOf(key);
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(ctx)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(ctx)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(ctx)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(ctx)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(ctx)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(ctx)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(ctx)?)),
            // The spec stores a bool as one byte, 0 or 1; like llama.cpp, any non-zero byte reads as true.
            ValueType::Bool => Value::Bool(self.array::<1>(ctx)?[0] != 0),
            ValueType::String => Value::String(self.string(ctx)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(ctx)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(ctx)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(ctx)?)),
            ValueType::Array => {
                let at = self.offset();
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep {
                        file: self.file.to_path_buf(),
                        key: key.to_owned(),
                        offset: at,
                        max: MAX_ARRAY_DEPTH,
                    });
                }
                let elem = self.value_type(key)?;
                let count_at = self.offset();
                let count = self.u64(ctx)?;
                let min_elem_bytes = match elem {
                    ValueType::String => 8,
                    ValueType::Array => 4 + 8,
                    scalar => scalar.scalar_bytes().unwrap_or(1) as u64,
                };
                if count.checked_mul(min_elem_bytes).is_none_or(|n| n > self.remaining()) {
                    return Err(GgufError::LengthPastEnd {
                        file: self.file.to_path_buf(),
                        what: ctx.to_string(),
                        kind: "array",
                        offset: count_at,
                        len: count,
                        remaining: self.remaining(),
                    });
                }
                // Bounded by the bytes left (checked just above).
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

fn parse_header(file: &Path, bytes: &[u8], shard: usize) -> Result<GgufHeader, GgufError> {
    let mut c = Cursor { file, bytes, pos: 0 };
    let err_file = || file.to_path_buf();

    let magic = c.array::<4>(Ctx::Field("the magic"))?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            file: err_file(),
            found: magic,
        });
    }
    let version_at = c.offset();
    let version = c.u32(Ctx::Field("the version"))?;
    if version != 2 && version != 3 {
        let hint = match version {
            1 => "; version 1 used 32-bit counts and is obsolete: reconvert the model",
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                "; this file looks big-endian, which Strata does not read"
            }
            _ => "",
        };
        return Err(GgufError::UnsupportedVersion {
            file: err_file(),
            version,
            offset: version_at,
            hint,
        });
    }

    let n_tensors_at = c.offset();
    let n_tensors = c.u64(Ctx::Field("the tensor count"))?;
    let n_kv_at = c.offset();
    let n_kv = c.u64(Ctx::Field("the metadata entry count"))?;
    let left = c.remaining();
    let tensors_min = n_tensors.checked_mul(MIN_TENSOR_INFO_BYTES);
    if tensors_min.is_none_or(|n| n > left) {
        return Err(GgufError::CountTooLarge {
            file: err_file(),
            what: "the tensor count",
            offset: n_tensors_at,
            count: n_tensors,
            remaining: left,
            min_entry_bytes: MIN_TENSOR_INFO_BYTES,
        });
    }
    let left_for_kv = left - tensors_min.unwrap_or(0);
    if n_kv.checked_mul(MIN_KV_BYTES).is_none_or(|n| n > left_for_kv) {
        return Err(GgufError::CountTooLarge {
            file: err_file(),
            what: "the metadata entry count",
            offset: n_kv_at,
            count: n_kv,
            remaining: left_for_kv,
            min_entry_bytes: MIN_KV_BYTES,
        });
    }

    let mut metadata = Metadata::new();
    let mut alignment_at = None;
    for i in 0..n_kv {
        let key_at = c.offset();
        let key = c.string(Ctx::KeyOf(i))?;
        if metadata.contains(&key) {
            return Err(GgufError::DuplicateKey {
                file: err_file(),
                key,
                offset: key_at,
            });
        }
        let ty = c.value_type(&key)?;
        let value_at = c.offset();
        let value = c.value(ty, &key, 0)?;
        if key == "general.alignment" {
            alignment_at = Some(value_at);
        }
        metadata.insert(key, value);
    }

    let alignment = match alignment_at {
        None => DEFAULT_ALIGNMENT,
        Some(offset) => {
            let bad = |reason: String| GgufError::BadAlignment {
                file: err_file(),
                key: "general.alignment".into(),
                offset,
                reason,
            };
            match metadata.alignment() {
                Ok(a) if a.is_power_of_two() && a <= 1 << 30 => a,
                Ok(a) => return Err(bad(format!("{a} is not a power of two between 1 and 2^30"))),
                Err(e) => return Err(bad(e.to_string())),
            }
        }
    };

    // Bounded by the bytes left (checked against the counts above).
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut info_offsets = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let info_at = c.offset();
        let name = c.string(Ctx::NameOfTensor(i))?;
        if names.contains(&name) {
            return Err(GgufError::DuplicateTensor {
                file: err_file(),
                tensor: name,
                offset: info_at,
            });
        }
        let info = tensor_info(&mut c, name, shard)?;
        names.insert(info.name.clone());
        tensors.push(info);
        info_offsets.push(info_at);
    }

    let header_end = c.offset();
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let file_bytes = bytes.len() as u64;

    for (t, &at) in tensors.iter().zip(&info_offsets) {
        if t.offset % alignment != 0 {
            return Err(GgufError::UnalignedTensor {
                file: err_file(),
                tensor: t.name.clone(),
                offset: at,
                data_offset: t.offset,
                alignment,
            });
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|e| e > file_bytes) {
            return Err(GgufError::TensorOutOfFile {
                file: err_file(),
                tensor: t.name.clone(),
                offset: at,
                start: start.unwrap_or(u64::MAX),
                end: end.unwrap_or(u64::MAX),
                file_bytes,
            });
        }
    }

    // Overlaps: sort by start; each non-empty tensor must start at or after the end of the previous ones.
    let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].n_bytes > 0).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for pair in order.windows(2) {
        let (prev, next) = (&tensors[pair[0]], &tensors[pair[1]]);
        // In range: every end was checked above to fit in the file.
        let prev_end = prev.offset + prev.n_bytes;
        if next.offset < prev_end {
            return Err(GgufError::OverlappingTensors {
                file: err_file(),
                tensor: next.name.clone(),
                other: prev.name.clone(),
                offset: data_offset + next.offset,
                other_end: data_offset + prev_end,
            });
        }
    }

    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        info_offsets,
        data_offset,
        alignment,
    })
}

/// The rest of a tensor info after its name: `u32` n_dims, `u64` dims, `u32` type, `u64` offset.
fn tensor_info(c: &mut Cursor, name: String, shard: usize) -> Result<TensorInfo, GgufError> {
    let ctx = Ctx::Tensor(&name);
    let file = || c.file.to_path_buf();
    let n_dims_at = c.offset();
    let n_dims = c.u32(ctx)?;
    if n_dims as usize > MAX_DIMS {
        return Err(GgufError::TooManyDims {
            file: file(),
            tensor: name,
            offset: n_dims_at,
            n_dims,
            max: MAX_DIMS,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for index in 0..n_dims as usize {
        let at = c.offset();
        let dim = c.u64(ctx)?;
        if dim > i64::MAX as u64 {
            return Err(GgufError::DimOutOfRange {
                file: file(),
                tensor: name,
                offset: at,
                index,
                dim,
            });
        }
        dims.push(dim);
    }
    let type_at = c.offset();
    let type_id = c.u32(ctx)?;
    let Some(ty) = GgmlType::from_id(type_id) else {
        return Err(GgufError::UnknownTensorType {
            file: file(),
            tensor: name,
            offset: type_at,
            type_id,
        });
    };
    let offset = c.u64(ctx)?;

    let n_bytes = match tensor_bytes(&dims, ty) {
        Ok(n) => n,
        Err(TensorShapeError::Overflow(what)) => {
            return Err(GgufError::DimsOverflow {
                file: file(),
                tensor: name,
                offset: n_dims_at,
                dims,
                what,
            });
        }
        Err(TensorShapeError::PartialBlock { row_len, block_elems }) => {
            return Err(GgufError::PartialBlock {
                file: file(),
                tensor: name,
                offset: n_dims_at,
                row_len,
                ty,
                block_elems,
            });
        }
    };
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset,
        n_bytes,
        shard,
    })
}

/// Why a shape cannot hold a tensor of a type.
pub(crate) enum TensorShapeError {
    /// The element count or the byte size overflows (`i64` for the count, as ggml stores it; `u64` for bytes).
    Overflow(&'static str),
    /// The row length is not a whole number of blocks.
    PartialBlock { row_len: u64, block_elems: usize },
}

/// Data size in bytes of a tensor of `dims` (ggml order) and type `ty`.
pub(crate) fn tensor_bytes(dims: &[u64], ty: GgmlType) -> Result<u64, TensorShapeError> {
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or(TensorShapeError::Overflow("element count above i64::MAX"))?;
    let row_len = dims.first().copied().unwrap_or(1);
    let block_elems = ty.geometry().block_elems;
    let Some(row_bytes) = ty.row_bytes(row_len) else {
        return Err(if row_len % block_elems as u64 != 0 {
            TensorShapeError::PartialBlock { row_len, block_elems }
        } else {
            TensorShapeError::Overflow("row byte size above u64::MAX")
        });
    };
    let n_rows = n_elements.checked_div(row_len).unwrap_or(0);
    row_bytes
        .checked_mul(n_rows)
        .ok_or(TensorShapeError::Overflow("byte size above u64::MAX"))
}
