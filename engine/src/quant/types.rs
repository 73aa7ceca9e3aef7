//! The ggml tensor types and their block geometry: one table for every type.
//!
//! Source: the GGUF specification (`ggml_type` in ggml/docs/gguf.md) and ggml's `type_traits` table
//! (`ggml/src/ggml.c`). Type ids are the values stored in a GGUF tensor info; ids that ggml has retired
//! (4, 5, 31..33, 36..38) are not types and parse as unknown.

use std::fmt;

/// Block geometry of one ggml type: a row of `n` elements (n a multiple of `block_elems`) occupies
/// `n / block_elems * block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Elements per block (1 for plain scalar types, 32 for the legacy quants, 256 (`QK_K`) for K and most IQ types).
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

macro_rules! ggml_types {
    ($( $variant:ident = $id:literal, $name:literal, $elems:literal, $bytes:expr; )*) => {
        /// A ggml tensor type, as stored (as a `u32`) in a GGUF tensor info.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u32)]
        pub enum GgmlType {
            $( $variant = $id, )*
        }

        impl GgmlType {
            /// Every type, in id order.
            pub const ALL: &'static [GgmlType] = &[$( GgmlType::$variant, )*];

            /// The type with GGUF id `id`, or `None` for an unknown or retired id.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id {
                    $( $id => Some(GgmlType::$variant), )*
                    _ => None,
                }
            }

            /// The type's name as llama.cpp and `gguf` print it (`Q4_K`, `IQ3_S`, `BF16`...).
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$variant => $name, )* }
            }

            /// Block size and bytes per block.
            pub const fn geometry(self) -> Geometry {
                match self { $( GgmlType::$variant => Geometry { block_elems: $elems, block_bytes: $bytes }, )* }
            }
        }
    };
}

/// `QK_K`: elements per super-block of the K and IQ quants.
pub const QK_K: usize = 256;

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 2 + 16;
    Q4_1 = 3, "Q4_1", 32, 2 + 2 + 16;
    Q5_0 = 6, "Q5_0", 32, 2 + 4 + 16;
    Q5_1 = 7, "Q5_1", 32, 2 + 2 + 4 + 16;
    Q8_0 = 8, "Q8_0", 32, 2 + 32;
    Q8_1 = 9, "Q8_1", 32, 2 + 2 + 32;
    Q2_K = 10, "Q2_K", 256, 16 + 64 + 2 + 2;
    Q3_K = 11, "Q3_K", 256, 32 + 64 + 12 + 2;
    Q4_K = 12, "Q4_K", 256, 2 + 2 + 12 + 128;
    Q5_K = 13, "Q5_K", 256, 2 + 2 + 12 + 32 + 128;
    Q6_K = 14, "Q6_K", 256, 128 + 64 + 16 + 2;
    Q8_K = 15, "Q8_K", 256, 4 + 256 + 32;
    IQ2_XXS = 16, "IQ2_XXS", 256, 2 + 64;
    IQ2_XS = 17, "IQ2_XS", 256, 2 + 64 + 8;
    IQ3_XXS = 18, "IQ3_XXS", 256, 2 + 96;
    IQ1_S = 19, "IQ1_S", 256, 2 + 32 + 16;
    IQ4_NL = 20, "IQ4_NL", 32, 2 + 16;
    IQ3_S = 21, "IQ3_S", 256, 2 + 64 + 8 + 32 + 4;
    IQ2_S = 22, "IQ2_S", 256, 2 + 64 + 8 + 8;
    IQ4_XS = 23, "IQ4_XS", 256, 2 + 2 + 4 + 128;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", 256, 32 + 16 + 8;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", 256, 48 + 4 + 2;
    TQ2_0 = 35, "TQ2_0", 256, 64 + 2;
    MXFP4 = 39, "MXFP4", 32, 1 + 16;
}

impl GgmlType {
    /// The GGUF id of this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type named `name` (case-insensitive, as printed by [`GgmlType::name`]).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Bytes taken by a row of `n_elems` elements, or `None` when `n_elems` is not a whole number of
    /// blocks or the size overflows `u64`.
    pub fn row_bytes(self, n_elems: u64) -> Option<u64> {
        let g = self.geometry();
        if !n_elems.is_multiple_of(g.block_elems as u64) {
            return None;
        }
        (n_elems / g.block_elems as u64).checked_mul(g.block_bytes as u64)
    }

    /// Bits per weight (block bytes × 8 ÷ block elements), as llama.cpp reports model sizes.
    pub fn bits_per_weight(self) -> f64 {
        let g = self.geometry();
        g.block_bytes as f64 * 8.0 / g.block_elems as f64
    }
}

/// Serializes as the type's name (`"Q4_K"`), as reports and JSON events print it.
impl serde::Serialize for GgmlType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_unknown() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
            assert_eq!(GgmlType::from_id(retired), None, "id {retired}");
        }
    }

    #[test]
    fn bits_per_weight_match_llama_cpp() {
        // Figures llama.cpp prints for these types (bpw).
        for (t, bpw) in [
            (GgmlType::Q4_0, 4.5),
            (GgmlType::Q4_K, 4.5),
            (GgmlType::Q6_K, 6.5625),
            (GgmlType::IQ2_XS, 2.3125),
            (GgmlType::IQ3_S, 3.4375),
            (GgmlType::IQ4_XS, 4.25),
            (GgmlType::Q8_0, 8.5),
        ] {
            assert_eq!(t.bits_per_weight(), bpw, "{t}");
        }
    }

    #[test]
    fn row_bytes_rejects_partial_blocks_and_overflow() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None);
    }
}
