//! Reading tensor regions as typed `ndarray` arrays.

use crate::error::{Error, Result};
use crate::layout::{DType, Region};
use crate::Checkpoint;
use ndarray::{ArrayD, IxDyn};

/// A Rust element type with a reshard dtype and a little-endian decoding.
pub trait Element: Copy {
    /// The dtype whose bytes decode to `Self`.
    const DTYPE: DType;
    /// Decode one element from its little-endian bytes (`DTYPE.size()` of them).
    fn from_le(b: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn from_le(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..std::mem::size_of::<$t>()]);
                <$t>::from_le_bytes(a)
            }
        }
    };
}

element!(u8, DType::U8);
element!(i8, DType::I8);
element!(i16, DType::I16);
element!(u16, DType::U16);
element!(i32, DType::I32);
element!(u32, DType::U32);
element!(i64, DType::I64);
element!(u64, DType::U64);
element!(f32, DType::F32);
element!(f64, DType::F64);

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn from_le(b: &[u8]) -> Self {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn from_le(b: &[u8]) -> Self {
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn from_le(b: &[u8]) -> Self {
        b[0] != 0
    }
}

impl Checkpoint {
    /// Read `region` of tensor `name` as an array of `T`. The tensor's dtype must be `T`'s, or
    /// a floating dtype convertible to it (f16, bf16, f32, f64 among themselves).
    pub fn read_array<T: Element>(&self, name: &str, region: &Region) -> Result<ArrayD<T>> {
        let bytes = self.read_region(name, region, Some(T::DTYPE))?;
        let data: Vec<T> = bytes
            .chunks_exact(T::DTYPE.size())
            .map(T::from_le)
            .collect();
        let shape: Vec<usize> = region.sizes.iter().map(|&s| s as usize).collect();
        ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|e| Error::layout(name, e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_little_endian() {
        assert_eq!(f32::from_le(&1.5f32.to_le_bytes()), 1.5);
        assert_eq!(<i64 as Element>::from_le(&(-3i64).to_le_bytes()), -3);
        assert_eq!(half::bf16::from_le(&[0x80, 0x3f]).to_f32(), 1.0);
        assert!(bool::from_le(&[1]));
    }
}
