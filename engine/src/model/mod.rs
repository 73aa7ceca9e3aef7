//! Architectures: hyper-parameters from metadata, the weight map, the forward pass and `strata inspect`'s summary
//! (the model generator is [`crate::fixtures`]).

pub mod forward;
pub mod hparams;
pub mod inspect;
pub mod weights;

pub use forward::{ForwardOut, Logits, Model, ModelError, Scratch, TRACE_TENSORS};
pub use hparams::{Arch, HParams, HParamsError};
