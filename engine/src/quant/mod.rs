//! Block quantization formats: layout, dequantize, dot products (CPU reference and SIMD), quantize.

pub mod types;

pub use types::{Geometry, GgmlType, QK_K};
