//! The CPU engine end to end: goldens from llama.cpp, real and generated models, the ops, the model generator.
//!
//! One test binary per area (each links the engine once); each module is one former test file.

mod batch;
#[path = "../common/batched.rs"]
mod batched;
mod generator;
mod goldens;
mod grammar;
mod models;
mod ops;
