//! The GGUF writer: version-3 files, header first, tensor data in order or concurrently at precomputed offsets.
//!
//! Source: the GGUF specification, "File Structure" (ggml/docs/gguf.md). Each tensor starts at a multiple of
//! `general.alignment` (default 32) from the data section, and each is followed by zero padding up to the next
//! multiple, as llama.cpp and gguf-py write them.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::error::{GgufWriteError, MAX_ARRAY_DEPTH, MAX_DIMS};
use super::reader::{GGUF_MAGIC, GGUF_VERSION, TensorInfo, TensorShapeError, tensor_bytes};
use super::shards::{KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, shard_path};
use super::value::{Metadata, Value};
use crate::quant::types::GgmlType;

/// A tensor to be written: its name, dims in ggml order (`dims[0]` is the row length) and type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name (`blk.0.ffn_up_exps.weight`).
    pub name: String,
    /// Dimensions in ggml order, at most [`MAX_DIMS`]; `dims[0]` must be a whole number of `ty`'s blocks.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
}

impl TensorSpec {
    /// A spec from borrowed parts.
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
        }
    }
}

impl From<&TensorSpec> for TensorSpec {
    fn from(spec: &TensorSpec) -> Self {
        spec.clone()
    }
}

/// `(name, dims, type)`.
impl From<(String, Vec<u64>, GgmlType)> for TensorSpec {
    fn from((name, dims, ty): (String, Vec<u64>, GgmlType)) -> Self {
        TensorSpec { name, dims, ty }
    }
}

/// Which tensor to write: by index in the writer's list, or by name.
#[derive(Debug, Clone, Copy)]
pub enum TensorRef<'a> {
    /// Position in the list given to [`GgufWriter::create`].
    Index(usize),
    /// Tensor name.
    Name(&'a str),
}

impl From<usize> for TensorRef<'_> {
    fn from(i: usize) -> Self {
        TensorRef::Index(i)
    }
}

impl<'a> From<&'a str> for TensorRef<'a> {
    fn from(name: &'a str) -> Self {
        TensorRef::Name(name)
    }
}

/// Where everything goes in a file: the encoded header (padded to the data section), the tensor infos with their
/// offsets, and the total file size in bytes.
struct Layout {
    header: Vec<u8>,
    tensors: Vec<TensorInfo>,
    file_bytes: u64,
}

fn layout(file: &Path, metadata: &Metadata, specs: &[TensorSpec]) -> Result<Layout, GgufWriteError> {
    let bad_md = |key: &str, reason: String| GgufWriteError::BadMetadata {
        file: file.into(),
        key: key.into(),
        reason,
    };
    let alignment = metadata
        .alignment()
        .map_err(|e| bad_md("general.alignment", e.to_string()))?;
    if !alignment.is_power_of_two() || alignment > 1 << 30 {
        return Err(bad_md(
            "general.alignment",
            format!("{alignment} is not a power of two between 1 and 2^30"),
        ));
    }

    let mut tensors = Vec::with_capacity(specs.len());
    let mut names = HashMap::with_capacity(specs.len());
    let mut data_bytes = 0u64;
    for spec in specs {
        let bad = |reason: String| GgufWriteError::BadTensor {
            file: file.into(),
            tensor: spec.name.clone(),
            reason,
        };
        if names.insert(spec.name.as_str(), ()).is_some() {
            return Err(bad("the name appears twice".into()));
        }
        if spec.dims.len() > MAX_DIMS {
            return Err(bad(format!("{} dims, at most {MAX_DIMS}", spec.dims.len())));
        }
        if spec.dims.iter().any(|&d| d > i64::MAX as u64) {
            return Err(bad(format!("dims {:?}: above i64::MAX", spec.dims)));
        }
        let n_bytes = tensor_bytes(&spec.dims, spec.ty).map_err(|e| match e {
            TensorShapeError::Overflow(what) => bad(format!("dims {:?} overflow ({what})", spec.dims)),
            TensorShapeError::PartialBlock { row_len, block_elems } => bad(format!(
                "row length {row_len} is not a whole number of {} blocks ({block_elems} elements)",
                spec.ty
            )),
        })?;
        let padded = n_bytes.checked_next_multiple_of(alignment);
        let next = padded.and_then(|p| data_bytes.checked_add(p));
        let Some(next) = next else {
            return Err(bad("the data section overflows u64".into()));
        };
        tensors.push(TensorInfo {
            name: spec.name.clone(),
            dims: spec.dims.clone(),
            ty: spec.ty,
            offset: data_bytes,
            n_bytes,
            shard: 0,
        });
        data_bytes = next;
    }

    let mut h = Vec::new();
    h.extend_from_slice(&GGUF_MAGIC);
    h.extend_from_slice(&GGUF_VERSION.to_le_bytes());
    h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    h.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata.iter() {
        put_str(&mut h, key);
        h.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
        put_value(&mut h, value, 0).map_err(|reason| bad_md(key, reason))?;
    }
    for t in &tensors {
        put_str(&mut h, &t.name);
        h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            h.extend_from_slice(&d.to_le_bytes());
        }
        h.extend_from_slice(&t.ty.id().to_le_bytes());
        h.extend_from_slice(&t.offset.to_le_bytes());
    }
    let data_offset = (h.len() as u64).next_multiple_of(alignment);
    h.resize(data_offset as usize, 0);
    let file_bytes = data_offset
        .checked_add(data_bytes)
        .ok_or_else(|| bad_md("general.alignment", "the file size overflows u64".into()))?;
    Ok(Layout {
        header: h,
        tensors,
        file_bytes,
    })
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

