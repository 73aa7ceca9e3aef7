//! Strata's engine: GGUF models, quantization formats, tokenizers, the forward pass over its backends, and the
//! server. Modules are layered (DESIGN.md section 2); none imports a layer above it:
//! (1) [`quant`], [`gguf`], [`tokenizer`], [`events`], [`paths`], [`switches`], [`rng`]; (2) [`device`];
//! (3) [`state`], [`experts`]; (4) [`backend`]; (5) [`model`], [`fixtures`], [`models`]; (6) [`memory`];
//! (7) [`runtime`]; (8) [`serve`].

pub mod backend;
pub mod device;
pub mod events;
pub mod experts;
pub mod fixtures;
pub mod gguf;
pub mod memory;
pub mod model;
pub mod models;
pub mod paths;
pub mod quant;
pub mod rng;
pub mod runtime;
pub mod serve;
pub mod state;
pub mod switches;
pub mod tokenizer;
