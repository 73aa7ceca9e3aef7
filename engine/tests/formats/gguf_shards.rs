//! Shard sets as llama.cpp's gguf-split writes them: opening any shard gives the whole model; broken sets are
//! errors that name the file at fault.

use std::path::{Path, PathBuf};

use strata_engine::gguf::{
    GgufError, GgufFile, GgufModel, GgufWriter, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, Metadata,
    TensorSpec, Value, ValueType, shard_path, write_shard_set,
};
use strata_engine::quant::types::GgmlType;

fn metadata() -> Metadata {
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    md.insert("llama.block_count", Value::U32(2));
    md.insert(
        "tokenizer.ggml.tokens",
        Value::Array(ValueType::String, vec![Value::String("<s>".into())]),
    );
    md
}

fn tensors() -> Vec<(TensorSpec, Vec<u8>)> {
    let specs = [
        TensorSpec::new("token_embd.weight", &[32, 4], GgmlType::Q4_0),
        TensorSpec::new("blk.0.attn_norm.weight", &[32], GgmlType::F32),
        TensorSpec::new("blk.0.ffn_up.weight", &[256, 3], GgmlType::Q4_K),
        TensorSpec::new("blk.1.attn_norm.weight", &[32], GgmlType::F32),
        TensorSpec::new("blk.1.ffn_up.weight", &[256, 3], GgmlType::Q6_K),
        TensorSpec::new("output_norm.weight", &[32], GgmlType::F32),
        TensorSpec::new("output.weight", &[32, 4], GgmlType::Q8_0),
    ];
    specs
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.ty.row_bytes(s.dims[0]).unwrap() * s.dims[1..].iter().product::<u64>();
            (s, (0..n).map(|b| (b as usize * 13 + i) as u8).collect())
        })
        .collect()
}

fn borrowed(t: &[(TensorSpec, Vec<u8>)]) -> Vec<(TensorSpec, &[u8])> {
    t.iter().map(|(s, d)| (s.clone(), d.as_slice())).collect()
}

#[test]
fn three_shards_open_from_any_shard_as_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    let (md, data) = (metadata(), tensors());
    let plain = dir.path().join("plain.gguf");
    GgufWriter::write_file(&plain, &md, &borrowed(&data)).unwrap();
    let paths = write_shard_set(dir.path().join("model"), &md, &borrowed(&data), 3).unwrap();
    assert_eq!(paths[2], dir.path().join("model-00003-of-00003.gguf"));

    // Every shard carries the split keys; only shard 0 the model's metadata.
    let s1 = GgufFile::open(&paths[1]).unwrap();
    assert_eq!(s1.metadata().get_u64(KEY_SPLIT_NO).unwrap(), 1);
    assert!(!s1.metadata().contains("general.architecture"));

    let whole = GgufModel::open(&plain).unwrap();
    assert_eq!(whole.paths(), vec![plain.as_path()]);
    for opened in &paths {
        let model = GgufModel::open(opened).unwrap();
        assert_eq!(model.paths(), paths.iter().map(PathBuf::as_path).collect::<Vec<_>>());
        let md0 = model.metadata();
        assert_eq!(md0.get(KEY_SPLIT_COUNT), Some(&Value::U16(3)));
        assert_eq!(md0.get(KEY_SPLIT_NO), Some(&Value::U16(0)));
        assert_eq!(md0.get(KEY_SPLIT_TENSORS_COUNT), Some(&Value::I32(7)));
        let without_split: Vec<_> = md0.iter().filter(|(k, _)| !k.starts_with("split.")).collect();
        assert_eq!(without_split, whole.metadata().iter().collect::<Vec<_>>());
        assert_eq!(model.tensors().len(), whole.tensors().len());
        assert_eq!(model.total_tensor_bytes(), whole.total_tensor_bytes());
        for (a, b) in model.tensors().iter().zip(whole.tensors()) {
            assert_eq!((&a.name, &a.dims, a.ty, a.n_bytes), (&b.name, &b.dims, b.ty, b.n_bytes));
            assert_eq!(model.tensor_data(a), whole.tensor_data(b), "{}", a.name);
            assert_eq!(model.tensor(&a.name), Some(a));
        }
        let shards: Vec<usize> = model.tensors().iter().map(|t| t.shard).collect();
        assert_eq!(shards, vec![0, 0, 1, 1, 2, 2, 2]);
    }
}