/// Encodes `value` (without its type tag); `depth` counts the enclosing arrays.
fn put_value(h: &mut Vec<u8>, value: &Value, depth: usize) -> Result<(), String> {
    match value {
        Value::U8(v) => h.push(*v),
        Value::I8(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => h.push(u8::from(*v)),
        Value::String(s) => put_str(h, s),
        Value::U64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::Array(elem, items) => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"));
            }
            h.extend_from_slice(&(*elem as u32).to_le_bytes());
            h.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for (i, item) in items.iter().enumerate() {
                if item.value_type() != *elem {
                    return Err(format!("item {i} of an array of {elem:?} is {:?}", item.value_type()));
                }
                put_value(h, item, depth + 1)?;
            }
        }
    }
    Ok(())
}

/// Writes one GGUF (version 3) file.
///
/// [`GgufWriter::create`] computes the layout, writes the header and sizes the file. Tensor data then goes in
/// with [`GgufWriter::write_tensor`], which takes `&self` and writes at the tensor's offset with a positioned
/// write, so threads (rayon) may write different tensors at once. [`GgufWriter::finish`] checks that every
/// tensor was written. Padding is the zeros of the pre-sized file.
///
/// The data goes to a temporary file beside the destination (`.NAME.partial-PID`), which `finish` renames into
/// place. So a failed or interrupted write never leaves a valid-looking half file, never destroys an existing
/// file at the destination, and never rewrites a file that is still memory-mapped as an input. A writer dropped
/// without `finish` removes its temporary file.
#[derive(Debug)]
pub struct GgufWriter {
    path: PathBuf,
    partial: PathBuf,
    finished: bool,
    file: File,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    written: Vec<AtomicBool>,
    data_offset: u64,
    file_bytes: u64,
}

/// What a writer's partial file adds to the destination's name, before its process id (`.NAME.partial-PID`).
const PARTIAL: &str = ".partial-";

