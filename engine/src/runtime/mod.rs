//! Generation at run time: turning a model's logits into tokens and text (sampling, stop strings).

pub mod generate;
pub mod sampling;
pub mod session;
