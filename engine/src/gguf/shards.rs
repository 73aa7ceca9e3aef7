//! The model view: one GGUF file, or every shard of a set written by llama.cpp's `gguf-split`, as one model.
//!
//! Convention (llama.cpp `gguf-split`, `llama_split_path`): shard `k` of `n` (k from 1) is named
//! `PREFIX-0000k-of-0000n.gguf`; every shard carries `split.no` (`u16`, from 0), `split.count` (`u16`) and
//! `split.tensors.count` (`i32`, the tensors of the whole set); only shard 0 carries the model's other metadata.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::error::GgufError;
use super::reader::{GgufFile, TensorInfo};
use super::value::Metadata;

/// Key holding a shard's index in its set, from 0 (`u16`).
pub const KEY_SPLIT_NO: &str = "split.no";
/// Key holding the number of shards in the set (`u16`).
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Key holding the number of tensors in the whole set (`i32`).
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// Path of shard `index` (from 0) of a set of `count` shards: `PREFIX-0000k-of-0000n.gguf` with k = index + 1.
pub fn shard_path(prefix: &Path, index: usize, count: usize) -> PathBuf {
    let mut name = OsString::from(prefix.as_os_str());
    name.push(format!("-{:05}-of-{:05}.gguf", index + 1, count));
    PathBuf::from(name)
}

/// Splits a shard file name into (prefix, index from 0, count), or `None` when the name does not follow
/// `PREFIX-0000k-of-0000n.gguf` with 1 <= k <= n.
pub fn parse_shard_path(path: &Path) -> Option<(PathBuf, usize, usize)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    // gguf-split writes exactly five digits (`%05d`), so a set has at most 99,999 shards.
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if prefix.is_empty() || !digits(no) || !digits(count) {
        return None;
    }
    let (no, count): (usize, usize) = (no.parse().ok()?, count.parse().ok()?);
    if no == 0 || no > count {
        return None;
    }
    Some((path.with_file_name(prefix), no - 1, count))
}

/// A model stored in one GGUF file or in a shard set, seen as one: the metadata of shard 0 and the tensors of all
/// shards, each tagged with its [`TensorInfo::shard`].
#[derive(Debug)]
pub struct GgufModel {
    shards: Vec<GgufFile>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

impl GgufModel {
    /// Opens the model that `path` belongs to. A plain file is a one-shard model. A shard of a set (by file name
    /// or by `split.count` > 1) opens every shard of the set, whichever one `path` names.
    ///
    /// Errors: any [`GgufFile::open`] error of any shard; [`GgufError::MissingShard`] naming the absent file;
    /// [`GgufError::BadSplit`] when the `split.*` keys disagree with each other or with the file names (or a set
    /// is not named by the convention, so its other shards cannot be found);
    /// [`GgufError::DuplicateTensorAcrossShards`]; [`GgufError::SplitTensorCount`] when `split.tensors.count`
    /// differs from the tensors found.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufModel, GgufError> {
        let path = path.as_ref();
        let first = GgufFile::open(path)?;
        let by_name = parse_shard_path(path);
        let (this_index, count) = split_position(&first, by_name.as_ref().map(|(_, i, n)| (*i, *n)))?;

        let shards = if count == 1 {
            vec![first]
        } else {
            let Some((prefix, _, _)) = by_name else {
                return Err(GgufError::BadSplit {
                    file: path.to_path_buf(),
                    key: KEY_SPLIT_COUNT.into(),
                    reason: format!(
                        "the file is shard {} of {count}, but its name does not end in -0000k-of-0000n.gguf, so the \
                         other shards cannot be found; rename the files as gguf-split wrote them",
                        this_index + 1
                    ),
                });
            };
            let mut first = Some(first);
            // Not `with_capacity(count)`: the count comes from the file, and a missing shard ends the loop early.
            let mut shards = Vec::new();
            for index in 0..count {
                let mut shard = if index == this_index {
                    first.take().expect("the opened shard is placed once")
                } else {
                    let shard_file = shard_path(&prefix, index, count);
                    if !shard_file.is_file() {
                        return Err(GgufError::MissingShard {
                            file: path.to_path_buf(),
                            missing: shard_file,
                            shard_no: index as u64 + 1,
                        });
                    }
                    let shard = GgufFile::open_shard(&shard_file, index)?;
                    let (i, n) = split_position(&shard, Some((index, count)))?;
                    debug_assert_eq!((i, n), (index, count));
                    shard
                };
                shard.set_shard(index);
                shards.push(shard);
            }
            shards
        };
        Self::from_shards(shards)
    }