/// Removes the partial files (`.NAME.partial-PID`) that writers killed mid-write left in `dir`: those whose process
/// is gone (Linux's `/proc`; elsewhere none is removed). A writer that fails or is dropped removes its own.
pub fn remove_dead_partials(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let proc_dir = Path::new("/proc");
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix('.')
            .and_then(|n| n.rsplit_once(PARTIAL))
            .and_then(|(_, pid)| pid.parse::<u32>().ok());
        let Some(pid) = pid else { continue };
        if pid != std::process::id() && proc_dir.is_dir() && !proc_dir.join(pid.to_string()).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl Drop for GgufWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

impl GgufWriter {
    /// Creates (or, at `finish`, replaces) `path`, writes the header for `metadata` and `tensors`, and sets the file's length
    /// to its final size in bytes.
    ///
    /// Errors: [`GgufWriteError::BadMetadata`] (bad `general.alignment`, an array whose items are not all of its
    /// element type, or nesting deeper than [`MAX_ARRAY_DEPTH`]); [`GgufWriteError::BadTensor`] (duplicate name,
    /// more than [`MAX_DIMS`] dims, a row that is not whole blocks, overflow); [`GgufWriteError::Io`], also for a
    /// destination that is a symbolic link, a folder or not a regular file (a device, FIFO or socket), which the
    /// rename at `finish` would replace.
    pub fn create<S: Into<TensorSpec>>(
        path: impl AsRef<Path>,
        metadata: impl Borrow<Metadata>,
        tensors: impl IntoIterator<Item = S>,
    ) -> Result<GgufWriter, GgufWriteError> {
        let path = path.as_ref().to_path_buf();
        let specs: Vec<TensorSpec> = tensors.into_iter().map(Into::into).collect();
        let layout = layout(&path, metadata.borrow(), &specs)?;
        let io = |source| GgufWriteError::Io {
            file: path.clone(),
            source,
        };
        // The file is renamed into place at `finish`, which would replace a link, a device or a FIFO there (and
        // fail on a folder): such a destination is refused now.
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            let t = m.file_type();
            let what = if t.is_symlink() {
                Some("a symbolic link (give the path of the file it names)")
            } else if t.is_dir() {
                Some("a folder")
            } else if !t.is_file() {
                Some("not a regular file (a device, FIFO or socket)")
            } else {
                None
            };
            if let Some(what) = what {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("the destination is {what}, which writing a GGUF file there would replace"),
                )));
            }
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = path.with_file_name(format!(".{name}{PARTIAL}{}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&partial)
            .map_err(io)?;
        let sized = file
            .set_len(layout.file_bytes)
            .and_then(|()| file.write_all_at(&layout.header, 0));
        if let Err(e) = sized {
            let _ = std::fs::remove_file(&partial);
            return Err(io(e));
        }
        let index = layout
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let written = layout.tensors.iter().map(|_| AtomicBool::new(false)).collect();
        Ok(GgufWriter {
            data_offset: layout.header.len() as u64,
            file_bytes: layout.file_bytes,
            path,
            partial,
            finished: false,
            file,
            tensors: layout.tensors,
            index,
            written,
        })
    }

    /// The tensors with their computed offsets (relative to the data section) and sizes, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Start of the data section, in bytes from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Final size of the file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// The path being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the data of one tensor (by index or name); `bytes` must be exactly its `n_bytes`. Safe to call from
    /// several threads for different tensors.
    ///
    /// Errors: [`GgufWriteError::UnknownTensor`], [`GgufWriteError::WrongLength`],
    /// [`GgufWriteError::WrittenTwice`], [`GgufWriteError::Io`].
    pub fn write_tensor<'a>(&self, tensor: impl Into<TensorRef<'a>>, bytes: &[u8]) -> Result<(), GgufWriteError> {
        let tensor = tensor.into();
        let index = match tensor {
            TensorRef::Index(i) => (i < self.tensors.len()).then_some(i),
            TensorRef::Name(name) => self.index.get(name).copied(),
        };
        let Some(index) = index else {
            let tensor = match tensor {
                TensorRef::Index(i) => format!("#{i} (it has {})", self.tensors.len()),
                TensorRef::Name(name) => format!("`{name}`"),
            };
            return Err(GgufWriteError::UnknownTensor {
                file: self.path.clone(),
                tensor,
            });
        };
        let info = &self.tensors[index];
        if bytes.len() as u64 != info.n_bytes {
            return Err(GgufWriteError::WrongLength {
                file: self.path.clone(),
                tensor: info.name.clone(),
                expected: info.n_bytes,
                given: bytes.len() as u64,
            });
        }
        if self.written[index].swap(true, Ordering::AcqRel) {
            return Err(GgufWriteError::WrittenTwice {
                file: self.path.clone(),
                tensor: info.name.clone(),
            });
        }
        self.file
            .write_all_at(bytes, self.data_offset + info.offset)
            .map_err(|source| GgufWriteError::Io {
                file: self.path.clone(),
                source,
            })
    }

    /// Checks that every tensor was written and closes the file; returns its size in bytes.
    ///
    /// Errors: [`GgufWriteError::NotWritten`] naming the first missing tensor; [`GgufWriteError::Io`].
    pub fn finish(mut self) -> Result<u64, GgufWriteError> {
        let missing: Vec<usize> = (0..self.tensors.len())
            .filter(|&i| !self.written[i].load(Ordering::Acquire))
            .collect();
        if let Some(&first) = missing.first() {
            return Err(GgufWriteError::NotWritten {
                file: self.path.clone(),
                tensor: self.tensors[first].name.clone(),
                missing: missing.len(),
            });
        }
        let io = |source| GgufWriteError::Io {
            file: self.path.clone(),
            source,
        };
        self.file.sync_data().map_err(io)?;
        std::fs::rename(&self.partial, &self.path).map_err(io)?;
        self.finished = true;
        Ok(self.file_bytes)
    }

    /// Writes a whole file: `metadata` and each tensor with its data, in order. Returns the size in bytes.
    pub fn write_file(
        path: impl AsRef<Path>,
        metadata: impl Borrow<Metadata>,
        tensors: &[(TensorSpec, &[u8])],
    ) -> Result<u64, GgufWriteError> {
        let w = GgufWriter::create(path, metadata, tensors.iter().map(|(s, _)| s))?;
        for (i, (_, data)) in tensors.iter().enumerate() {
            w.write_tensor(i, data)?;
        }
        w.finish()
    }
}

