//! The safetensors element types and their sizes.

use std::fmt;

/// An element type of the safetensors format.
///
/// Sub-byte types (`F4`, `F6_*`) are stored packed; [`Dtype::bits`] gives their width and
/// [`Dtype::bytes_for`] the packed byte count of a number of elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    /// AMD's fp8 variants (finite, no negative zero, unsigned-zero NaN).
    F8E4M3FNUZ,
    F8E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

/// Every dtype, in the order of the safetensors specification.
pub const ALL_DTYPES: [Dtype; 22] = [
    Dtype::Bool,
    Dtype::F4,
    Dtype::F6E2M3,
    Dtype::F6E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8E5M2,
    Dtype::F8E4M3,
    Dtype::F8E8M0,
    Dtype::F8E4M3FNUZ,
    Dtype::F8E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

impl Dtype {
    /// The name used in safetensors headers (`"BF16"`, `"F8_E4M3"` ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::F8E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Parses a header dtype name; `None` for a name the format does not define.
    pub fn parse(name: &str) -> Option<Dtype> {
        ALL_DTYPES.iter().copied().find(|d| d.name() == name)
    }

    /// Width of one element in bits.
    pub fn bits(self) -> usize {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 8,
            Dtype::F8E5M2 | Dtype::F8E4M3 | Dtype::F8E8M0 => 8,
            Dtype::F8E4M3FNUZ | Dtype::F8E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// Whole bytes per element, or `None` for packed sub-byte types.
    pub fn itemsize(self) -> Option<usize> {
        let bits = self.bits();
        (bits % 8 == 0).then_some(bits / 8)
    }

    /// Bytes taken by `numel` elements; `None` on overflow or for a packed type whose elements
    /// do not end on a byte boundary.
    pub fn bytes_for(self, numel: u64) -> Option<u64> {
        let bits = numel.checked_mul(self.bits() as u64)?;
        (bits % 8 == 0).then_some(bits / 8)
    }

    /// Whether the copy engine can convert values of this type (F32, F16, BF16, F64).
    pub fn is_convertible_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips() {
        for d in ALL_DTYPES {
            assert_eq!(Dtype::parse(d.name()), Some(d));
        }
        assert_eq!(Dtype::parse("bf16"), None);
        assert_eq!(Dtype::parse("F128"), None);
        assert_eq!(Dtype::parse("F8_E4M3FNUZ"), Some(Dtype::F8E4M3FNUZ));
        assert_eq!(Dtype::F8E5M2FNUZ.bits(), 8);
    }

    #[test]
    fn packed_types_need_whole_bytes() {
        assert_eq!(Dtype::F4.bytes_for(4), Some(2));
        assert_eq!(Dtype::F4.bytes_for(3), None);
        assert_eq!(Dtype::F6E2M3.bytes_for(4), Some(3));
        assert_eq!(Dtype::BF16.bytes_for(3), Some(6));
        assert_eq!(Dtype::F64.bytes_for(u64::MAX), None);
    }
}
