//! Strata's engine: GGUF models, quantization formats, tokenizers and (in later modules) the forward pass,
//! backends, expert cache and server.

pub mod backend;
pub mod gguf;
pub mod model;
pub mod models;
pub mod quant;
pub mod runtime;
pub mod serve;
pub mod tokenizer;