/// Encodes a whole GGUF (version 3) file in memory: the same layout [`GgufWriter`] writes, byte for byte.
/// `name` stands for the file in error messages. For tests and small fixtures.
pub fn to_bytes(name: &str, metadata: &Metadata, tensors: &[(TensorSpec, &[u8])]) -> Result<Vec<u8>, GgufWriteError> {
    let specs: Vec<TensorSpec> = tensors.iter().map(|(s, _)| s.clone()).collect();
    let layout = layout(Path::new(name), metadata, &specs)?;
    let mut out = layout.header;
    let data_offset = out.len();
    out.resize(layout.file_bytes as usize, 0);
    for (info, (_, data)) in layout.tensors.iter().zip(tensors) {
        if data.len() as u64 != info.n_bytes {
            return Err(GgufWriteError::WrongLength {
                file: name.into(),
                tensor: info.name.clone(),
                expected: info.n_bytes,
                given: data.len() as u64,
            });
        }
        let start = data_offset + info.offset as usize;
        out[start..start + data.len()].copy_from_slice(data);
    }
    Ok(out)
}

/// Writes a model as a shard set of `n_shards` files named `PREFIX-0000k-of-0000n.gguf`, as llama.cpp's
/// `gguf-split` does: the tensors are cut into `n_shards` consecutive runs of near-equal count; shard 0 carries
/// `metadata`; every shard carries `split.no` (u16, from 0), `split.count` (u16) and `split.tensors.count`
/// (i32). Returns the shard paths in order.
///
/// Errors: [`GgufWriteError::BadMetadata`] when `n_shards` is 0 or above `u16::MAX` or the tensor count above
/// `i32::MAX`; otherwise those of [`GgufWriter::write_file`].
pub fn write_shard_set(
    prefix: impl AsRef<Path>,
    metadata: &Metadata,
    tensors: &[(TensorSpec, &[u8])],
    n_shards: usize,
) -> Result<Vec<PathBuf>, GgufWriteError> {
    let prefix = prefix.as_ref();
    let bad = |key: &str, reason: String| GgufWriteError::BadMetadata {
        file: prefix.into(),
        key: key.into(),
        reason,
    };
    let count = u16::try_from(n_shards)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| bad(KEY_SPLIT_COUNT, format!("{n_shards} shards: must be 1..=65535")))?;
    let n_tensors = i32::try_from(tensors.len()).map_err(|_| {
        bad(
            KEY_SPLIT_TENSORS_COUNT,
            format!("{} tensors: above i32::MAX", tensors.len()),
        )
    })?;
    let alignment = metadata.get("general.alignment");
    let mut paths = Vec::with_capacity(n_shards);
    let mut start = 0;
    for no in 0..n_shards {
        let end = tensors.len() * (no + 1) / n_shards;
        let mut md = if no == 0 { metadata.clone() } else { Metadata::new() };
        if let (true, Some(a)) = (no > 0, alignment) {
            md.insert("general.alignment", a.clone());
        }
        md.insert(KEY_SPLIT_NO, Value::U16(no as u16));
        md.insert(KEY_SPLIT_COUNT, Value::U16(count));
        md.insert(KEY_SPLIT_TENSORS_COUNT, Value::I32(n_tensors));
        let path = shard_path(prefix, no, n_shards);
        GgufWriter::write_file(&path, &md, &tensors[start..end])?;
        paths.push(path);
        start = end;
    }
    Ok(paths)
}

