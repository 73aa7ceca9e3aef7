//! The file formats and the tokenizer: GGUF reading, errors, crashes and shard sets; quant goldens; tokenizers and chat templates.
//!
//! One test binary per area (each links the engine once); each module is one former test file.

mod gguf_crashes;
mod gguf_errors;
mod gguf_real;
mod gguf_shards;
mod quant_goldens;
mod tokenizer_models;
mod tokenizer_template;
mod tokenizer_template_goldens;
mod tokenizer_vectors;
