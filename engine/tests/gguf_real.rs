//! The GGUF reader on the real default model (SmolLM2-135M-Instruct Q4_1), and corrupted copies of it.

use std::path::PathBuf;

use strata_engine::gguf::{GgufFile, GgufModel};
use strata_engine::models;

/// The cached default model; fails (not skips) when absent, since CI fetches models first.
fn smollm2_path() -> PathBuf {
    let path = models::cached(models::DEFAULT_MODEL_FILE);
    assert!(
        path.is_file(),
        "{} is missing: run ci/fetch-models.sh first",
        path.display()
    );
    path
}

#[test]
fn smollm2_metadata_and_tensors() {
    let path = smollm2_path();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    let md = f.metadata();
    assert_eq!(md.architecture().unwrap(), "llama");
    assert_eq!(md.get_u64("llama.block_count").unwrap(), 30);
    // Counts from the `gguf` Python package (GGUFReader): 272 tensors, data section at byte 1785664.
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.data_offset(), 1_785_664);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.file_bytes(), std::fs::metadata(&path).unwrap().len());
    let tokens = md.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    let mut total = 0;
    for t in f.tensors() {
        let row_bytes = t.ty.row_bytes(t.dims[0]).unwrap();
        let rows: u64 = t.dims[1..].iter().product();
        let data = f.tensor_data(t);
        assert_eq!(data.len() as u64, row_bytes * rows, "{}", t.name);
        assert_eq!(data.len() as u64, t.n_bytes, "{}", t.name);
        assert_eq!(t.shard, 0);
        total += t.n_bytes;
    }
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, vec![576, 49152]);
    assert_eq!(embd.offset, 0);

    let model = GgufModel::open(&path).unwrap();
    assert_eq!(model.paths(), vec![path.as_path()]);
    assert_eq!(model.tensors().len(), 272);
    assert_eq!(model.total_tensor_bytes(), total);
    let t = model.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(
        model.tensor_data(t),
        f.tensor_data(f.tensor("blk.29.ffn_down.weight").unwrap())
    );
}