#[test]
fn missing_shard_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard_set(dir.path().join("m"), &metadata(), &borrowed(&tensors()), 3).unwrap();
    std::fs::remove_file(&paths[0]).unwrap();
    let err = GgufModel::open(&paths[1]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, GgufError::MissingShard { shard_no: 1, .. }), "{msg}");
    assert!(
        msg.contains(&paths[0].display().to_string()) && msg.contains("does not exist"),
        "{msg}"
    );
}

/// Writes shard `no` of `count` holding `names` (from [`tensors`]) with the given split keys.
fn write_shard(prefix: &Path, no: usize, count: usize, names: &[&str], tensors_count: i32) -> PathBuf {
    let data = tensors();
    let mut md = if no == 0 { metadata() } else { Metadata::new() };
    md.insert(KEY_SPLIT_NO, Value::U16(no as u16));
    md.insert(KEY_SPLIT_COUNT, Value::U16(count as u16));
    md.insert(KEY_SPLIT_TENSORS_COUNT, Value::I32(tensors_count));
    let chosen: Vec<_> = data.iter().filter(|(s, _)| names.contains(&s.name.as_str())).collect();
    let chosen: Vec<(TensorSpec, &[u8])> = chosen.iter().map(|(s, d)| (s.clone(), d.as_slice())).collect();
    let path = shard_path(prefix, no, count);
    GgufWriter::write_file(&path, &md, &chosen).unwrap();
    path
}

#[test]
fn duplicate_tensor_across_shards() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("dup");
    let p0 = write_shard(&prefix, 0, 2, &["token_embd.weight", "output.weight"], 3);
    let p1 = write_shard(&prefix, 1, 2, &["output_norm.weight", "output.weight"], 3);
    let err = GgufModel::open(&p0).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, GgufError::DuplicateTensorAcrossShards { .. }), "{msg}");
    for needle in [
        p0.display().to_string(),
        p1.display().to_string(),
        "`output.weight`".into(),
        "offset".into(),
    ] {
        assert!(msg.contains(&needle), "message lacks {needle}: {msg}");
    }
}

#[test]
fn split_tensor_count_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("cnt");
    let p0 = write_shard(&prefix, 0, 2, &["token_embd.weight"], 5);
    write_shard(&prefix, 1, 2, &["output.weight"], 5);
    let err = GgufModel::open(&p0).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, GgufError::SplitTensorCount { found: 2, .. }), "{msg}");
    assert!(
        msg.contains(&p0.display().to_string()) && msg.contains("split.tensors.count"),
        "{msg}"
    );
}

#[test]
fn split_keys_must_match_file_names() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard_set(dir.path().join("m"), &metadata(), &borrowed(&tensors()), 2).unwrap();

    // Shard 2 of 2 renamed as shard 1 of 3.
    let renamed = dir.path().join("x-00001-of-00003.gguf");
    std::fs::copy(&paths[1], &renamed).unwrap();
    let err = GgufModel::open(&renamed).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, GgufError::BadSplit { ref key, .. } if key == KEY_SPLIT_COUNT),
        "{msg}"
    );
    assert!(msg.contains("x-00001-of-00003.gguf"), "{msg}");

    // Right count, wrong position.
    let renamed = dir.path().join("y-00001-of-00002.gguf");
    std::fs::copy(&paths[1], &renamed).unwrap();
    let err = GgufModel::open(&renamed).unwrap_err();
    assert!(
        matches!(err, GgufError::BadSplit { ref key, .. } if key == KEY_SPLIT_NO),
        "{err}"
    );

    // A shard whose name does not say where its siblings are.
    let renamed = dir.path().join("loose.gguf");
    std::fs::copy(&paths[0], &renamed).unwrap();
    let err = GgufModel::open(&renamed).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, GgufError::BadSplit { .. }) && msg.contains("loose.gguf"),
        "{msg}"
    );
}

#[test]
fn shard_named_set_without_split_keys() {
    // Files named by the convention but carrying no split keys are still joined, by name.
    let dir = tempfile::tempdir().unwrap();
    let data = tensors();
    let prefix = dir.path().join("named");
    let (a, b) = data.split_at(3);
    GgufWriter::write_file(shard_path(&prefix, 0, 2), metadata(), &borrowed(a)).unwrap();
    GgufWriter::write_file(shard_path(&prefix, 1, 2), Metadata::new(), &borrowed(b)).unwrap();
    let model = GgufModel::open(shard_path(&prefix, 1, 2)).unwrap();
    assert_eq!(model.tensors().len(), 7);
    assert_eq!(model.metadata().architecture().unwrap(), "llama");
}
