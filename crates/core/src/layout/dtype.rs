//! Element types, named as safetensors names them, with their sizes and cast rules.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The element type of a tensor. Every safetensors dtype that torch can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// `bool`, one byte per element.
    #[serde(rename = "BOOL")]
    Bool,
    /// `uint8`.
    U8,
    /// `int8`.
    I8,
    /// `float8_e4m3fn`.
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    /// `float8_e5m2`.
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
    /// `int16`.
    I16,
    /// `uint16`.
    U16,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `int32`.
    I32,
    /// `uint32`.
    U32,
    /// `float32`.
    F32,
    /// `float64`.
    F64,
    /// `int64`.
    I64,
    /// `uint64`.
    U64,
}

impl DType {
    /// All dtypes, in safetensors' order.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::F64,
        DType::I64,
        DType::U64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The safetensors name (`"F32"`, `"BF16"`, `"F8_E4M3"`, …).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::U64 => "U64",
        }
    }

    /// True for the floating types reshard can cast between (f16, bf16, f32, f64).
    /// fp8 tensors are floating too but move as bytes only.
    pub fn is_castable_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// The dtype named `s` when a cast may target it (f16, bf16, f32 or f64, by any name
    /// [`FromStr`] takes): an unknown name, or a dtype no cast targets, is refused with the
    /// accepted names listed.
    pub fn cast_target(s: &str) -> Result<DType, String> {
        match s.parse::<DType>() {
            Ok(d) if d.is_castable_float() => Ok(d),
            Ok(d) => Err(format!(
                "cannot cast to {d}: only floating dtypes (f16, bf16, f32, f64) can be targets"
            )),
            Err(_) => Err(format!(
                "unknown dtype `{s}` (expected f16, bf16, f32 or f64; torch's names float16, \
                 bfloat16, float32, float64 too)"
            )),
        }
    }

    /// True for every floating type, fp8 included.
    pub fn is_float(self) -> bool {
        self.is_castable_float() || matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    /// Whether values of `self` may be converted to `to`: identity, or between f16/bf16/f32/f64.
    /// Casts between unrelated kinds (float → int, int → float, fp8) are refused.
    pub fn can_cast_to(self, to: DType) -> bool {
        self == to || (self.is_castable_float() && to.is_castable_float())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    /// Accepts safetensors names (`F32`, `BF16`) and torch names (`float32`, `bfloat16`, `bf16`).
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        let d = match lower.as_str() {
            "bool" => DType::Bool,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "f8_e4m3" | "float8_e4m3fn" | "f8e4m3" => DType::F8E4M3,
            "f8_e5m2" | "float8_e5m2" | "f8e5m2" => DType::F8E5M2,
            "i16" | "int16" | "short" => DType::I16,
            "u16" | "uint16" => DType::U16,
            "f16" | "float16" | "half" | "fp16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" | "int" => DType::I32,
            "u32" | "uint32" => DType::U32,
            "f32" | "float32" | "float" | "fp32" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i64" | "int64" | "long" => DType::I64,
            "u64" | "uint64" => DType::U64,
            _ => {
                return Err(format!(
                    "unknown dtype `{s}` (expected bool, u8, i8, f8_e4m3, f8_e5m2, i16, u16, \
                     f16, bf16, i32, u32, f32, f64, i64 or u64, in either case; torch's names \
                     such as float32 and bfloat16 too)"
                ))
            }
        };
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
            assert!(matches!(d.size(), 1 | 2 | 4 | 8));
        }
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert!("complex32".parse::<DType>().is_err());
    }

    #[test]
    fn refusals_list_the_accepted_names() {
        let e = "fp8".parse::<DType>().unwrap_err();
        assert!(
            e.starts_with("unknown dtype `fp8` (expected bool, u8, "),
            "{e}"
        );
        // every dtype is listed, by a name that is accepted
        let list = e["unknown dtype `fp8` (expected ".len()..e.find(", in either").unwrap()]
            .replace(" or ", ", ");
        let listed: Vec<DType> = list.split(", ").map(|n| n.parse().unwrap()).collect();
        assert_eq!(listed, DType::ALL);
        assert_eq!(DType::cast_target("BFloat16"), Ok(DType::BF16));
        assert_eq!(
            DType::cast_target("fp8"),
            Err(
                "unknown dtype `fp8` (expected f16, bf16, f32 or f64; torch's names float16, \
                 bfloat16, float32, float64 too)"
                    .to_string()
            )
        );
        assert_eq!(
            DType::cast_target("int32"),
            Err(
                "cannot cast to I32: only floating dtypes (f16, bf16, f32, f64) can be targets"
                    .to_string()
            )
        );
    }

    #[test]
    fn cast_rules() {
        assert!(DType::BF16.can_cast_to(DType::F32));
        assert!(DType::F32.can_cast_to(DType::F16));
        assert!(!DType::F32.can_cast_to(DType::I32));
        assert!(!DType::I64.can_cast_to(DType::F64));
        assert!(!DType::F8E4M3.can_cast_to(DType::F32));
        assert!(DType::I64.can_cast_to(DType::I64));
    }
}
