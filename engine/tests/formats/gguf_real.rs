//! The GGUF reader on the real default model (SmolLM2-135M-Instruct Q4_1), and corrupted copies of it.

use std::path::PathBuf;

use strata_engine::gguf::{GgufFile, GgufHeader, GgufModel};
use strata_engine::models;

/// The cached default model; fails (not skips) when absent, since CI fetches models first.
fn smollm2_path() -> PathBuf {
    models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"))
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

/// SplitMix64: a seeded generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn truncated_copies_are_errors() {
    let bytes = std::fs::read(smollm2_path()).unwrap();
    let data_offset = GgufFile::from_bytes("smollm2", bytes.clone()).unwrap().data_offset() as usize;
    let mut rng = Rng(0x5eed_0001);
    // Two cuts inside the header, three inside the tensor data; a cut at the very end removes only the padding
    // after the last tensor, if any, and may parse.
    let cuts: Vec<usize> = (0..5)
        .map(|i| if i < 2 { rng.below(data_offset as u64) } else { rng.below(bytes.len() as u64) } as usize)
        .collect();
    for cut in cuts {
        let result = GgufHeader::parse("smollm2-cut", &bytes[..cut]);
        let last_end = result.as_ref().ok().map(|h| {
            h.tensors()
                .iter()
                .map(|t| h.data_offset() + t.offset + t.n_bytes)
                .max()
                .unwrap_or(0)
        });
        match result {
            Err(e) => assert!(e.to_string().contains("smollm2-cut"), "{e}"),
            Ok(_) => assert!(
                last_end.unwrap() <= cut as u64,
                "cut at {cut} parsed but cuts tensor data"
            ),
        }
    }
    // Cutting exactly at the end of the last tensor's data parses.
    let f = GgufFile::from_bytes("smollm2", bytes.clone()).unwrap();
    let end = f
        .tensors()
        .iter()
        .map(|t| f.data_offset() + t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    assert!(GgufHeader::parse("smollm2-cut", &bytes[..end]).is_ok());
    assert!(GgufHeader::parse("smollm2-cut", &bytes[..end - 1]).is_err());
}

#[test]
fn header_byte_flips_never_panic() {
    let mut bytes = std::fs::read(smollm2_path()).unwrap();
    let data_offset = GgufHeader::parse("smollm2", &bytes).unwrap().data_offset();
    let mut rng = Rng(0x5eed_0002);
    let (mut ok, mut err) = (0, 0);
    for _ in 0..1000 {
        let at = rng.below(data_offset) as usize;
        let mask = (rng.below(255) + 1) as u8;
        bytes[at] ^= mask;
        match GgufHeader::parse("smollm2-flipped", &bytes) {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(e.to_string().contains("smollm2-flipped"), "{e}");
                err += 1;
            }
        }
        bytes[at] ^= mask;
    }
    // Most flips land in token strings and still parse; flips in lengths, counts and tags do not.
    assert_eq!(ok + err, 1000);
    assert!(err > 0, "no flip was detected");
}
