//! Per-sequence state that backends write, sized from numbers rather than model types: the KV cache layout
//! ([`kv`]) and the batch layout of a step ([`batch`]: which token belongs to which sequence, at which
//! position). Paged blocks and recurrent state live here too as they arrive (DESIGN.md section 2).

pub mod batch;
pub mod kv;
