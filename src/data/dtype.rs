//! Token dtypes and their `.idx` codes.

/// Element type of a dataset's `.bin`, with Megatron's (numpy's) `.idx` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `np.uint8`, code 1.
    U8,
    /// `np.int8`, code 2.
    I8,
    /// `np.int16`, code 3.
    I16,
    /// `np.int32`, code 4.
    I32,
    /// `np.int64`, code 5.
    I64,
    /// `np.float64`, code 6.
    F64,
    /// `np.float32`, code 7.
    F32,
    /// `np.uint16`, code 8.
    U16,
}

impl DType {
    /// The `.idx` code.
    pub fn code(self) -> u8 {
        match self {
            Self::U8 => 1,
            Self::I8 => 2,
            Self::I16 => 3,
            Self::I32 => 4,
            Self::I64 => 5,
            Self::F64 => 6,
            Self::F32 => 7,
            Self::U16 => 8,
        }
    }

    /// The dtype of an `.idx` code, if it is one.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::U8,
            2 => Self::I8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            6 => Self::F64,
            7 => Self::F32,
            8 => Self::U16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 | Self::F32 => 4,
            Self::I64 | Self::F64 => 8,
        }
    }

    /// numpy's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "uint8",
            Self::I8 => "int8",
            Self::I16 => "int16",
            Self::I32 => "int32",
            Self::I64 => "int64",
            Self::F64 => "float64",
            Self::F32 => "float32",
            Self::U16 => "uint16",
        }
    }

    /// Megatron's rule for token storage: `uint16` when the (unpadded) vocabulary has
    /// strictly fewer than 65500 entries, else `int32`.
    pub fn for_vocab_size(vocab_size: usize) -> Self {
        if vocab_size < 65500 {
            Self::U16
        } else {
            Self::I32
        }
    }

    /// Whether ferrotron can read and write token ids of this type.
    pub fn is_token_type(self) -> bool {
        matches!(self, Self::U16 | Self::I32)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_vocab_rule_matches_megatron() {
        for code in 0..=255u8 {
            if let Some(d) = DType::from_code(code) {
                assert_eq!(d.code(), code);
            }
        }
        assert_eq!(DType::for_vocab_size(50257), DType::U16);
        assert_eq!(DType::for_vocab_size(65499), DType::U16);
        assert_eq!(DType::for_vocab_size(65500), DType::I32);
        assert_eq!(DType::for_vocab_size(128256), DType::I32);
    }
}
