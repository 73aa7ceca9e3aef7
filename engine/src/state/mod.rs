//! Per-sequence state that backends write, sized from numbers rather than model types: the KV cache layout
//! ([`kv`]). The batch layout, paged blocks and recurrent state live here too as they arrive (DESIGN.md
//! section 2).

pub mod kv;