/// Every metadata value type once, with nested and empty arrays: a fixture for round-trip tests.
#[cfg(test)]
pub(crate) fn every_value_type() -> Metadata {
    use super::value::ValueType;
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    md.insert("t.u8", Value::U8(250));
    md.insert("t.i8", Value::I8(-5));
    md.insert("t.u16", Value::U16(65000));
    md.insert("t.i16", Value::I16(-30000));
    md.insert("t.u32", Value::U32(4_000_000_000));
    md.insert("t.i32", Value::I32(-2_000_000_000));
    md.insert("t.f32", Value::F32(-1.5e-3));
    md.insert("t.bool", Value::Bool(true));
    md.insert("t.string", Value::String("héllo ✓".into()));
    md.insert("t.empty_string", Value::String(String::new()));
    md.insert("t.u64", Value::U64(u64::MAX));
    md.insert("t.i64", Value::I64(i64::MIN));
    md.insert("t.f64", Value::F64(std::f64::consts::PI));
    md.insert(
        "t.arr_i32",
        Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2), Value::I32(3)]),
    );
    md.insert(
        "t.arr_str",
        Value::Array(
            ValueType::String,
            vec![Value::String("a".into()), Value::String("".into())],
        ),
    );
    md.insert("t.arr_empty", Value::Array(ValueType::F64, vec![]));
    md.insert(
        "t.arr_nested",
        Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]),
                Value::Array(ValueType::Bool, vec![]),
                Value::Array(
                    ValueType::Array,
                    vec![Value::Array(ValueType::String, vec![Value::String("x".into())])],
                ),
            ],
        ),
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::ValueType;
    use crate::gguf::{GgufError, GgufFile, GgufModel};

    fn sample_tensors() -> Vec<(TensorSpec, Vec<u8>)> {
        let specs = [
            TensorSpec::new("token_embd.weight", &[64, 3], GgmlType::Q8_0),
            TensorSpec::new("norm.weight", &[7], GgmlType::F32),
            TensorSpec::new("empty", &[0, 5], GgmlType::F16),
            TensorSpec::new("scalar", &[], GgmlType::I32),
            TensorSpec::new("blk.0.ffn_up.weight", &[256, 2, 3, 1], GgmlType::Q4_K),
        ];
        specs
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let n = tensor_bytes(&s.dims, s.ty).ok().unwrap() as usize;
                (s, (0..n).map(|b| (b * 31 + i * 7) as u8).collect())
            })
            .collect()
    }

    fn borrowed(t: &[(TensorSpec, Vec<u8>)]) -> Vec<(TensorSpec, &[u8])> {
        t.iter().map(|(s, d)| (s.clone(), d.as_slice())).collect()
    }

    #[test]
    fn round_trip_every_value_type_and_tensor_bytes() {
        let md = every_value_type();
        let tensors = sample_tensors();
        let bytes = to_bytes("mem.gguf", &md, &borrowed(&tensors)).unwrap();
        let f = GgufFile::from_bytes("mem.gguf", bytes.clone()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.metadata(), &md);
        assert_eq!(f.data_offset() % 32, 0);
        assert_eq!(f.file_bytes() % 32, 0);
        assert_eq!(f.tensors().len(), tensors.len());
        for (t, (spec, data)) in f.tensors().iter().zip(&tensors) {
            assert_eq!((&t.name, &t.dims, t.ty), (&spec.name, &spec.dims, spec.ty));
            assert_eq!(t.offset % 32, 0);
            assert_eq!(f.tensor_data(t), data.as_slice(), "{}", t.name);
        }
        assert_eq!(f.tensor("scalar").unwrap().n_elements(), 1);
        assert_eq!(f.tensor("empty").unwrap().n_bytes, 0);

        // The file writer produces the same bytes, whether tensors go in order or concurrently.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.gguf");
        assert_eq!(
            GgufWriter::write_file(&path, &md, &borrowed(&tensors)).unwrap(),
            bytes.len() as u64
        );
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let specs: Vec<_> = tensors.iter().map(|(s, _)| s.clone()).collect();
        let w = GgufWriter::create(&path, &md, &specs).unwrap();
        std::thread::scope(|s| {
            for (spec, data) in tensors.iter().rev() {
                let w = &w;
                s.spawn(move || w.write_tensor(spec.name.as_str(), data).unwrap());
            }
        });
        w.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    #[test]
    #[cfg(unix)]
    fn a_link_a_folder_or_a_fifo_at_the_destination_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let md = Metadata::new();
        let tensors = sample_tensors();
        let target = dir.path().join("target.gguf");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("link.gguf");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let folder = dir.path().join("folder.gguf");
        std::fs::create_dir(&folder).unwrap();
        let fifo = dir.path().join("fifo.gguf");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        for (path, what) in [
            (&link, "symbolic link"),
            (&folder, "folder"),
            (&fifo, "not a regular file"),
        ] {
            let err = GgufWriter::write_file(path, &md, &borrowed(&tensors))
                .unwrap_err()
                .to_string();
            assert!(err.contains(what) && err.contains(path.to_str().unwrap()), "{err}");
        }
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert!(folder.is_dir());
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        // Nothing else was left in the folder (no partial files).
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 4);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn partial_files_of_dead_writers_are_removed_and_others_kept() {
        let dir = tempfile::tempdir().unwrap();
        let file = |n: &str| {
            std::fs::write(dir.path().join(n), b"x").unwrap();
            dir.path().join(n)
        };
        // No process has an id this large (Linux's pid_max is at most 2^22).
        let dead = file(".m.gguf.partial-4000000000");
        let mine = file(&format!(".m.gguf.partial-{}", std::process::id()));
        let other = file("m.gguf.partial-4000000000");
        remove_dead_partials(dir.path());
        assert!(!dead.exists());
        assert!(mine.exists() && other.exists());
    }

    #[test]
    fn custom_alignment_is_honoured() {
        let mut md = Metadata::new();
        md.insert("general.alignment", Value::U32(64));
        let tensors = sample_tensors();
        let f = GgufFile::from_bytes("a.gguf", to_bytes("a.gguf", &md, &borrowed(&tensors)).unwrap()).unwrap();
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        assert!(f.tensors().iter().all(|t| t.offset % 64 == 0));
    }

    #[test]
    fn writer_rejects_misuse() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.gguf");
        let md = Metadata::new();
        let specs = [
            TensorSpec::new("a", &[4], GgmlType::F32),
            TensorSpec::new("b", &[2], GgmlType::F16),
        ];
        let w = GgufWriter::create(&path, &md, &specs).unwrap();
        assert!(matches!(
            w.write_tensor("a", &[0; 15]),
            Err(GgufWriteError::WrongLength { expected: 16, .. })
        ));
        assert!(matches!(
            w.write_tensor("zz", &[0; 16]),
            Err(GgufWriteError::UnknownTensor { .. })
        ));
        assert!(matches!(
            w.write_tensor(7, &[0; 16]),
            Err(GgufWriteError::UnknownTensor { .. })
        ));
        w.write_tensor(0, &[1; 16]).unwrap();
        assert!(matches!(
            w.write_tensor("a", &[1; 16]),
            Err(GgufWriteError::WrittenTwice { .. })
        ));
        let err = w.finish().unwrap_err();
        assert!(matches!(err, GgufWriteError::NotWritten { missing: 1, .. }), "{err}");
        assert!(err.to_string().contains("`b`"), "{err}");

        for (spec, needle) in [
            (TensorSpec::new("q", &[33], GgmlType::Q4_0), "whole number"),
            (TensorSpec::new("d", &[1, 1, 1, 1, 1], GgmlType::F32), "dims"),
            (TensorSpec::new("o", &[1 << 62, 1 << 62], GgmlType::F32), "overflow"),
        ] {
            let err = GgufWriter::create(&path, &md, &[spec]).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        let dup = [
            TensorSpec::new("a", &[1], GgmlType::F32),
            TensorSpec::new("a", &[1], GgmlType::F32),
        ];
        assert!(
            GgufWriter::create(&path, &md, &dup)
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        let mut mixed = Metadata::new();
        mixed.insert("m", Value::Array(ValueType::U8, vec![Value::U8(1), Value::I8(1)]));
        let err = GgufWriter::create(&path, &mixed, Vec::<TensorSpec>::new()).unwrap_err();
        assert!(
            matches!(err, GgufWriteError::BadMetadata { ref key, .. } if key == "m"),
            "{err}"
        );
    }

    #[test]
    fn an_unfinished_write_leaves_the_destination_alone() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("model.gguf");
        std::fs::write(&dest, b"the previous file").unwrap();
        let tensors = [
            TensorSpec::new("a", &[32], GgmlType::F32),
            TensorSpec::new("b", &[32], GgmlType::F32),
        ];
        let writer = GgufWriter::create(&dest, Metadata::new(), &tensors).unwrap();
        writer.write_tensor(0, &[0u8; 128]).unwrap();
        // Tensor `b` is never written: finish refuses, and the old file is still there, whole.
        assert!(matches!(writer.finish(), Err(GgufWriteError::NotWritten { .. })));
        assert_eq!(std::fs::read(&dest).unwrap(), b"the previous file");
        // A writer dropped mid-way removes its temporary file.
        drop(GgufWriter::create(&dest, Metadata::new(), &tensors).unwrap());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("model.gguf")]);
        // A finished one replaces it.
        let writer = GgufWriter::create(&dest, Metadata::new(), &tensors).unwrap();
        writer.write_tensor(0, &[0u8; 128]).unwrap();
        writer.write_tensor(1, &[0u8; 128]).unwrap();
        writer.finish().unwrap();
        assert_eq!(GgufFile::open(&dest).unwrap().tensors().len(), 2);
    }

    #[test]
    fn shard_set_opens_from_any_shard() {
        let dir = tempfile::tempdir().unwrap();
        let md = every_value_type();
        let tensors = sample_tensors();
        let paths = write_shard_set(dir.path().join("m"), &md, &borrowed(&tensors), 3).unwrap();
        assert_eq!(paths[1], dir.path().join("m-00002-of-00003.gguf"));
        let model = GgufModel::open(&paths[2]).unwrap();
        assert_eq!(model.paths(), paths.iter().map(|p| p.as_path()).collect::<Vec<_>>());
        assert_eq!(model.metadata().get_u64(KEY_SPLIT_COUNT).unwrap(), 3);
        assert_eq!(model.tensors().len(), tensors.len());
        for (spec, data) in &tensors {
            let t = model.tensor(&spec.name).unwrap();
            assert_eq!(model.tensor_data(t), data.as_slice());
        }
        assert_eq!(
            model.tensors().iter().map(|t| t.shard).collect::<Vec<_>>(),
            vec![0, 1, 1, 2, 2]
        );

        std::fs::remove_file(&paths[0]).unwrap();
        let err = GgufModel::open(&paths[1]).unwrap_err();
        assert!(matches!(err, GgufError::MissingShard { shard_no: 1, .. }), "{err}");
        assert!(err.to_string().contains("m-00001-of-00003.gguf"), "{err}");
    }
}
