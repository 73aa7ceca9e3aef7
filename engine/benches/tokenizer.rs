//! Tokenizer speed on the largest test vocabularies: build time, and encode time on growing text (which should
//! grow linearly). Prints numbers; run with `cargo bench -p strata-engine --bench tokenizer` after
//! `ci/fetch-models.sh`.

use std::time::Instant;

use strata_engine::gguf::GgufFile;
use strata_engine::models::{GEMMA3_MODEL_FILE, VOCAB_DIR, models_dir};
use strata_engine::tokenizer::Tokenizer;

fn main() {
    println!(
        "{:<28} {:>8} {:>10} {:>12} {:>12} {:>14}",
        "vocabulary", "tokens", "build ms", "1x enc ms", "64x enc ms", "64x/1x ratio"
    );
    for path in [
        models_dir().join(VOCAB_DIR).join("ggml-vocab-qwen2.gguf"),
        models_dir().join(GEMMA3_MODEL_FILE),
    ] {
        if !path.is_file() {
            eprintln!("{} is missing: run ci/fetch-models.sh", path.display());
            std::process::exit(1);
        }
        let gguf = GgufFile::open(&path).expect("vocabulary GGUF opens");
        let mut build_ms = f64::INFINITY;
        let mut built = None;
        for _ in 0..3 {
            let start = Instant::now();
            built = Some(Tokenizer::from_metadata(gguf.metadata()).expect("tokenizer builds"));
            build_ms = build_ms.min(start.elapsed().as_secs_f64() * 1e3);
        }
        let tok = built.expect("built three times");
        let unit = "The quick brown fox, 12345 jumps over the lazy dog! Ünïcödé 日本語 ";
        let (small, large) = (unit.repeat(32), unit.repeat(32 * 64));
        let time = |text: &str| {
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    tok.encode(text, false, false).expect("encodes");
                    t.elapsed().as_secs_f64() * 1e3
                })
                .fold(f64::INFINITY, f64::min)
        };
        let (small_ms, large_ms) = (time(&small), time(&large));
        println!(
            "{:<28} {:>8} {:>10.0} {:>12.2} {:>12.1} {:>14.1}",
            path.file_name().unwrap().to_string_lossy(),
            tok.vocab_size(),
            build_ms,
            small_ms,
            large_ms,
            large_ms / small_ms
        );
    }
}
