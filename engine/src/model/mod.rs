//! Architectures: hyper-parameters from metadata, `strata inspect`'s summary, and the model generator
//! (synthetic and upcycled GGUFs).

pub mod hparams;
pub mod inspect;
pub mod synth;
pub mod upcycle;

pub use hparams::{Arch, HParams, HParamsError};
