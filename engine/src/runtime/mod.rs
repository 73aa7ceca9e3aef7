//! Generation at run time: turning a model's logits into tokens and text (sampling, stop strings).

pub mod fault;
pub mod generate;
pub mod kv;
pub mod sampling;
pub mod session;
