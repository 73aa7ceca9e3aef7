//! Architectures: hyper-parameters from metadata, `strata inspect`'s summary, and the model generator
//! (synthetic and upcycled GGUFs).

pub mod forward;
pub mod hparams;
pub mod inspect;
pub mod synth;
pub mod upcycle;
pub mod weights;

pub use forward::{ForwardOut, Logits, Model, ModelError, Scratch, TRACE_TENSORS};
pub use hparams::{Arch, HParams, HParamsError};