    /// Joins parsed shards (in order) into one model; checks tensor names and `split.tensors.count`.
    fn from_shards(shards: Vec<GgufFile>) -> Result<GgufModel, GgufError> {
        let total: usize = shards.iter().map(|s| s.tensors().len()).sum();
        let mut tensors = Vec::with_capacity(total);
        let mut index: HashMap<String, usize> = HashMap::with_capacity(total);
        for shard in &shards {
            for (i, t) in shard.tensors().iter().enumerate() {
                if let Some(&earlier) = index.get(&t.name) {
                    let first_file = shards[tensors_shard(&tensors, earlier)].path().to_path_buf();
                    return Err(GgufError::DuplicateTensorAcrossShards {
                        file: shard.path().to_path_buf(),
                        tensor: t.name.clone(),
                        offset: shard.info_offset(i),
                        first_file,
                    });
                }
                index.insert(t.name.clone(), tensors.len());
                tensors.push(t.clone());
            }
        }
        let head = &shards[0];
        if let Some(v) = head.metadata().get(KEY_SPLIT_TENSORS_COUNT) {
            let expected = v.as_i64();
            if expected != Some(tensors.len() as i64) {
                return Err(GgufError::SplitTensorCount {
                    file: head.path().to_path_buf(),
                    key: KEY_SPLIT_TENSORS_COUNT.into(),
                    expected: v.to_string(),
                    found: tensors.len(),
                    shards: shards.len(),
                });
            }
        }
        Ok(GgufModel { shards, tensors, index })
    }

    /// The metadata of shard 0 (for a set, `split.*` keys included).
    pub fn metadata(&self) -> &Metadata {
        self.shards[0].metadata()
    }

    /// Every tensor of every shard, shard by shard in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of tensor `info` (`info.n_bytes` bytes), a zero-copy slice of the memory map of its shard.
    /// Empty for an info that belongs to no shard of this model.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        self.shards.get(info.shard).map_or(&[], |s| s.tensor_data(info))
    }

    /// [`GgufFile::release_range`] of `info` in its shard.
    pub fn release_range(&self, info: &TensorInfo, range: std::ops::Range<usize>) {
        if let Some(s) = self.shards.get(info.shard) {
            s.release_range(info, range);
        }
    }

    /// The files of the model, in shard order.
    pub fn paths(&self) -> Vec<&Path> {
        self.shards.iter().map(GgufFile::path).collect()
    }

    /// The parsed shards, in order.
    pub fn shards(&self) -> &[GgufFile] {
        &self.shards
    }

    /// Sum of the data sizes of all tensors, in bytes (without alignment padding).
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

fn tensors_shard(tensors: &[TensorInfo], i: usize) -> usize {
    tensors.get(i).map_or(0, |t| t.shard)
}

/// A file's (index from 0, count) in its shard set, from its `split.*` keys and its file name (`by_name`), which
/// must agree when both are present. A file with neither is (0, 1).
fn split_position(file: &GgufFile, by_name: Option<(usize, usize)>) -> Result<(usize, usize), GgufError> {
    let md = file.metadata();
    let bad = |key: &str, reason: String| GgufError::BadSplit {
        file: file.path().to_path_buf(),
        key: key.into(),
        reason,
    };
    let key_usize = |key: &str| -> Result<Option<usize>, GgufError> {
        match md.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(key, format!("holds {v}, expected a non-negative integer"))),
        }
    };
    let key_count = key_usize(KEY_SPLIT_COUNT)?;
    let key_no = key_usize(KEY_SPLIT_NO)?;
    let (index, count) = match (key_count, by_name) {
        (Some(0), _) => return Err(bad(KEY_SPLIT_COUNT, "is 0".into())),
        (Some(count), Some((name_index, name_count))) => {
            if count != name_count {
                return Err(bad(
                    KEY_SPLIT_COUNT,
                    format!("is {count} but the file name says the set has {name_count} shards"),
                ));
            }
            let index = key_no.unwrap_or(name_index);
            if index != name_index {
                return Err(bad(
                    KEY_SPLIT_NO,
                    format!(
                        "is {index} (from 0) but the file name says shard {} (from 1)",
                        name_index + 1
                    ),
                ));
            }
            (index, count)
        }
        (Some(count), None) => (key_no.unwrap_or(0), count),
        (None, Some(pos)) => pos,
        (None, None) => (key_no.unwrap_or(0), 1),
    };
    if index >= count {
        return Err(bad(
            KEY_SPLIT_NO,
            format!("is {index}, not below {KEY_SPLIT_COUNT} = {count}"),
        ));
    }
    Ok((index, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_round_trip() {
        let p = shard_path(Path::new("/m/qwen3-30b"), 1, 3);
        assert_eq!(p, Path::new("/m/qwen3-30b-00002-of-00003.gguf"));
        assert_eq!(parse_shard_path(&p), Some((PathBuf::from("/m/qwen3-30b"), 1, 3)));
        for bad in [
            "/m/a.gguf",
            "/m/a-00000-of-00003.gguf",
            "/m/a-00004-of-00003.gguf",
            "/m/-00001-of-00002.gguf",
        ] {
            assert_eq!(parse_shard_path(Path::new(bad)), None, "{bad}");
        }
        assert_eq!(
            parse_shard_path(Path::new("x-1-of-2-00001-of-00002.gguf")).unwrap().0,
            Path::new("x-1-of-2")
        );
    }
}
