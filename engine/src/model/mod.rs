//! Architectures: hyper-parameters from metadata, and the model generator (synthetic and upcycled GGUFs).

pub mod hparams;

pub use hparams::{Arch, HParams, HParamsError};
